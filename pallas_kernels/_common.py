"""Shared helpers for the GLA Pallas kernels: dots, decay masks, the launch.

Every kernel here takes whole-array refs (no BlockSpecs) and indexes them itself with
``program_id``: the public layout ``[B, T, H, D]`` is read in place (strided tiles of
``[C, D]`` rows), so no transpose of q, k, v, g or do is ever materialised.

Triton-lowering constraints this code respects (see /work/shared/jax_notes.md): tile
sizes are powers of two and at least 16 where they feed a dot; a loaded value is never
sliced (sub-chunks are loaded from the ref); no reverse cumsum (``rev = total - cumsum
+ x``); float32 dots ask for ``precision=HIGHEST`` (IEEE, not TF32).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from zeco_jax._jax_private import check_vma_enabled

SUB = 16                     # sub-chunk rows: the unit of the exact log-space diagonal
F32 = jnp.float32


def state_store_dtype(config, input_dtype):
  """dtype of the stored chunk states h[n] and their cotangents dH[n]."""
  return input_dtype if config.states_in_input_dtype else F32


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


def compiler_params(config, num_warps: int, num_stages: int):
  if config.interpret:
    return None
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _varying_axes(x):
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def call(kernel, out_shape, grid, *, config, num_warps, num_stages, name, aliases=None):
  """pallas_call over whole-array refs, launched as ``config`` says (the interpreter, or
  Triton with ``num_warps`` / ``num_stages``).

  Inside ``shard_map(check_vma=True)`` (zeco_gla's local pass) pallas_call needs to know
  how its outputs vary over the manual mesh axes: every input is cast to the union of
  the inputs' varying axes, and the outputs are declared varying over the same axes.
  """
  fn = functools.partial(pl.pallas_call, kernel, grid=grid, interpret=config.interpret,
                         compiler_params=compiler_params(config, num_warps, num_stages),
                         name=name, input_output_aliases=aliases or {})

  def run(*args):
    if not check_vma_enabled():
      return fn(out_shape=out_shape)(*args)
    axes = frozenset().union(*(_varying_axes(a) for a in args))
    if axes:
      args = [a if _varying_axes(a) == axes else
              jax.lax.pcast(a, tuple(sorted(axes - _varying_axes(a))), to="varying")
              for a in args]
    mat = jax.typeof(args[0]).manual_axis_type
    outs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat),
                        out_shape)
    # Note: the Pallas *interpreter* still fails here (its dynamic_slice mixes varying refs
    # with invariant constants); call zeco_gla with check_vma=False to interpret on CPU.
    return fn(out_shape=outs)(*args)

  return run


def dot(a, b, dtype, *, ta=False, tb=False):
  """a @ b (a^T when ``ta``, b^T when ``tb``) with float32 accumulation.

  ``dtype`` is the operand dtype: bfloat16/float16 operands use the tensor cores at full
  rate; float32 operands use IEEE float32 (precision HIGHEST), never silent TF32.
  """
  dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
  if dtype == F32:
    return lax.dot_general(a.astype(F32), b.astype(F32), dims, precision=lax.Precision.HIGHEST,
                           preferred_element_type=F32)
  return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=F32)


def iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def masked_exp(mask, x):
  """exp(x) where mask, 0 elsewhere; the exponent is masked first, so no inf * 0."""
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


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


def unrolled(n, unroll, body, carry):
  """``carry = body(i, carry)`` for i in range(n), ``unroll`` steps per iteration of a
  fori_loop; ``unroll >= n``: a plain Python loop (i a Python int, unrolled at trace
  time, so Triton can issue loads that do not depend on the carry ahead of the chain)."""
  if unroll >= n:
    for i in range(n):
      carry = body(i, carry)
    return carry

  def outer(o, c):
    for u in range(unroll):
      c = body(o * unroll + u, c)
    return c

  return jax.lax.fori_loop(0, n // unroll, outer, carry)


def rev_cumsum(x):
  """Reverse cumulative sum along axis 0 (Triton has only the forward scan)."""
  return jnp.sum(x, axis=0, keepdims=True) - jnp.cumsum(x, axis=0) + x


def block(n: int, cap: int) -> int:
  """Largest power of two <= cap dividing n (n itself if n <= cap and a power of two)."""
  b = 1
  while b * 2 <= min(n, cap) and n % (b * 2) == 0:
    b *= 2
  return b


def check_dims(K: int, V: int, C: int) -> None:
  for name, d in (("K", K), ("V", V), ("chunk_size", C)):
    if d < 16 or d & (d - 1):
      raise ValueError(f"pallas_kernels: {name} must be a power of two >= 16 for the Pallas "
                       f"kernels, got {d}; use backend='jax' for other sizes.")
