"""The GPU backend of Kimi Delta Attention: Pallas kernels lowered through Triton,
composed into fwd / bwd (with ``config.interpret`` the same kernels run in the Pallas
interpreter).

Same contract as ``zeco_jax.ops.kda.chunked`` (padded, validated inputs; layout
``[B, T, H, D]``; g float32 ``[B, T, H, K]`` (<= 0), beta float32 ``[B, T, H]``;
initial_state float32 ``[B, H, K, V]``; T a multiple of the chunk), plus the launch
configuration ``config`` (:class:`pallas_kernels.kda.KernelConfig`):

  fwd: A, P and T = (I + A)^{-1} per chunk (kda_diag, kda_intra)
       -> w, u, kd, e^{gamma} (kda_wu) -> state walk (h, v_new, final) -> output
  bwd: T, P (recomputed, or kept: ``config.save_pairs``), w, u, kd, e^{gamma}
       (recomputed) and qb = scale e^{b} * q
       -> the chunk states kept (or walked again: ``config.save_states`` off) -> v_new and its
       local cotangent -> state-gradient walk
       (dH, dv_new, dh0) -> dq, dk, dg through the state terms, dw, dP (kda_dqk)
       -> through w, u and T: dk, dv, dbeta, dg, dA (kda_dwy; adds kda_dqk's dk, dg)
       -> through A and P: dq, dk, dg, dbeta (kda_dpairs; adds the parts before and
          writes the op's dq, dk in their dtype)

With ``config.save_states`` (the default) the forward keeps the chunk states h ``[B, H, N,
K, V]`` (one state per chunk) and with ``config.save_pairs`` T and P ``[B, T, H, C]`` each
(k's dtype) as its :class:`Residual`; with both off nothing (the backward walks the states
again and forms T and P again, as it forms everything per token).
Exactness (:mod:`pallas_kernels.kda.chunk`, :mod:`pallas_kernels.kda.pairs`): every
exponent is a sum of g over exactly the tokens it spans, and the decay gradient sums
exactly the terms whose span holds each token, so g down to -5 per token and channel
and the documents' -1e4 sentinel are exact to float32 rounding (the diagonal 16 x 16
blocks' part of dg is summed by the tokens' roles: :func:`pallas_kernels.kda.pairs.dpairs`).
The exponentials are 2^(x log2 e) on ``ex2.approx`` (:func:`pallas_kernels._launch.fast_exp`,
about 2 ulp; the op within 4e-7 of the jnp path in float32 on an H100).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax

from pallas_kernels import _delta
from pallas_kernels._config import state_store_dtype
from pallas_kernels._launch import F32
from pallas_kernels.kda import chunk
from pallas_kernels.kda import pairs
from pallas_kernels.kda import walk


class Residual(NamedTuple):
  """What ``fwd_res`` keeps for ``bwd_res``: the state entering each chunk (``h``, with
  ``config.save_states``) and T and P (``pairs``, with ``config.save_pairs``); None for
  what the backward forms again."""
  h: Optional[jax.Array]
  pairs: Optional[tuple] = None


def check_dims(K: int, V: int, C: int) -> None:
  _delta.check_dims(K, V, C, family="kda")


def fwd_res(q, k, v, g, beta, *, scale, initial_state, chunk_size, config):
  """((o, final_state), :class:`Residual`); the state (``initial_state``) may have more
  columns than v, which get no values (:func:`pallas_kernels._delta.check_state_columns`):
  o, the final state and the kept states have the state's columns."""
  check_dims(q.shape[-1], v.shape[-1], chunk_size)
  _delta.check_state_columns(v, initial_state, family="kda")
  kw = dict(chunk_size=chunk_size, config=config)
  Tinv, P = pairs.intra(q, k, g, beta, **kw)
  w, u, kd, eg = chunk.wu(Tinv, k, v, g, beta, **kw)
  h, vn, final = walk.state_walk(w, u, kd, eg, initial_state,
                                 store_dtype=state_store_dtype(config, k.dtype), **kw)
  o = chunk.output(q, g, P, vn, h, scale=scale, **kw)
  return (o, final), Residual(h if config.save_states else None,
                              (Tinv, P) if config.save_pairs else None)


def fwd(q, k, v, g, beta, *, scale, initial_state, chunk_size, config):
  return fwd_res(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                 chunk_size=chunk_size, config=config)[0]


def bwd_res(res, q, k, v, g, beta, do, dht, *, scale, initial_state, chunk_size, config):
  """(dq, dk, dv [B, T, H, D] in the inputs' dtypes, dg float32 [B, T, H, K], dbeta float32
  [B, T, H], dh0): the backward; ``res`` is ``fwd_res``'s :class:`Residual`, or None,
  or one holding None (the states are recomputed)."""
  check_dims(q.shape[-1], v.shape[-1], chunk_size)
  kw = dict(chunk_size=chunk_size, config=config)
  store = state_store_dtype(config, k.dtype)
  do = do.astype(v.dtype)
  kept = None if res is None else res.pairs
  Tinv, P = pairs.intra(q, k, g, beta, **kw) if kept is None else kept
  w, u, kd, eg, qb = chunk.wu(Tinv, k, v, g, beta, q=q, scale=scale, **kw)
  h = None if res is None else res.h
  if h is None:
    h, _, _ = walk.state_walk(w, u, kd, eg, initial_state, store_dtype=store, **kw)
  vn, dvl = chunk.vnew(P, w, u, h, do, scale=scale, **kw)
  dH, dvn, dh0 = walk.grad_walk(qb, eg, w, kd, do, dvl, dht.astype(F32), store_dtype=store,
                                **kw)
  dq1, dk1, dw, dg1, dP = chunk.dqk(q, k, g, vn, dvn, do, h, dH, scale=scale, **kw)
  dk12, dv, dbeta2, dg12, dA = chunk.dwy(Tinv, k, v, g, beta, dw, dvn, dk1, dg1, **kw)
  dq, dk, dg, dbeta = pairs.dpairs(q, k, g, beta, dP, dA, dq1, dk12, dg12, dbeta2, **kw)
  return dq, dk, dv, dg, dbeta, dh0


def bwd(q, k, v, g, beta, do, dht, *, scale, initial_state, chunk_size, config):
  return bwd_res(None, q, k, v, g, beta, do, dht, scale=scale, initial_state=initial_state,
                 chunk_size=chunk_size, config=config)
