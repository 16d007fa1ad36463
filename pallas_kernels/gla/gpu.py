"""The GPU backend: Pallas kernels lowered through Triton, composed into fwd / bwd.

Same contract as :mod:`zeco_jax.ops.gla.chunked` (padded, validated inputs; layout [B, T, H, D];
g per-dim ``[B, T, H, K]``, per-head scalar ``[B, T, H]`` or None), plus the launch
configuration ``config`` (:class:`pallas_kernels.KernelConfig`; with ``interpret`` the
same kernels run in the Pallas interpreter, on any platform):

  fwd: the decay folded into q and k (the walk's and the scores' operands, sub-chunk
       totals) -> state pass -> scores A (diagonal included with ``config.diag_dots``)
       -> output
  bwd: sub-chunk cumsums (p, s) -> state pass (recomputed; skipped when the forward's
       states are kept, ``config.save_states``) | state-gradient pass (one launch, or
       two with ``config.fuse_state_passes`` off; with the states kept, the cumsums
       also write scale q e^{bc} and e^{b_last} and the walk reads them) -> A (without a
       residual: recomputed by the forward's chunk_decays and scores) -> dv -> diagonal dq/dk
       terms where the decay is too strong for dots -> dq, dk, dg (the last two form
       dA = tril(scale do v^T) from do and v themselves)

Exponents are formed from the sub-chunk-local cumulative log-decays ``p`` (inclusive
prefix) and ``s`` (exclusive suffix) of :func:`pallas_kernels.state.chunk_cumsum`, and
from g itself in the 16 x 16 diagonal blocks: sums of same-sign terms, never differences
of chunk-cumulative sums, so any mix of per-token log-decays in [-1e4, 0] keeps float32
accuracy (``docs/kernels.md``).

The kernels have no scalar-decay path yet: a scalar g is broadcast over K at entry and
its gradient summed over K at exit (no decay: zeros, and no gradient).

``fwd_res`` / ``bwd_res`` are the same with a :class:`Residual` kept from the forward,
which :func:`zeco_jax.chunk_gla` uses as its custom_vjp residual: the float32 scores A
(``B * T * H * C`` elements: as many as q has when K = C) and, with
``config.save_states``, the chunk states h.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax

from pallas_kernels.gla import _common as cm
from pallas_kernels.gla import grads
from pallas_kernels.gla import intra
from pallas_kernels.gla import state


class Residual(NamedTuple):
  """What ``fwd_res`` keeps for ``bwd_res``: the scores A, and the chunk states h
  ``[B, H, N, K, V]`` with ``config.save_states`` (the default; else None: the backward
  recomputes them)."""
  A: jax.Array
  h: Optional[jax.Array] = None


def fwd_res(q, k, v, g, *, scale, initial_state, chunk_size, config):
  """((o, final_state), :class:`Residual`), the residual ``bwd_res`` takes."""
  cm.check_dims(q.shape[-1], v.shape[-1], chunk_size)
  kw = dict(chunk_size=chunk_size, config=config)
  g = cm.per_dim_decay(g, q.shape)
  d = state.chunk_decays(g, q, k, **kw)
  h, final = state.folded_state_pass(d.kd, v, d.dl, initial_state, **kw)
  A = intra.scores(d, q, k, g, **kw)
  o = intra.output(d.qp, v, h, A, d.tots, scale=scale, **kw)
  return (o, final), Residual(A, h if config.save_states else None)


def fwd(q, k, v, g, *, scale, initial_state, chunk_size, config):
  return fwd_res(q, k, v, g, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                 config=config)[0]


def bwd_res(res, q, k, v, g, do, dht, *, scale, initial_state, chunk_size, config):
  """The backward; ``res`` is ``fwd_res``'s :class:`Residual`, or None (then A and h are
  recomputed). Returns (dq, dk, dv, dg in g's shape or None, dh0)."""
  cm.check_dims(q.shape[-1], v.shape[-1], chunk_size)
  kw = dict(chunk_size=chunk_size, config=config)
  do = do.astype(v.dtype)
  dht = dht.astype(cm.F32)
  gd = cm.per_dim_decay(g, q.shape)
  A, h = res if res is not None else (None, None)
  if h is not None:   # the forward's states: the gradient walk alone, over qd and dl
    p, s, qd, dl = state.chunk_cumsum_folded(gd, q, scale=scale, **kw)
    dH, dh0 = state.folded_state_grad_pass(qd, do, dl, dht, **kw)
  else:
    p, s = state.chunk_cumsum(gd, **kw)
    if config.fuse_state_passes:
      h, dH, dh0 = state.both_passes(q, k, v, do, p, s, initial_state, dht, scale=scale,
                                     **kw)
    else:
      h, _ = state.state_pass(k, v, p, s, initial_state, **kw)
      dH, dh0 = state.state_grad_pass(q, do, p, dht, scale=scale, **kw)
  if A is None:       # the forward's two kernels, not its walk or output
    A = intra.scores(state.chunk_decays(gd, q, k, **kw), q, k, gd, **kw)
  dv = grads.dv(k, p, s, do, A, dH, scale=scale, **kw)
  dq, dk, dg = grads.dqdk(q, k, v, gd, p, s, do, h, dH, scale=scale, **kw)
  return dq, dk, dv, cm.decay_grad(dg, g), dh0


def bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size, config):
  return bwd_res(None, q, k, v, g, do, dht, scale=scale, initial_state=initial_state,
                 chunk_size=chunk_size, config=config)
