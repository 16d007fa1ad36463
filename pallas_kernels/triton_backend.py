"""The GPU backend: Pallas kernels lowered through Triton, composed into fwd / bwd.

Same contract as :mod:`zeco_jax.chunked` (padded, validated inputs; layout [B, T, H, D]):

  fwd: state pass -> scores A -> output
  bwd: state pass (recomputed) -> state-gradient pass -> A, dA -> dv -> dq, dk, dg

Only the inputs live between forward and backward (ops.py saves q, k, v, g, h0); the
chunk states are recomputed by one cheap sequential kernel.
"""
from __future__ import annotations

from pallas_kernels import _common as cm
from pallas_kernels import grads
from pallas_kernels import intra
from pallas_kernels import state


def fwd(q, k, v, g, *, scale, initial_state, chunk_size):
  cm.check_dims(q.shape[-1], v.shape[-1], chunk_size)
  h, final = state.state_pass(k, v, g, initial_state, chunk_size=chunk_size)
  if cm.TUNE["fuse_scores_output"]:
    o = intra.fused_output(q, k, v, g, h, scale=scale, chunk_size=chunk_size)
  else:
    A = intra.scores(q, k, g, chunk_size=chunk_size)
    o = intra.output(q, v, g, h, A, scale=scale, chunk_size=chunk_size)
  return o, final


def bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size):
  cm.check_dims(q.shape[-1], v.shape[-1], chunk_size)
  do = do.astype(v.dtype)
  h, _ = state.state_pass(k, v, g, initial_state, chunk_size=chunk_size)
  dH, dh0 = state.state_grad_pass(q, do, g, dht.astype(cm.F32), scale=scale,
                                  chunk_size=chunk_size)
  A, dA = intra.scores(q, k, g, chunk_size=chunk_size, do=do, v=v, scale=scale)
  dv = grads.dv(k, g, do, A, dH, scale=scale, chunk_size=chunk_size)
  dq, dk, dg = grads.dqdk(q, k, v, g, do, h, dH, dA, scale=scale, chunk_size=chunk_size)
  return dq, dk, dv, dg, dh0
