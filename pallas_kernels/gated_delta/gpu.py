"""The GPU backend of Gated DeltaNet: Pallas kernels lowered through Triton, composed into
fwd / bwd (with ``config.interpret`` the same kernels run in the Pallas interpreter).

Same contract as ``zeco_jax.ops.gated_delta.chunked`` (padded, validated inputs; layout
``[B, T, H, D]``; g and beta float32 ``[B, T, H]``; T a multiple of the chunk), plus the
launch configuration ``config`` (:class:`pallas_kernels.gated_delta.KernelConfig`):

  fwd: UT inverse per chunk and w, u, kd, gc from it (``chunk.wy_forward``: one kernel,
       T kept in registers, not written) -> state walk (h, v_new, final; the chunk decays
       e^{gamma} from gc) -> output
  bwd: T, w, u, kd, gc (recomputed) and qb = scale e^{b} q -> the chunk states walked
       again (unless kept: ``config.save_states``) -> v_new and its local cotangent ->
       state-gradient walk (dH, dv_new, dh0) -> dq, dk, dw, dg per chunk
       -> the WY backward (dk, dv, dbeta, dg through w, u and A)

With ``config.save_states`` (the default) the forward keeps the chunk states h ``[B, H, N,
K, V]`` (one state per chunk, nothing per token) as its :class:`Residual`; off, nothing (the
backward walks them again). The backward recomputes everything per token.
"""
from __future__ import annotations

from pallas_kernels import _delta
from pallas_kernels._config import state_store_dtype
from pallas_kernels._launch import F32
from pallas_kernels.gated_delta import chunk
from pallas_kernels.gated_delta import walk


Residual = _delta.Residual


def check_dims(K: int, V: int, C: int) -> None:
  _delta.check_dims(K, V, C, family="gated_delta")


def fwd_res(q, k, v, g, beta, *, scale, initial_state, chunk_size, config):
  """((o, final_state), :class:`Residual`); the state (``initial_state``) may have more
  columns than v, which get no values (:func:`pallas_kernels._delta.check_state_columns`):
  o, the final state and the kept states have the state's columns."""
  check_dims(q.shape[-1], v.shape[-1], chunk_size)
  _delta.check_state_columns(v, initial_state, family="gated_delta")
  kw = dict(chunk_size=chunk_size, config=config)
  w, u, kd, gc = chunk.wy_forward(k, v, g, beta, **kw)
  h, vn, final = walk.state_walk(w, u, kd, walk.chunk_decay(gc, chunk_size), initial_state,
                                 store_dtype=state_store_dtype(config, k.dtype), **kw)
  o = chunk.output(q, k, g, gc, vn, h, scale=scale, **kw)
  return (o, final), Residual(h if config.save_states else None)


def fwd(q, k, v, g, beta, *, scale, initial_state, chunk_size, config):
  return fwd_res(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                 chunk_size=chunk_size, config=config)[0]


def bwd_res(res, q, k, v, g, beta, do, dht, *, scale, initial_state, chunk_size, config):
  """(dq float32, dk and dv in the inputs' dtypes [B, T, H, D]; dg, dbeta float32 [B, T,
  H]; dh0): the backward (the op casts dq: in ``gdn_dqk`` the cast spilled 132 more bytes
  on sm_90); ``res`` is ``fwd_res``'s :class:`Residual`, or None, or one holding None
  (the states are recomputed)."""
  check_dims(q.shape[-1], v.shape[-1], chunk_size)
  kw = dict(chunk_size=chunk_size, config=config)
  store = state_store_dtype(config, k.dtype)
  do = do.astype(v.dtype)
  Tinv, w, u, kd, gc, qb = chunk.wy(k, v, g, beta, q=q, scale=scale, **kw)
  eg = walk.chunk_decay(gc, chunk_size)
  h = None if res is None else res.h
  if h is None:
    h, _, _ = walk.state_walk(w, u, kd, eg, initial_state, store_dtype=store, **kw)
  vn, dvl = chunk.vnew(q, k, g, w, u, h, do, scale=scale, **kw)
  dH, dvn, dh0 = walk.grad_walk(qb, eg, w, kd, do, dvl, dht.astype(F32), store_dtype=store,
                                **kw)
  dq, dk1, dw, dg1 = chunk.dqk(q, k, g, gc, vn, dvn, do, h, dH, scale=scale, **kw)
  dk, dv, dbeta, dg2 = chunk.dwy(Tinv, k, v, g, beta, dw, dvn, dk1, **kw)
  return dq, dk, dv, dg1 + dg2, dbeta, dh0


def bwd(q, k, v, g, beta, do, dht, *, scale, initial_state, chunk_size, config):
  return bwd_res(None, q, k, v, g, beta, do, dht, scale=scale, initial_state=initial_state,
                 chunk_size=chunk_size, config=config)
