"""Chunk-parallel stages: intra-chunk scores A and the output.

Scores ``A[r, i] = sum_k q_rk k_ik exp(sum_{i < j <= r} g_jk)`` for ``i <= r`` (unscaled);
every exponent is a sum of same-sign sub-chunk-local parts (``p``, ``s`` of
:func:`pallas_kernels.state.chunk_cumsum`, the sub-chunk totals ``T_u``, or g itself),
never a difference of chunk-cumulative sums, except in the whole-chunk and diagonal dots
below, where the difference is bounded by 16:

* ``gla_scores``, grid ``(B, H, N)``, one K slice of the chunk at a time. Where every
  column of the slice has a chunk total ``b_last >= -16`` (``_common.chunk_fits``: GLA's
  and the benchmarks' logsigmoid / 16 decays, nearly always), one dot over the whole
  chunk, masked to the lower triangle: ``(q e^{bc - b_last}) (k e^{b_last - bc})^T``, the
  first factor ``<= e^{16}`` formed from ``q e^{p}`` and the totals, the second the state
  walk's ``kd`` (the exponent off by at most ``2 * 16 * eps``). Elsewhere, the blocks
  below the 16 x 16 diagonal by sub-chunk, exact: rows of
  sub-chunk ``s`` and the columns before it factor through the row before ``s``:
  ``exp(p_r) * exp(s_i + sum_{blk(i) < u < s} T_u)``, both factors <= 1; one
  ``[C, KD] x [KD, C]`` tensor-core dot per sub-chunk, its operands folded by
  :func:`pallas_kernels.state.chunk_decays` (``q e^{p}``, ``k e^{s}`` in the input dtype,
  the totals, from which the kernel forms ``e^{totals between}`` as ``[KD]`` rows; the
  backward, when no A is kept, runs the same two kernels). With ``config.diag_dots`` (the
  default) the same kernel also computes the diagonal blocks: where every sub-chunk
  total of the chunk's K slice is >= -16 (``_common.totals_fit``), one dot ``(q e^{p})
  (k e^{-p})^T`` masked to the blocks' lower triangles (``e^{-p} <= e^{16}``; the
  exponent ``p_r - p_i`` off by at most ``2 * 16 * eps``); elsewhere the exact column
  loop below, on all four sub-chunks at once.
* ``gla_scores_diag``, grid ``(B, H, N, C / 16)`` (``diag_dots`` off): each diagonal block
  exact in log space, one column ``j`` at a time, last column first (``A[r, j] = sum_k
  q_rk k_jk e^{E_j[r]}`` on a ``[16, KD]`` tile, row ``j`` loaded from memory, ``E_j[r] =
  sum_{j < m <= r} g_m`` carried from column to column as ``E_{j-1} = E_j + g_j``),
  written in place. Its tiles are small so that many programs fit on an SM: this loop is
  latency-bound.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gla import _common as cm

S = cm.SUB


def _block_scale(tot, blk, first, last):
  """``[C, KD]`` (0 outside blocks ``first..last``): on the rows of block ``u``,
  ``e^{sum_{u < w <= last} T_w}`` (reversed: block ``last`` gets 1), as exps of ``[KD]``
  rows: the factor between a row's sub-chunk-local exponent and a later reference."""
  out, run = 0.0, None
  for u in range(last, first - 1, -1):
    out = jnp.where(blk == u, 1.0 if run is None else jnp.exp(run)[None, :], out)
    if u > first:
      run = tot[u] if run is None else run + tot[u]
  return out


def _prefix_scale(tot, blk):
  """``[C, KD]``: ``e^{T_0 + ... + T_{u-1}}`` on the rows of block u (1 on block 0), the
  totals added in ``_common.chunk_prefix``'s order."""
  out, run = 1.0, None
  for u in range(1, len(tot) + 1):
    run = tot[u - 1] if run is None else run + tot[u - 1]
    out = jnp.where(blk == u, jnp.exp(run)[None, :], out)
  return out


def _scores_off_kernel(*refs, C, K, KD, dt, diag, unroll):
  """A for one chunk from :func:`pallas_kernels.state.chunk_decays`' operands (``qp = q
  e^{p}``, ``ks = k e^{s}``, ``kn = k e^{-p}``, ``kd = k e^{b_last - bc}``, the totals).
  Per K slice, where ``_common.chunk_fits``: one dot of ``qp e^{bc - p - b_last}`` and
  ``kd`` over the chunk, masked (without ``diag``: below the diagonal blocks). Else, with
  zero diagonal blocks: for each sub-chunk s >= 1, rows of s times columns before s,
  through the row before s (both factors <= 1: ``qp`` on the rows, ``ks`` scaled by
  ``e^{totals between}`` formed from ``[KD]`` rows on the columns). With ``diag`` also
  the diagonal blocks (``diag_dots``): one dot of ``qp`` and ``kn`` where the chunk's K
  slice fits ``_common.totals_fit``, else the exact column loop, which alone reads q, k
  and g."""
  qp_ref, ks_ref, kn_ref, kd_ref, tots_ref, q_ref, k_ref, g_ref, a_ref = (
      refs if diag else refs[:5] + (None, None, None) + refs[5:])
  b, hd, n = (pl.program_id(i) for i in range(3))
  t0 = n * C
  tc = pl.ds(t0, C)
  row = cm.iota((C, KD), 0)
  blk = row // S
  rin = row - blk * S
  L = C // S
  same = (cm.iota((C, C), 0) // S == cm.iota((C, C), 1) // S) & (
      cm.iota((C, C), 0) >= cm.iota((C, C), 1))
  jcol = cm.iota((C, C), 1) - (cm.iota((C, C), 0) // S) * S     # column - start of row's sub

  def columns(q, ks, acc):
    def column(i, carry):
      acc, e = carry                # e[r] = sum_{j < m <= r} g_m on rows r >= j of each sub
      j = S - 1 - i
      kj = cm.sub_rows(k_ref, b, t0, hd, ks, j, blk, L)
      val = jnp.sum(q * kj * cm.masked_exp(rin >= j, e), axis=1)    # [C]: A[r, sub(r) + j]
      acc = acc + jnp.where(jcol == j, val[:, None], 0.0)
      e = jnp.where(rin >= j, e + cm.sub_rows(g_ref, b, t0, hd, ks, j, blk, L), 0.0)
      return acc, e

    return cm.unrolled(S, unroll, column, (acc, jnp.zeros((C, KD), cm.F32)))[0]

  # The whole chunk's mask: the lower triangle, or (diagonal blocks left to
  # gla_scores_diag) the blocks below the diagonal blocks.
  ri, ci = cm.iota((C, C), 0), cm.iota((C, C), 1)
  lower = ri >= ci if diag else ri // S > ci // S

  def by_sub_chunk(ks, tot, acc):
    q_e = qp_ref[b, tc, hd, ks].astype(cm.F32)                         # q e^{p_r}
    k_s = ks_ref[b, tc, hd, ks].astype(cm.F32)                         # k e^{s_i}
    for s in range(1, L):
      q_fac = jnp.where(blk == s, q_e, 0.0)
      k_fac = k_s * _block_scale(tot, blk, 0, s - 1)     # e^{s_i + sum_{blk(i) < u < s} T_u}
      acc = acc + cm.dot(q_fac, k_fac, dt, tb=True)
    if not diag:
      return acc
    factored = lambda: acc + jnp.where(same, cm.dot(q_e, kn_ref[b, tc, hd, ks], dt, tb=True),
                                       0.0)
    return jax.lax.cond(cm.totals_fit(tot)[1], factored,
                        lambda: columns(q_ref[b, tc, hd, ks].astype(cm.F32), ks, acc))

  def whole_chunk(ks, tot, acc):
    # Every column's chunk total >= -16 (``_common.chunk_fits``): A = (q e^{bc - b_last})
    # (k e^{b_last - bc})^T, e^{bc - b_last} <= e^{16}, kd the state walk's operand; one
    # dot over the whole chunk, masked.
    fac = _prefix_scale(tot[:-1], blk) * jnp.exp(-cm.chunk_total(tot))[None, :]
    q_w = qp_ref[b, tc, hd, ks].astype(cm.F32) * fac                   # q e^{bc - b_last}
    return acc + jnp.where(lower, cm.dot(q_w, kd_ref[b, tc, hd, ks], dt, tb=True), 0.0)

  def k_slice(kk, acc):
    ks = pl.ds(kk * KD, KD)
    tot = [tots_ref[b, hd, n, u, ks] for u in range(L)]
    return jax.lax.cond(cm.chunk_fits(tot), lambda: whole_chunk(ks, tot, acc),
                        lambda: by_sub_chunk(ks, tot, acc))

  a_ref[b, hd, n] = jax.lax.fori_loop(0, K // KD, k_slice, jnp.zeros((C, C), cm.F32))


def _diag_kernel(q_ref, k_ref, g_ref, a_in_ref, a_ref, *, C, K, KD, unroll):
  """The 16 x 16 diagonal block of sub-chunk s, exact in log space, one column j at a
  time from the last (written in place into A from ``_scores_off_kernel``)."""
  del a_in_ref                      # aliased to a_ref: the off-diagonal part is kept
  b, hd, n, s = (pl.program_id(i) for i in range(4))
  r0 = n * C + s * S
  rows = pl.ds(r0, S)
  row = cm.iota((S, KD), 0)
  col = cm.iota((S, S), 1)

  def k_slice(kk, diag):
    ks = pl.ds(kk * KD, KD)
    q_a = q_ref[b, rows, hd, ks].astype(cm.F32)

    def column(i, carry):
      diag, e = carry                 # e[r] = sum_{j < m <= r} g_m on rows r >= j
      j = S - 1 - i
      kj = k_ref[b, r0 + j, hd, ks].astype(cm.F32)[None, :]        # [1, KD]
      val = jnp.sum(q_a * kj * cm.masked_exp(row >= j, e), axis=1)   # [S]
      diag = diag + jnp.where(col == j, val[:, None], 0.0)
      if not isinstance(j, int) or j > 0:
        e = jnp.where(row >= j, e + g_ref[b, r0 + j, hd, ks][None, :], 0.0)
      return diag, e

    # All 16 columns unrolled at trace time (not a fori_loop): the row loads do not depend
    # on the carried exponent, so Triton issues them ahead of the exp / reduce chain
    # (H200: gla_scores 0.62 -> 0.51 ms at B1 T16384 H16 K128; 68 registers, no spills).
    return cm.unrolled(S, unroll, column, (diag, jnp.zeros((S, KD), cm.F32)))[0]

  a_ref[b, hd, n, pl.ds(s * S, S), pl.ds(s * S, S)] = jax.lax.fori_loop(
      0, K // KD, k_slice, jnp.zeros((S, S), cm.F32))


def _scores_call(d, loop_operands, *, chunk_size, config):
  """``gla_scores`` on :func:`pallas_kernels.state.chunk_decays`' operands ``d``; with
  ``loop_operands`` (q, k, g) the diagonal blocks too (``_scores_off_kernel``'s
  ``diag``), else they are left zero."""
  B, T, H, K = d.qp.shape
  C = chunk_size
  kern = functools.partial(_scores_off_kernel, C=C, K=K, KD=cm.block(K, config.scores.kd),
                           dt=d.qp.dtype, diag=bool(loop_operands),
                           unroll=cm.unroll_for(config, 4))
  return cm.call(kern, jax.ShapeDtypeStruct((B, H, T // C, C, C), cm.F32), (B, H, T // C),
                 config=config, num_warps=config.scores.warps,
                 num_stages=config.scores.stages, name="gla_scores")(
                     d.qp, d.ks, d.kn, d.kd, d.tots, *loop_operands)


def scores_off(d, *, chunk_size, config):
  """A [B, H, N, C, C] float32 below the 16 x 16 diagonal blocks (``gla_scores`` without
  them) from :func:`pallas_kernels.state.chunk_decays`' operands ``d``; the diagonal
  blocks and everything above them are zero."""
  return _scores_call(d, (), chunk_size=chunk_size, config=config)


def scores_diag(q, k, g, A, *, chunk_size, config):
  """``A`` with its 16 x 16 diagonal blocks written in place (``gla_scores_diag``)."""
  B, T, H, K = q.shape
  C = chunk_size
  diag = functools.partial(_diag_kernel, C=C, K=K, KD=cm.block(K, config.diag.kd),
                           unroll=cm.unroll_for(config, S))
  return cm.call(diag, jax.ShapeDtypeStruct(A.shape, cm.F32), (B, H, T // C, C // S),
                 config=config, num_warps=config.diag.warps, num_stages=config.diag.stages,
                 name="gla_scores_diag", aliases={3: 0})(q, k, g, A)


def scores(d, q, k, g, *, chunk_size, config):
  """A [B, H, N, C, C] float32, unscaled, zero above the diagonal, from
  :func:`pallas_kernels.state.chunk_decays`' operands ``d``: ``gla_scores`` reads qp, ks,
  kn and the totals (q, k and ``g``, the per-dim float32 log-decay, only where the
  diagonal takes the loop); with ``diag_dots`` off, ``gla_scores_diag`` then writes the
  diagonal."""
  kw = dict(chunk_size=chunk_size, config=config)
  if not config.diag_dots:
    return scores_diag(q, k, g, scores_off(d, **kw), **kw)
  return _scores_call(d, (q, k, g), **kw)


def _output_kernel(qp_ref, v_ref, h_ref, a_ref, tots_ref, o_ref, *, C, K, BK, BV, dt, scale):
  """o of one chunk's V tile from ``qp = q e^{p}``: ``q e^{bc} = qp e^{T_0 + ... +
  T_{blk - 1}}`` is formed here from the sub-chunk totals."""
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  tc, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  L = C // S
  blk = cm.iota((C, BK), 0) // S
  o = cm.dot(a_ref[b, hd, n], v_ref[b, tc, hd, vs], dt)
  for kk in range(K // BK):
    ks = pl.ds(kk * BK, BK)
    tot = [tots_ref[b, hd, n, u, ks] for u in range(L - 1)]
    qd = qp_ref[b, tc, hd, ks].astype(cm.F32) * _prefix_scale(tot, blk)
    o = o + cm.dot(qd, h_ref[b, hd, n, ks, vs], dt)
  o_ref[b, tc, hd, vs] = (scale * o).astype(o_ref.dtype)


def output(qp, v, h, A, tots, *, scale, chunk_size, config):
  """o = scale * (q e^{bc} h[n] + A v): [B, T, H, V] in v's dtype, from
  :func:`pallas_kernels.state.chunk_decays`' ``qp = q e^{p}`` and sub-chunk totals."""
  B, T, H, K = qp.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  BK, BV = cm.block(K, config.out.bk), cm.block(V, config.out.bv)
  kern = functools.partial(_output_kernel, C=C, K=K, BK=BK, BV=BV, dt=qp.dtype, scale=scale)
  return cm.call(kern, jax.ShapeDtypeStruct(v.shape, v.dtype), (B, H, N, V // BV),
                 config=config, num_warps=config.out.warps, num_stages=config.out.stages,
                 name="gla_output")(qp, v, h, A, tots)
