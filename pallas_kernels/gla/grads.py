"""Chunk-parallel backward stages: dv, and dq / dk / dg (chunked.py's formulas).

  dv = scale A^T do + (k e^{b_last - bc}) dH[n]
  dA = tril(scale do v^T)           (the scores' cotangent: formed inside the kernels below
                                     from the do and v tiles they read, never in memory)
  dq = scale (do h[n]^T) e^{bc} + row_side(dA, k)
  dk = col_side(dA, q) + (v dH[n]^T) e^{b_last - bc}
  dg = reverse cumsum over the chunk of (q dq - k dk), plus on every row the chunk-total
       term sum_v(h[n+1] * dH[n]): the state leaving the chunk depends on every gate of
       the chunk. It is computed as e^{b_last} sum_v(h[n] dH[n]) + sum_i k_i dk_state_i
       (h[n+1] = e^{b_last} h[n] + sum_i (k_i e^{b_last - bc_i}) v_i^T, and dk_state_i =
       (v_i dH[n]^T) e^{b_last - bc_i}), so h[n+1] is never read.

Where a chunk's K tile has every column's chunk total ``b_last >= -16``
(``_common.chunk_fits``), ``gla_dqdk`` (grid ``(B, H, N, K / BK)``, which also does the
state terms and dg's reverse cumsum over the chunk) takes its intra-chunk terms as one
``[C, C] x [C, BK]`` dot per direction through ``e^{bc}`` and ``e^{-bc}`` (``<= e^{16}``;
the exponent off by at most ``2 * 16 * eps``): dq = e^{bc} (tril(dA) (k e^{-bc})), dk =
e^{-bc} (tril(dA)^T (q e^{bc})). The logsigmoid / 16 decays of GLA and the benchmarks
give chunk totals near -3, so this is the common path.

On other tiles no exponent is a difference of chunk-cumulative sums: ``bc`` and ``b_last
- bc`` are built from the sub-chunk-local ``p`` / ``s`` of
:func:`pallas_kernels.state.chunk_cumsum` and the sub-chunk totals
(``_common.chunk_prefix`` / ``chunk_suffix``). The intra-chunk terms use the same
references as the scores: blocks below the diagonal factor through the row before the
sub-chunk (dq: ``e^{p_r}`` times ``e^{s_i + totals between}``) or its last row (dk:
``e^{s_i}`` times ``e^{p_r + totals between}``), one masked ``[C, C] x [C, BK]`` dot per
sub-chunk and direction. The diagonal 16 x 16 blocks are one more block of the same
dots, through ``e^{-p}`` (dq) and ``e^{-s}`` (dk), on the K columns whose sub-chunk
totals are all >= -16 (``_common.totals_fit``: then ``e^{-p}, e^{-s} <= e^{16}`` and the
exponent's rounding error is at most ``2 * 16 * eps``). On the other columns they are
exact in log space: ``gla_dqdk_diag`` (grid ``(B, H, N, C / 16, K / BK)``, a program
writing only for a tile with such a column) runs one ``j`` at a time on ``[16, BK]``
tiles, the exponents accumulated from g itself column by column (dq from the last column
down, dk from the first up), and ``gla_dqdk`` adds its float32 partials there.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gla import _common as cm
from pallas_kernels._scan import rows_sum

S = cm.SUB
DIAG_UNROLL = 4              # gla_dqdk_diag: steps per fori_loop iteration (see the kernel)


def _dv_kernel(k_ref, p_ref, s_ref, do_ref, a_ref, dh_ref, dv_ref, *, C, K, BK, BV, dt,
               scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  tc, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  blk = cm.iota((C, BK), 0) // S
  dv = scale * cm.dot(a_ref[b, hd, n], do_ref[b, tc, hd, vs], dt, ta=True)
  for kk in range(K // BK):
    ks = pl.ds(kk * BK, BK)
    sc = cm.chunk_suffix(s_ref[b, tc, hd, ks], cm.sub_totals(p_ref, b, n * C, hd, ks, C // S),
                         blk)                                         # b_last - bc
    k_dec = k_ref[b, tc, hd, ks].astype(cm.F32) * jnp.exp(sc)
    dv = dv + cm.dot(k_dec, dh_ref[b, hd, n, ks, vs], dt)
  dv_ref[b, tc, hd, vs] = dv.astype(dv_ref.dtype)


def dv(k, p, s, do, A, dH, *, scale, chunk_size, config):
  B, T, H, K = k.shape
  V = do.shape[-1]
  C = chunk_size
  BK, BV = cm.block(K, config.dv.bk), cm.block(V, config.dv.bv)
  kern = functools.partial(_dv_kernel, C=C, K=K, BK=BK, BV=BV, dt=k.dtype, scale=scale)
  return cm.call(kern, jax.ShapeDtypeStruct(do.shape, do.dtype), (B, H, T // C, V // BV),
                 config=config, num_warps=config.dv.warps, num_stages=config.dv.stages,
                 name="gla_dv")(k, p, s, do, A, dH)


def _diag_grad_kernel(q_ref, k_ref, g_ref, do_ref, v_ref, p_ref, dqd_ref, dkd_ref, *, C, BK,
                      dt, scale, unroll):
  """Diagonal-block terms of dq and dk of sub-chunk s's K tile, exact in log space, for a
  tile of a chunk with a column that ``_common.totals_fit`` rejects (``gla_dqdk``
  computes them as dots on the others, and reads these only for the rejected columns):
  the program writes nothing otherwise. dq_r += sum_{j <= r} dA[r, j] k_j e^{sum_{j < m
  <= r} g_m} (j from the last row down, the exponent carried as ``e <- e + g_j``), dk_i +=
  sum_{j >= i} dA[j, i] q_j e^{sum_{i < m <= j} g_m} (j from the first row up, ``f <- f +
  g_j``), on [16, BK] tiles (small: many programs per SM). The block's ``dA = scale do
  v^T`` is formed here from do and v, only where the loops run (dA is never in memory)."""
  b, hd, n, s, ik = (pl.program_id(i) for i in range(5))
  r0 = n * C + s * S
  rows, ks = pl.ds(r0, S), pl.ds(ik * BK, BK)
  row = cm.iota((S, BK), 0)

  # Two loops (dq, then dk), one after the other: only one accumulator and one carried
  # exponent live at a time; each a fori_loop of 4 steps unrolled at trace time, so the
  # row loads of 4 steps (independent of the carry) are issued ahead of the exp chain.
  # H200, B1 T16384 H16 K128, every tile looped: 0.97 -> 0.58 ms, 128 -> 80 registers,
  # no spills (fully unrolled: 188 registers, 0.65 ms; one step per iteration: 0.68 ms).
  def loops():
    da = scale * cm.dot(do_ref[b, rows, hd, :], v_ref[b, rows, hd, :], dt, tb=True)
    ri, ci = cm.iota((S, S), 0), cm.iota((S, S), 1)    # (the upper triangle is unused)
    da_col = lambda j: jnp.sum(jnp.where(ci == j, da, 0.0), axis=1)[:, None]   # dA[:, j]
    da_row = lambda i: jnp.sum(jnp.where(ri == i, da, 0.0), axis=0)[:, None]   # dA[i, :]

    def dq_step(i, carry):
      dq, e = carry                 # dq: column j; e[r] = sum_{j < m <= r} g_m (r >= j)
      j = S - 1 - i
      kj = k_ref[b, r0 + j, hd, ks].astype(cm.F32)[None, :]
      dq = dq + da_col(j) * kj * cm.masked_exp(row >= j, e)            # dA[r, j]
      e = jnp.where(row >= j, e + g_ref[b, r0 + j, hd, ks][None, :], 0.0)
      return dq, e

    def dk_step(i, carry):
      dk, f = carry                 # dk: row i of dA, f[r] = sum_{r < m <= i} g_m (r <= i)
      f = jnp.where(row < i, f + g_ref[b, r0 + i, hd, ks][None, :], 0.0)
      qi = q_ref[b, r0 + i, hd, ks].astype(cm.F32)[None, :]
      return dk + da_row(i) * qi * cm.masked_exp(row <= i, f), f       # dA[i, r]

    zero = jnp.zeros((S, BK), cm.F32)
    dqd_ref[b, rows, hd, ks] = cm.unrolled(S, unroll, dq_step, (zero, zero))[0]
    dkd_ref[b, rows, hd, ks] = cm.unrolled(S, unroll, dk_step, (zero, zero))[0]

  _, all_fit = cm.totals_fit(cm.sub_totals(p_ref, b, n * C, hd, ks, C // S))
  pl.when(jnp.logical_not(all_fit))(loops)


def _dqdk_kernel(q_ref, k_ref, v_ref, p_ref, s_ref, do_ref, h_ref, dh_ref, dqd_ref, dkd_ref,
                 dq_ref, dk_ref, dg_ref, *, C, V, BK, BV, dt, scale):
  """dq, dk, dg of one chunk's K tile. Where every column's chunk total is >= -16
  (``_common.chunk_fits``: the benchmark's and GLA's logsigmoid / 16 decays, nearly
  always), the intra-chunk terms are one dot per direction over the whole lower triangle
  through ``e^{bc}`` and ``e^{-bc}``; elsewhere ``_dqdk_by_sub_chunk``'s masked dots per
  sub-chunk through sub-chunk-local exponents (a cond per tile: the other branch costs
  nothing). dA = tril(scale do v^T) is accumulated here from the do and v tiles the state
  terms read anyway (one more dot per V slice), never read from memory."""
  b, hd, n, ik = (pl.program_id(i) for i in range(4))
  t0 = n * C
  tc, ks = pl.ds(t0, C), pl.ds(ik * BK, BK)
  L = C // S
  tot = cm.sub_totals(p_ref, b, t0, hd, ks, L)                     # L rows [BK]

  def v_slice(iv, acc):
    dq_s, dk_s, d_last, da = acc
    vs = pl.ds(iv * BV, BV)
    h = h_ref[b, hd, n, ks, vs]
    dH = dh_ref[b, hd, n, ks, vs]
    do_t, v_t = do_ref[b, tc, hd, vs], v_ref[b, tc, hd, vs]
    dq_s = dq_s + cm.dot(do_t, h, dt, tb=True)
    dk_s = dk_s + cm.dot(v_t, dH, dt, tb=True)
    d_last = d_last + jnp.sum(h.astype(cm.F32) * dH.astype(cm.F32), axis=1)   # h[n] dH[n]
    da = da + cm.dot(do_t, v_t, dt, tb=True)
    return dq_s, dk_s, d_last, da

  zero = jnp.zeros((C, BK), cm.F32)
  dq_s, dk_s, d_last, da = jax.lax.fori_loop(
      0, V // BV, v_slice, (zero, zero, jnp.zeros((BK,), cm.F32),
                            jnp.zeros((C, C), cm.F32)))
  q = q_ref[b, tc, hd, ks].astype(cm.F32)
  k = k_ref[b, tc, hd, ks].astype(cm.F32)
  pre = p_ref[b, tc, hd, ks]                              # [C, BK]: p of the chunk
  row = cm.iota((C, BK), 0)
  blk = row // S
  ri, ci = cm.iota((C, C), 0), cm.iota((C, C), 1)
  dA = jnp.where(ri >= ci, scale * da, 0.0)                                    # [C, C]
  e_tot = jnp.exp(cm.chunk_total(tot))                                         # e^{b_last}

  def whole_chunk():
    # Every column's chunk total b_last >= -16 (``_common.chunk_fits``), so -16 <= bc <=
    # 0: e^{bc_r - bc_i} = e^{bc_r} e^{-bc_i} with e^{-bc} <= e^{16} (no overflow; the
    # exponent off by at most 2 * 16 * eps, as the diagonal dots): one [C, C] x [C, BK]
    # dot per direction over the whole lower triangle, the diagonal blocks included.
    bc = cm.chunk_prefix(pre, tot, blk)
    e_bc, e_nbc = jnp.exp(bc), jnp.exp(-bc)
    dk_st = dk_s * (e_tot[None, :] * e_nbc)                           # e^{b_last - bc}
    dq = e_bc * (scale * dq_s + cm.dot(dA, k * e_nbc, dt))
    dk = dk_st + e_nbc * cm.dot(dA, q * e_bc, dt, ta=True)
    return dq, dk, jnp.sum(k * dk_st, axis=0)

  def by_sub_chunk():
    return _dqdk_by_sub_chunk(q, k, pre, s_ref[b, tc, hd, ks], tot, dq_s, dk_s, dA,
                              lambda: (dqd_ref[b, tc, hd, ks], dkd_ref[b, tc, hd, ks]),
                              C=C, BK=BK, dt=dt, scale=scale)

  dq, dk, k_dk = jax.lax.cond(cm.chunk_fits(tot), whole_chunk, by_sub_chunk)
  # Chunk-total gate term sum_v h[n+1] dH[n] (module docstring).
  d_last = (e_tot * d_last + k_dk)[None, :]
  dq_ref[b, tc, hd, ks] = dq.astype(dq_ref.dtype)
  dk_ref[b, tc, hd, ks] = dk.astype(dk_ref.dtype)
  # dg: the reverse inclusive sum of q dq - k dk, one Triton scan. The form before it,
  # total - cumsum + x, measured slower on an H100: forward + backward 2.191 -> 2.173 ms
  # at B1 T16384 H16 K=V=128, 1.437 -> 1.405 at B8 T4096 H4 K128 V256
  # (``benchmarks/results/kernels_h200.md``).
  dg_ref[b, tc, hd, ks] = rows_sum(q * dq - k * dk, reverse=True) + d_last


def _dqdk_by_sub_chunk(q, k, pre, suf, tot, dq_s, dk_s, dA, diag_terms, *, C, BK, dt, scale):
  """``gla_dqdk``'s (dq, dk, sum_i k_i dk_state_i) of a tile with a column whose chunk
  total is below -16: every exponent a sum of same-sign sub-chunk-local parts. One masked
  ``[C, C] x [C, BK]`` dot per sub-chunk and direction; the diagonal blocks' terms in the
  same dots on the columns ``_common.totals_fit`` accepts, ``diag_terms()`` (the
  ``gla_dqdk_diag`` partials) read for the others, under a cond (not at all when every
  column fits)."""
  L = C // S
  row = cm.iota((C, BK), 0)
  blk = row // S
  # Every exponent below is p or s of the row plus a run of sub-chunk totals between
  # sub-chunks: e^{p} and e^{s} are taken once per tile, and each run's factor e^{T_a +
  # ... + T_{b-1}} once per [BK] row (a product of exps of same-sign sums, each <= 1: no
  # overflow, no cancellation), instead of one [C, BK] exp per sub-chunk and direction.
  e_pre, e_suf = jnp.exp(pre), jnp.exp(suf)
  runs = {}

  def run(a, b):                # e^{T_a + ... + T_{b-1}} [BK]; None for an empty run (1)
    if a >= b:
      return None
    if (a, b) not in runs:
      acc = tot[a]
      for u in range(a + 1, b):
        acc = acc + tot[u]
      runs[(a, b)] = jnp.exp(acc)
    return runs[(a, b)]

  def by_block(factor):         # [C, BK]: sub-chunk u's rows get factor(u) (None: 1, 0.: 0)
    out = 0.0
    for u in range(L):
      f = factor(u)
      if not (isinstance(f, float) and f == 0.0):
        out = jnp.where(blk == u, 1.0 if f is None else f[None, :], out)
    return out

  dq = scale * dq_s * e_pre * by_block(lambda u: run(0, u))           # e^{bc}
  dk = dk_s * e_suf * by_block(lambda u: run(u + 1, L))               # e^{b_last - bc}
  k_dk = jnp.sum(k * dk, axis=0)
  ri, ci = cm.iota((C, C), 0), cm.iota((C, C), 1)
  rc, cc = ri // S, ci // S
  fits, all_fit = cm.totals_fit(tot)
  fits = fits[None, :]
  # Rows of s: the columns of sub-chunks u < s through the row before s, e^{p_r} e^{s_i +
  # T_{u+1} + ... + T_{s-1}}; the columns of s itself through e^{-p_j} (<= e^16 where
  # ``fits``; 0 elsewhere).
  k_suf = k * e_suf
  k_neg = jnp.where(fits, k * jnp.exp(-pre), 0.0)
  for s in range(L):
    k_fac = jnp.where(blk == s, k_neg, 0.0)
    if s > 0:
      k_fac = k_fac + k_suf * by_block(lambda u: run(u + 1, s) if u < s else 0.0)
    part = cm.dot(jnp.where((rc == s) & (cc <= s), dA, 0.0), k_fac, dt)
    dq = dq + jnp.where(blk == s, e_pre * part, 0.0)
  # Columns of s: the rows of sub-chunks u > s through the last row of s, e^{s_i} e^{p_r +
  # T_{s+1} + ... + T_{u-1}}; the rows of s itself through e^{-s_r} (e^{s_i - s_r}: the
  # decay over (i, r]).
  q_pre = q * e_pre
  q_neg = jnp.where(fits, q * jnp.exp(-suf), 0.0)
  for s in reversed(range(L)):
    q_fac = jnp.where(blk == s, q_neg, 0.0)
    if s < L - 1:
      q_fac = q_fac + q_pre * by_block(lambda u: run(s + 1, u) if u > s else 0.0)
    part = cm.dot(jnp.where((cc == s) & (rc >= s), dA, 0.0), q_fac, dt, ta=True)
    dk = dk + jnp.where(blk == s, e_suf * part, 0.0)

  def with_loops():             # the loops' terms, on the columns the dots left out
    dqd, dkd = diag_terms()
    return dq + jnp.where(fits, 0.0, dqd), dk + jnp.where(fits, 0.0, dkd)

  dq, dk = jax.lax.cond(all_fit, lambda: (dq, dk), with_loops)
  return dq, dk, k_dk


def diag_grads(q, k, g, do, v, p, *, scale, chunk_size, config):
  """(dq_d, dk_d) float32 [B, T, H, K]: the diagonal-block terms of dq and dk
  (``gla_dqdk_diag``) of the K tiles with a column ``_common.totals_fit`` rejects; the
  rest of the arrays is undefined. ``g``: the per-dim float32 log-decay, ``p``
  chunk_cumsum's; the blocks' dA is formed from ``do``, ``v`` and ``scale``."""
  B, T, H, K = q.shape
  C = chunk_size
  BK = cm.block(K, config.dqdk_diag.bk)      # any tile: gla_dqdk reads rejected columns only
  part = jax.ShapeDtypeStruct(q.shape, cm.F32)
  kern = functools.partial(_diag_grad_kernel, C=C, BK=BK, dt=q.dtype, scale=scale,
                           unroll=cm.unroll_for(config, DIAG_UNROLL))
  return cm.call(kern, (part, part), (B, H, T // C, C // S, K // BK), config=config,
                 num_warps=config.dqdk_diag.warps, num_stages=config.dqdk_diag.stages,
                 name="gla_dqdk_diag")(q, k, g, do, v, p)


def dqdk(q, k, v, g, p, s, do, h, dH, *, scale, chunk_size, config, diag=None):
  """Returns (dq, dk in q's dtype, dg float32), all [B, T, H, K]; ``g`` the per-dim
  float32 log-decay, ``p``, ``s`` chunk_cumsum's; ``h`` and ``dH`` the N chunk states and
  their cotangents. dA = tril(scale do v^T) is formed inside the kernels. ``diag``:
  :func:`diag_grads`' output when already computed."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  f32 = jax.ShapeDtypeStruct(q.shape, cm.F32)
  dq_d, dk_d = (diag_grads(q, k, g, do, v, p, scale=scale, chunk_size=C, config=config)
                if diag is None else diag)
  BK, BV = cm.block(K, config.dqdk.bk), cm.block(V, config.dqdk.bv)
  kern = functools.partial(_dqdk_kernel, C=C, V=V, BK=BK, BV=BV, dt=q.dtype, scale=scale)
  out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype), f32)
  return cm.call(kern, out, (B, H, N, K // BK), config=config,
                 num_warps=config.dqdk.warps, num_stages=config.dqdk.stages,
                 name="gla_dqdk")(q, k, v, p, s, do, h, dH, dq_d, dk_d)
