"""What the GLA kernels share: the decay bookkeeping of a chunk (sub-chunk totals,
prefixes and suffixes, the dot-form tests), the stored states' dtype, the kernels' view
of g. The launch and the dots are in :mod:`pallas_kernels._launch`.

Every kernel reads the public layout ``[B, T, H, D]`` in place (strided tiles of ``[C, D]``
rows), so no transpose of q, k, v, g or do is ever materialised. A reverse sum along a
tile's rows is :func:`pallas_kernels._scan.rows_sum` (JAX's Triton lowering of ``cumsum``
runs only forward).
"""
from __future__ import annotations

import jax.numpy as jnp

# The launch helpers, re-exported so that the GLA kernels read everything as ``cm.``.
from pallas_kernels._config import state_store_dtype  # noqa: F401
from pallas_kernels._launch import (F32, HI, block, call, compiler_params, dot,  # noqa: F401
                                    from_head_major, head_major, iota, masked_exp, unroll_for,
                                    unrolled)

SUB = 16                     # sub-chunk rows: the unit of the exact log-space diagonal


def per_dim_decay(g, shape):
  """The kernels' log-decay: float32 ``[B, T, H, K]`` from g as a backend receives it
  (per-dim ``[B, T, H, K]``, per-head scalar ``[B, T, H]`` broadcast over K, or None:
  zeros). No kernel has a scalar path yet, so a scalar decay is broadcast here."""
  if g is None:
    return jnp.zeros(shape, F32)
  g = g.astype(F32)
  return jnp.broadcast_to(g[..., None], shape) if g.ndim == 3 else g


def decay_grad(dg, g):
  """dg (per-dim, ``[B, T, H, K]``) in the shape of g as given: summed over K for a
  scalar decay, None for no decay."""
  if g is None:
    return None
  return jnp.sum(dg, axis=-1) if g.ndim == 3 else dg


def sub_totals(p_ref, b, t0, hd, ks, L):
  """The L sub-chunk totals ``T_u = sum of g over rows [t0 + 16 u, t0 + 16 u + 16)``, each a
  ``[KD]`` row: the sub-chunk prefix ``p`` (which restarts every 16 rows) at each
  sub-chunk's last row, loaded from the ref (a loaded value is never sliced)."""
  return [p_ref[b, t0 + u * SUB + SUB - 1, hd, ks] for u in range(L)]


def chunk_total(tot):
  """The chunk's total log-decay ``b_last`` ``[KD]`` from its sub-chunk totals (a
  same-sign sum)."""
  out = tot[0]
  for t in tot[1:]:
    out = out + t
  return out


def chunk_prefix(p, tot, blk):
  """``bc_r = sum_{u < blk(r)} T_u + p_r``: the inclusive prefix over the chunk, built
  from sub-chunk-local parts (every term <= 0: no cancellation). ``p`` ``[C, KD]``,
  ``blk`` the rows' sub-chunk index (``iota // 16``), ``tot`` :func:`sub_totals`."""
  off, acc = 0.0, None
  for u in range(1, len(tot)):
    acc = tot[0] if acc is None else acc + tot[u - 1]
    off = jnp.where(blk == u, acc[None, :], off)
  return p + off


def chunk_suffix(s, tot, blk):
  """``b_last - bc_i = s_i + sum_{u > blk(i)} T_u``: the exclusive suffix over the chunk,
  from the sub-chunk exclusive suffix ``s`` and the later sub-chunks' totals (every term
  <= 0: no cancellation, unlike ``b_last - bc``)."""
  L = len(tot)
  off, acc = 0.0, None
  for u in range(L - 2, -1, -1):
    acc = tot[L - 1] if acc is None else acc + tot[u + 1]
    off = jnp.where(blk == u, acc[None, :], off)
  return s + off


# The 16 x 16 diagonal blocks' dot form (the scores with ``diag_dots``, dq / dk always):
# a K column's diagonal blocks factor through ``e^{p}`` / ``e^{-p}`` (or ``e^{s}`` /
# ``e^{-s}``) when its sub-chunk totals are all at least -DIAG_DOT_SPAN (else the exact
# column loops run): ``e^{p_r - p_j} = e^{p_r} e^{-p_j}`` with ``e^{p_r} <= 1``,
# ``e^{-p_j} <= e^{16}`` (no overflow), the exponent's rounding error at most ``2 * 16 *
# eps`` (about 2e-6) instead of the loops' ``eps`` of the exponent: the only place where
# an exponent is a difference, bounded by the span.
DIAG_DOT_SPAN = 16.0


def totals_fit(tot):
  """``([KD] bool, bool)``: the K columns of a chunk whose sub-chunk totals ``tot`` (a list
  of ``[KD]`` rows, :func:`sub_totals` or chunk_decays' ``tots``) are all ``>=
  -DIAG_DOT_SPAN``, and whether every column is. ``p`` is a cumsum of non-positive terms,
  so ``T_u`` is its minimum over the sub-chunk: where a column fits, ``e^{-p} <= e^{16}``
  and ``e^{-s} <= e^{16}``. Kernels that must agree on a column compute it from the same
  values (``gla_dqdk`` and ``gla_dqdk_diag``)."""
  low = tot[0]
  for t in tot[1:]:
    low = jnp.minimum(low, t)
  return low >= -DIAG_DOT_SPAN, jnp.min(low) >= -DIAG_DOT_SPAN        # (no all() in Triton)


def chunk_fits(tot):
  """Whether every K column's chunk total ``b_last = sum_u T_u`` (``tot``: a list of
  ``[KD]`` rows) is ``>= -DIAG_DOT_SPAN``. Then every ``bc`` of the chunk lies in ``[-16,
  0]`` and ``e^{bc_r - bc_i} = e^{bc_r} e^{-bc_i}`` with ``e^{-bc} <= e^{16}`` (the
  exponent off by at most ``2 * 16 * eps``, as in the diagonal dots): ``gla_dqdk`` takes
  one dot per direction over the whole chunk. Implies :func:`totals_fit` (every ``T_u
  >= b_last``)."""
  return jnp.min(chunk_total(tot)) >= -DIAG_DOT_SPAN


def sub_rows(ref, b, t0, hd, ks, j, blk, L):
  """``[C, KD]``: on the rows of sub-chunk u, row ``j`` of that sub-chunk (``ref[b, t0 +
  16 u + j, hd, ks]``), float32; ``blk`` the rows' sub-chunk index."""
  out = ref[b, t0 + j, hd, ks].astype(F32)[None, :]
  for u in range(1, L):
    out = jnp.where(blk == u, ref[b, t0 + u * SUB + j, hd, ks].astype(F32)[None, :], out)
  return out


def check_dims(K: int, V: int, C: int) -> None:
  for name, d in (("K", K), ("V", V), ("chunk_size", C)):
    if d < 16 or d & (d - 1):
      raise ValueError(f"pallas_kernels: {name} must be a power of two >= 16 for the Pallas "
                       f"kernels, got {d}; use backend='jax' for other sizes.")
