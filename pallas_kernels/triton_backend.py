"""The GPU backend: Pallas kernels lowered through Triton, composed into fwd / bwd.

Same contract as :mod:`zeco_jax.chunked` (padded, validated inputs; layout [B, T, H, D]):

  fwd: chunk cumsum -> state pass -> scores A (off-diagonal, diagonal) -> output
  bwd: chunk cumsum -> dA -> state pass (recomputed) | state-gradient pass (one launch)
       -> A (recomputed) -> dv -> diagonal dq/dk terms -> dq, dk, dg

With ``TUNE["overlap_fwd"]`` / ``["overlap_bwd"]`` the state walks share their launch
with the off-diagonal scores / the diagonal dq/dk terms (:mod:`pallas_kernels.overlap`).

``fwd_res`` / ``bwd_res`` are the same with intermediates kept from the forward, which
:func:`zeco_jax.chunk_gla` uses as its custom_vjp residual: the float32 scores A
(``B * T * H * C`` elements: as many as q has when K = C), and with ``TUNE["keep_states"]``
the chunk states h (``B * H * N * K * V`` in the state dtype, bf16 for bf16 inputs), so
the backward walks only the state gradients.
"""
from __future__ import annotations

from pallas_kernels import _common as cm
from pallas_kernels import grads
from pallas_kernels import intra
from pallas_kernels import overlap
from pallas_kernels import state


def fwd_res(q, k, v, g, *, scale, initial_state, chunk_size):
  """((o, final_state), residual) with residual ``(A, h or None)`` for ``bwd_res``."""
  cm.check_dims(q.shape[-1], v.shape[-1], chunk_size)
  bc = state.chunk_cumsum(g, chunk_size=chunk_size)
  if cm.TUNE["overlap_fwd"]:
    h, final, A_off = overlap.state_and_scores_off(q, k, v, bc, initial_state,
                                                   chunk_size=chunk_size)
    A = intra.scores(q, k, bc, chunk_size=chunk_size, A=A_off)
  else:
    h, final = state.state_pass(k, v, bc, initial_state, chunk_size=chunk_size)
    A = intra.scores(q, k, bc, chunk_size=chunk_size)
  o = intra.output(q, v, bc, h, A, scale=scale, chunk_size=chunk_size)
  return (o, final), (A, h if cm.TUNE["keep_states"] else None)


def fwd(q, k, v, g, *, scale, initial_state, chunk_size):
  return fwd_res(q, k, v, g, scale=scale, initial_state=initial_state, chunk_size=chunk_size)[0]


def bwd_res(res, q, k, v, g, do, dht, *, scale, initial_state, chunk_size):
  """The backward; ``res`` is ``fwd_res``'s residual ``(A, h)`` (either may be None, then
  it is recomputed) or None."""
  cm.check_dims(q.shape[-1], v.shape[-1], chunk_size)
  A, h = res if res is not None else (None, None)
  do = do.astype(v.dtype)
  dht = dht.astype(cm.F32)
  bc = state.chunk_cumsum(g, chunk_size=chunk_size)
  dA = intra.score_grad(do, v, scale=scale, chunk_size=chunk_size)
  diag = None
  if cm.TUNE["overlap_bwd"]:
    h_new, dH, dh0, diag = overlap.passes_and_diag_grads(
        q, k, v, do, bc, initial_state, dht, dA, scale=scale, chunk_size=chunk_size,
        states=h is None)
    h = h if h is not None else h_new
  elif h is not None:
    dH, dh0 = state.state_grad_pass(q, do, bc, dht, scale=scale, chunk_size=chunk_size)
  elif cm.TUNE["fuse_state_passes"]:
    h, dH, dh0 = state.both_passes(q, k, v, do, bc, initial_state, dht, scale=scale,
                                   chunk_size=chunk_size)
  else:
    h, _ = state.state_pass(k, v, bc, initial_state, chunk_size=chunk_size)
    dH, dh0 = state.state_grad_pass(q, do, bc, dht, scale=scale, chunk_size=chunk_size)
  if A is None:
    A = intra.scores(q, k, bc, chunk_size=chunk_size)
  dv = grads.dv(k, bc, do, A, dH, scale=scale, chunk_size=chunk_size)
  dq, dk, dg = grads.dqdk(q, k, v, bc, do, h, dH, dA, scale=scale, chunk_size=chunk_size,
                          diag=diag)
  return dq, dk, dv, dg, dh0


def bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size):
  return bwd_res(None, q, k, v, g, do, dht, scale=scale, initial_state=initial_state,
                 chunk_size=chunk_size)
