"""Kimi Delta Attention's intra-chunk matrices, whose pairwise decays are per key channel:

  A[i, j] = beta_i sum_d k[i, d] k[j, d] e^{seg[i, j, d]}   (j < i; the delta rule's reads)
  P[i, j] = sum_d q[i, d] k[j, d] e^{seg[i, j, d]}          (j <= i; the output's scores)

with ``seg[i, j, d] = sum_{j < m <= i} g[m, d]``, and T = (I + A)^{-1}.

* :func:`intra` (``kda_intra``): A and P's blocks below the diagonal in 16-token
  sub-chunks, their diagonal blocks from :func:`diag` (``kda_diag``, a program per token
  and head group, as FLA's token-parallel kernel), then T by 16 x 16 blocks (the diagonal
  blocks all at once by forward substitution, stacked ``[C, 16]`` and gathering A's rows
  from memory; the blocks below by ``X_IJ = -X_II sum_{J <= M < I} A_IM X_MJ``, float32 at
  HIGHEST precision for float32 inputs, three bfloat16 products for narrower ones:
  :func:`pallas_kernels._delta.block_inverse`).
  Writes T and P in k's dtype, ``[B, T, H, C]`` each (row i of its chunk's matrix at
  token i). A itself never leaves the kernels.
* :func:`dpairs` (``kda_dpairs``): the backward through A and P, from their cotangents dA
  (:func:`pallas_kernels.kda.chunk.dwy`) and dP (:func:`pallas_kernels.kda.chunk.dqk`):
  dq, dk, dg and dbeta's parts, a program per chunk, sub-chunk and K slice (FLA's grid
  for this kernel).

On an H200 (B1 T16384 H16 K=V=128, 2026-12-05, ``benchmarks/results/kda_h200.md``) this
form of ``kda_intra`` took 0.62 ms against 1.90 for one program per chunk that walked each
diagonal block's columns in registers, and ``kda_dpairs`` 2.65 ms against 4.76 for one
program per chunk (4.29 with the diagonal blocks of a chunk walked at once); both
earlier forms are gone.

How the per-channel decays stay exact (no exponent is a difference of two cumulative sums
or positive; ``zeco_jax.ops.kda.chunked._pairs`` is the jnp form of the same scheme):

* A block of rows I below the diagonal against columns J < I (one tensor-core dot per
  block pair and K slice) splits every exponent at the end of sub-chunk I - 1 into two
  sums of g over the tokens they span: rows ``x_I e^{into_I}`` (into: g summed from the
  start of I to the row) times columns ``k_J e^{after_J} e^{between(J, I)}`` (after: g
  summed from after the column to the end of J; between: the totals of the whole
  sub-chunks strictly between, a ``[kd]`` row). Each factor is <= 1.
* A diagonal 16 x 16 block is exact in log space: :func:`diag` walks token i's columns
  from i down to its sub-chunk's start carrying ``E = sum_{j < m <= i} g_m`` (``E +=
  g_j``), as GLA's ``gla_scores_diag``: never a dot through ``e^{-cumsum}``, whatever the
  decay.

The decay gradient sums exactly the terms whose span holds each token. With ``dseg[i, j,
d]`` the cotangent of the exponent (``(dP[i, j] q_i + beta_i dA[i, j] k_i) k_j e^{seg}``,
channel d), ``dg[m] = sum_{i >= m > j} dseg[i, j]``, for m in sub-chunk M:

  pairs inside M                       by the tokens' roles (below)
  i in M, j in a sub-chunk before M    ``sum_{i >= m}`` of the rows' sums over those j
  i after M, j in M                    ``sum_{j < m}`` of the columns' sums over those i
  i after M, j before M                every token of M: the block pairs' totals

where a row's sum over a block J is ``x_i e^{into_i} * (dX_IJ @ kc)_i`` and a column's
``kc_j * (dX_IJ^T @ x e^{into})_j``, the very terms of dq and dk. A program (one
sub-chunk M) writes the block pairs' totals ``[kd]`` for XLA to add to the sub-chunks
they span, and sums the diagonal block's terms by the tokens' roles, ``dg[m] = sum_{t >=
m} (row_t - col_t)`` over the block (:func:`_dpairs_kernel`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._launch import (F32, block, call, dot, fast_exp, iota, masked_exp, unroll_for,
                                    unrolled)
from pallas_kernels._delta import block_inverse, stacked_through
from pallas_kernels.kda.chunk import S, after, before, from_here, inclusive, to_end

# kda_dpairs's diagonal loops unrolled at trace time (16 steps of a sub-chunk; H100, the op's
# forward + backward at B1 T16384 H16 K=V=128: 6.580 ms, against 6.826 / 7.115 / 7.072 /
# 7.190 with 8 / 4 / 2 / 1 steps per fori_loop iteration on 2 warps, and 6.637 with 2 steps
# on 4 warps: benchmarks/results/kda_h200.md).
DIAG_UNROLL = S


class SubChunks:
  """One chunk's K slice as 16-token sub-chunks (``kda_intra``): per-block loads (a loaded
  value is never sliced), the sub-chunks' totals and the decay factors built from them,
  each formed at its use (as measured: fewer live ``[16, 128]`` tiles)."""

  def __init__(self, g_ref, q_ref, k_ref, b, hd, n, ks, C):
    self.L = C // S
    self.rows = [pl.ds(n * C + I * S, S) for I in range(self.L)]
    self.refs = dict(g=g_ref, q=q_ref, k=k_ref)
    self.b, self.hd, self.ks = b, hd, ks
    self.tot = [jnp.sum(self.load("g", I), axis=0) for I in range(self.L)]

  def load(self, name, I):
    return self.refs[name][self.b, self.rows[I], self.hd, self.ks].astype(F32)

  def into(self, I):
    """``e^{into}`` ``[16, kd]``: g summed from the start of I to each row."""
    return fast_exp(inclusive(self.load("g", I)))

  def columns(self, J, I):
    """``k_J e^{after_J + between(J, I)}`` ``[16, kd]``: the column factor of block pair
    (I, J), J < I (a product of exps of sums of the tokens each spans, each <= 1; after_J
    as one reverse exclusive scan, :func:`pallas_kernels.kda.chunk.to_end`, which measured
    faster than the IEEE float32 dot with a 0 / 1 triangle before it). A scan of g and k
    loaded last token first, put back in order by a bf16 exchange-matrix dot, had measured
    slower than that dot (the op's forward 2.304 / 2.294 against 2.283 / 2.283 ms at B8
    T4096 H16 K=V=128 on an H100, 2026-12-07, ``benchmarks/results/kda_h200.md``)."""
    kc = self.load("k", J) * fast_exp(to_end(self.load("g", J)))
    span = self.between(J, I)
    return kc if span is None else kc * span[None, :]

  def between(self, J, I):
    """``e^{sum of the totals of sub-chunks J < M < I}`` ``[kd]`` (None if none)."""
    acc = None
    for M in range(J + 1, I):
      acc = self.tot[M] if acc is None else acc + self.tot[M]
    return None if acc is None else fast_exp(acc)


# --- forward: A, P and T ------------------------------------------------------------------

def _diag_kernel(q_ref, k_ref, g_ref, ad_ref, pd_ref, *, BH):
  """Token i's row of its sub-chunk's diagonal blocks, for BH heads at once: column j
  from i down to the sub-chunk's start, ``e^{E}`` with ``E = sum_{j < m <= i} g_m`` carried
  from column to column (``E += g_j``), each column's sums stored in place (no
  accumulator tile). Only the columns j <= i are written."""
  b, i, hg = (pl.program_id(x) for x in range(3))
  hs = pl.ds(hg * BH, BH)
  start = (i // S) * S
  qi = q_ref[b, i, hs, :].astype(F32)            # [BH, K]
  ki = k_ref[b, i, hs, :].astype(F32)

  def column(s, E):
    j = i - s
    ke = k_ref[b, j, hs, :].astype(F32) * fast_exp(E)
    ad_ref[b, i, hs, j - start] = jnp.sum(ki * ke, axis=1)
    pd_ref[b, i, hs, j - start] = jnp.sum(qi * ke, axis=1)
    return E + g_ref[b, j, hs, :].astype(F32)

  jax.lax.fori_loop(0, i - start + 1, column, jnp.zeros(qi.shape, F32))


def diag(q, k, g, *, config):
  """(Ad, Pd float32 ``[B, T, H, 16]``): ``sum_d k_i k_j e^{seg}`` and ``sum_d q_i k_j
  e^{seg}`` for each token i and the tokens j <= i of its 16-token sub-chunk (column j
  at ``j % 16``; the columns after i are left unwritten), one program per token and
  ``config.diag.bh`` heads (``kda_diag``)."""
  B, T, H, K = k.shape
  BH = block(H, config.diag.bh)
  kern = functools.partial(_diag_kernel, BH=BH)
  out = (jax.ShapeDtypeStruct((B, T, H, S), F32),) * 2
  return call(kern, out, (B, T, H // BH), config=config, num_warps=config.diag.warps,
              num_stages=config.diag.stages, name="kda_diag")(q, k, g)


def _intra_kernel(q_ref, k_ref, g_ref, beta_ref, ad_ref, pd_ref, t_ref, p_ref, y_ref, *, C,
                  K, KD, dt, config):
  """kda_diag's blocks in (``ad_ref``, ``pd_ref``); T and P out, and the inverse's scratch
  (``y_ref``)."""
  b, hd, n = (pl.program_id(i) for i in range(3))
  L = C // S
  rows = [pl.ds(n * C + I * S, S) for I in range(L)]
  pairs = [(I, J) for I in range(L) for J in range(I)]
  betas = [beta_ref[b, rows[I], hd].astype(F32) for I in range(L)]

  def k_slice(kk, acc):
    sub = SubChunks(g_ref, q_ref, k_ref, b, hd, n, pl.ds(kk * KD, KD), C)
    A, P = dict(zip(pairs, acc[0])), dict(zip(pairs, acc[1]))
    for I in range(L):
      into = sub.into(I)
      qe, ke = sub.load("q", I) * into, sub.load("k", I) * into
      for J in range(I):
        kc = sub.columns(J, I)
        A[I, J] = A[I, J] + dot(ke, kc, dt, tb=True)
        P[I, J] = P[I, J] + dot(qe, kc, dt, tb=True)
    return tuple(A[p] for p in pairs), tuple(P[p] for p in pairs)

  zero = tuple(jnp.zeros((S, S), F32) for _ in pairs)
  accA, accP = jax.lax.fori_loop(0, K // KD, k_slice, (zero, zero))
  A, P = dict(zip(pairs, accA)), dict(zip(pairs, accP))
  r, c = iota((S, S), 0), iota((S, S), 1)
  for I in range(L):
    P[I, I] = jnp.where(r >= c, pd_ref[b, rows[I], hd, :], 0.0)
    for J in range(I):
      A[I, J] = betas[I][:, None] * A[I, J]
  for I in range(L):
    for J in range(L):
      blk = P[I, J] if J <= I else jnp.zeros((S, S), F32)
      p_ref[b, rows[I], hd, pl.ds(J * S, S)] = blk.astype(p_ref.dtype)

  def a_rows(i, first):                # row i of each row's diagonal block, with its beta
    tok = n * C + first + i
    a = beta_ref[b, tok, hd].astype(F32)[:, None] * ad_ref[b, tok, hd, :]
    return jnp.where(iota(a.shape, 1) < i, a, 0.0)

  X = block_inverse(A, L, stacked_through(y_ref, b, hd, n, C, config, a_rows), dt)
  for I in range(L):
    for J in range(L):
      blk = X[I, J] if J <= I else jnp.zeros((S, S), F32)
      t_ref[b, rows[I], hd, pl.ds(J * S, S)] = blk.astype(t_ref.dtype)


def intra(q, k, g, beta, *, chunk_size, config):
  """(T = (I + A)^{-1}, P), each ``[B, T, H, C]`` in k's dtype (row i of its chunk's
  matrix at token i; zero above the diagonal; P's two readers, the output and v_new's
  cotangent, take it as a dot operand of that dtype). P is unscaled. The diagonal blocks
  come from :func:`diag` (a program per token and ``config.diag.bh`` heads), the rest from
  a program per chunk (``config.intra``: its K slice ``kd``). The program accumulates A's
  and P's blocks in one loop over K slices (12 ``[16, 16]`` float32 tiles live, spilling
  on one warp); P's loop then A's, 6 live, measured slower on an H100: the op's forward
  2.700 against 2.154 ms at B8 T4096 H16 K=V=128 (``benchmarks/results/kda_h200.md``)."""
  B, T, H, K = k.shape
  C = chunk_size
  kern = functools.partial(_intra_kernel, C=C, K=K, KD=block(K, config.intra.kd), dt=k.dtype,
                           config=config)
  out = (jax.ShapeDtypeStruct((B, T, H, C), k.dtype),
         jax.ShapeDtypeStruct((B, T, H, C), k.dtype),
         jax.ShapeDtypeStruct((B, T, H, S), F32))        # + the inverse's scratch
  res = call(kern, out, (B, H, T // C), config=config, num_warps=config.intra.warps,
             num_stages=config.intra.stages, name="kda_intra")(
                 q, k, g, beta, *diag(q, k, g, config=config))
  return res[:2]


# --- backward: through A and P ------------------------------------------------------------

def _dpairs_kernel(q_ref, k_ref, g_ref, beta_ref, dp_ref, da_ref, dq_in_ref, dk_in_ref,
                   dg_in_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, tot_ref, *, C, NK, KD, dt,
                   unroll):
  """One sub-chunk M and K slice of one chunk: M's rows against the columns before them,
  M's columns against the rows after them, and M's diagonal block twice, once by its
  columns (the rows' sums) and once by its rows (the columns' sums), so no loop sums
  across a tile's rows. Writes dq, dk, dbeta's part from this K slice, dg but for the
  block pairs spanning all of M (dq, dk, dg with the parts formed before, ``d*_in``,
  added; dq and dk in their output dtype), and for each earlier sub-chunk J the total of
  dseg over the block pair (M, J) (``tot_ref[b, hd, n, M, J]``), from which
  :func:`dpairs` adds those."""
  b, hd, f = (pl.program_id(i) for i in range(3))
  L = C // S
  n, M, kk = f // (L * NK), (f // NK) % L, f % NK
  ks, base = pl.ds(kk * KD, KD), n * C
  sub = lambda I: pl.ds(base + I * S, S)
  mcols = pl.ds(M * S, S)                        # M's columns of the chunk's dP and dA
  load = lambda ref, I: ref[b, sub(I), hd, ks].astype(F32)
  rowv = lambda ref, t: ref[b, t, hd, ks].astype(F32)[None, :]      # token t's [1, kd]
  q, k, g = load(q_ref, M), load(k_ref, M), load(g_ref, M)
  beta = beta_ref[b, sub(M), hd].astype(F32)[:, None]
  into = fast_exp(inclusive(g))
  xq, xk = q * into, beta * k * into             # the rows' factors times their sums
  zero, zrow = jnp.zeros(q.shape, F32), jnp.zeros((KD,), F32)

  # Rows of M against the columns of J < M, J from M - 1 down; span: the totals of the
  # sub-chunks strictly between J and M. Column factor k_J e^{after_J + span} (<= 1).
  def earlier(s, carry):
    rp, ra, span = carry
    J = M - 1 - s
    gJ = load(g_ref, J)
    kc = load(k_ref, J) * fast_exp(after(gJ) + span[None, :])
    cols = pl.ds(J * S, S)
    p = dot(dp_ref[b, sub(M), hd, cols], kc, dt)
    a = dot(da_ref[b, sub(M), hd, cols], kc, dt)
    tot_ref[b, hd, n, M, J, ks] = jnp.sum(xq * p + xk * a, axis=0)
    return rp + p, ra + a, span + jnp.sum(gJ, axis=0)

  rp, ra, _ = jax.lax.fori_loop(0, M, earlier, (zero, zero, zrow))

  # Columns of M against the rows of I > M, I from M + 1 up; row factor e^{span + into_I}.
  def later(s, carry):
    col, span = carry
    I = M + 1 + s
    gI = load(g_ref, I)
    ei = fast_exp(inclusive(gI) + span[None, :])
    bI = beta_ref[b, sub(I), hd].astype(F32)[:, None]
    col = (col + dot(dp_ref[b, sub(I), hd, mcols], load(q_ref, I) * ei, dt, ta=True)
           + dot(da_ref[b, sub(I), hd, mcols], bI * load(k_ref, I) * ei, dt, ta=True))
    return col, span + jnp.sum(gI, axis=0)

  col, _ = jax.lax.fori_loop(0, L - 1 - M, later, (zero, zrow))

  # The diagonal block, its pairs j < r (an empty span, j = r, is added after):
  # by columns j from the last, E[r] = sum_{j < m <= r} g_m, for the rows' sums ...
  row = iota(q.shape, 0)
  first = base + M * S

  def by_columns(i, carry):
    dq, dkr, E = carry
    j = S - 1 - i
    e = masked_exp(row > j, E, fast_exp)
    ke = rowv(k_ref, first + j) * e
    dq = dq + dp_ref[b, sub(M), hd, M * S + j][:, None] * ke
    dkr = dkr + da_ref[b, sub(M), hd, M * S + j][:, None] * ke
    return dq, dkr, jnp.where(row >= j, E + rowv(g_ref, first + j), 0.0)

  dq, dkr, _ = unrolled(S, unroll, by_columns, (zero, zero, zero))

  # ... and by rows i from the first, E[c] = sum_{c < m <= i} g_m, for the columns' sums.
  def by_rows(i, carry):
    dkc, E = carry
    E = jnp.where(row < i, E + rowv(g_ref, first + i), 0.0)
    e = masked_exp(row < i, E, fast_exp)
    pr = dp_ref[b, first + i, hd, mcols][:, None]
    ar = (beta_ref[b, first + i, hd].astype(F32) * da_ref[b, first + i, hd, mcols])[:, None]
    dkc = dkc + (pr * rowv(q_ref, first + i) + ar * rowv(k_ref, first + i)) * e
    return dkc, E

  dkc, _ = unrolled(S, unroll, by_rows, (zero, zero))

  # dg: the diagonal block's pairs by the roles (a token's row sum minus its column sum,
  # summed from it on: the pairs after it cancel, each term computed alike both ways in
  # float32); the rows' pairs with earlier sub-chunks over the tokens from the row back
  # to M's start (into), the columns' with later ones over those after the column (after).
  ecol = fast_exp(after(g)) * col
  dg_ref[b, sub(M), hd, ks] = dg_in_ref[b, sub(M), hd, ks] + (
      from_here(q * dq + k * (beta * dkr - dkc) + xq * rp + xk * ra) + before(k * ecol))
  rv = iota((S,), 0)
  pd = dp_ref[b, first + rv, hd, M * S + rv][:, None]      # P's diagonal: an empty span
  dkr = dkr + into * ra
  dq_ref[b, sub(M), hd, ks] = (dq_in_ref[b, sub(M), hd, ks] + dq + into * rp
                               + pd * k).astype(dq_ref.dtype)
  dk_ref[b, sub(M), hd, ks] = (dk_in_ref[b, sub(M), hd, ks] + beta * dkr + dkc + ecol
                               + pd * q).astype(dk_ref.dtype)
  dbeta_ref[b, sub(M), hd, kk] = jnp.sum(k * dkr, axis=1)


def dpairs(q, k, g, beta, dP, dA, dq_in, dk_in, dg_in, dbeta_in, *, chunk_size, config):
  """(dq in q's dtype, dk in k's dtype, dg float32 [B, T, H, K], dbeta float32 [B, T, H]):
  the backward through P and A from their cotangents (``dP`` incl. the output's scale,
  ``dA`` without beta; float32 ``[B, T, H, C]``), with the gradients' other parts
  (``d*_in``, float32) added: dq, dk and dg in the kernel, which writes the op's dq and
  dk. A program per chunk, sub-chunk and K slice of ``config.dpairs.kd`` channels
  (:func:`_dpairs_kernel`), then in XLA dbeta's sum over the K slices and, for each
  sub-chunk M, the totals of the block pairs (I, J) with J < M < I added to dg on its
  tokens.

  dg's terms of the blocks below the diagonal are summed over exactly the tokens their
  spans hold. Those of the diagonal blocks are summed by the tokens' roles: for m in the
  block, ``sum_{t >= m} (row_t - col_t)`` over its tokens (t's pairs with earlier
  columns, minus with later rows), where the pairs inside the tokens >= m cancel. Every
  such term is formed in float32 from the same factors both ways and spans at least one
  token (P's diagonal, whose span is empty, stays out), so the cancelled terms are no
  larger than the ones that stay (``tests/kernels/test_kda_kernels.py`` holds dg to the
  float32 autodiff of the jnp form, in float32 and in bf16)."""
  B, T, H, K = q.shape
  C = chunk_size
  L, N = C // S, T // C
  KD = block(K, config.dpairs.kd)
  NK = K // KD
  kern = functools.partial(_dpairs_kernel, C=C, NK=NK, KD=KD, dt=q.dtype,
                           unroll=unroll_for(config, DIAG_UNROLL))
  out = (jax.ShapeDtypeStruct((B, T, H, K), q.dtype), jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
         jax.ShapeDtypeStruct((B, T, H, K), F32), jax.ShapeDtypeStruct((B, T, H, NK), F32),
         jax.ShapeDtypeStruct((B, H, N, L, L, K), F32))
  dq, dk, dg, dbeta, tot = call(kern, out, (B, H, N * L * NK), config=config,
                                num_warps=config.dpairs.warps,
                                num_stages=config.dpairs.stages, name="kda_dpairs",
                                aliases={8: 2})(q, k, g, beta, dP, dA, dq_in, dk_in, dg_in)
  # through[M] = sum of tot[I, J] over I > M > J (only entries J < I are written).
  through = [sum((tot[:, :, :, I, J] for I in range(M + 1, L) for J in range(M)),
                 jnp.zeros((B, H, N, K), F32)) for M in range(L)]
  through = jnp.stack(through, axis=3)                      # [B, H, N, L, K]
  through = jnp.repeat(through.transpose(0, 2, 3, 1, 4), S, axis=2)   # [B, N, C, H, K]
  dg = dg + through.reshape(B, T, H, K)
  return dq, dk, dg, dbeta_in + jnp.sum(dbeta, axis=-1)


