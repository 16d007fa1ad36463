"""Chunk-parallel stages: intra-chunk scores A, their cotangent dA, and the output.

Scores ``A[r, i] = sum_k q_rk k_ik exp(bc_rk - bc_ik)`` for ``i <= r`` (unscaled), two
kernels:

* ``gla_scores``, grid ``(B, H, N)``: the blocks below the 16 x 16 diagonal. Rows of
  sub-chunk ``s`` and the columns before it factor through the reference ``ref = bc`` at
  the row before ``s``: ``exp(bc_r - ref) * exp(ref - bc_i)``, both factors <= 1; one
  ``[C, KD] x [KD, C]`` tensor-core dot per sub-chunk.
* ``gla_scores_diag``, grid ``(B, H, N, C / 16)``: each diagonal block exact in log
  space, one column ``j`` at a time (``A[r, j] = sum_k q_rk k_jk exp(bc_rk - bc_jk)`` on a
  ``[16, KD]`` tile, row ``j`` loaded from memory), written in place. Its tiles are small
  so that many programs fit on an SM: this loop is latency-bound.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm

S = cm.SUB


def _scores_off_kernel(q_ref, k_ref, bc_ref, a_ref, *, C, K, KD, dt):
  """A for one chunk with zero diagonal blocks: for each sub-chunk s >= 1, rows of s times
  columns before s, through the reference row ``16 s - 1`` (both factors <= 1)."""
  b, hd, n = (pl.program_id(i) for i in range(3))
  t0 = n * C
  tc = pl.ds(t0, C)
  row = cm.iota((C, KD), 0)
  blk = row // S

  def k_slice(kk, acc):
    ks = pl.ds(kk * KD, KD)
    bc = bc_ref[b, tc, hd, ks]                                     # [C, KD]
    q = q_ref[b, tc, hd, ks].astype(cm.F32)
    k = k_ref[b, tc, hd, ks].astype(cm.F32)
    for s in range(1, C // S):
      ref = bc_ref[b, t0 + s * S - 1, hd, ks][None, :]             # [1, KD]
      q_fac = q * cm.masked_exp(blk == s, bc - ref)                # rows of s only
      k_fac = k * cm.masked_exp(row < s * S, ref - bc)             # columns before s
      acc = acc + cm.dot(q_fac, k_fac, dt, tb=True)
    return acc

  a_ref[b, hd, n] = jax.lax.fori_loop(0, K // KD, k_slice, jnp.zeros((C, C), cm.F32))


def _diag_kernel(q_ref, k_ref, bc_ref, a_in_ref, a_ref, *, C, K, KD):
  """The 16 x 16 diagonal block of sub-chunk s, exact in log space, one column j at a
  time (written in place into A from ``_scores_off_kernel``)."""
  del a_in_ref                      # aliased to a_ref: the off-diagonal part is kept
  b, hd, n, s = (pl.program_id(i) for i in range(4))
  r0 = n * C + s * S
  rows = pl.ds(r0, S)
  row = cm.iota((S, KD), 0)
  col = cm.iota((S, S), 1)

  def k_slice(kk, diag):
    ks = pl.ds(kk * KD, KD)
    bc_a = bc_ref[b, rows, hd, ks]                                  # [S, KD]
    q_a = q_ref[b, rows, hd, ks].astype(cm.F32)

    def column(j, diag):
      kj = k_ref[b, r0 + j, hd, ks].astype(cm.F32)[None, :]        # [1, KD]
      bj = bc_ref[b, r0 + j, hd, ks][None, :]
      val = jnp.sum(q_a * kj * cm.masked_exp(row >= j, bc_a - bj), axis=1)   # [S]
      return diag + jnp.where(col == j, val[:, None], 0.0)

    return jax.lax.fori_loop(0, S, column, diag)

  a_ref[b, hd, n, pl.ds(s * S, S), pl.ds(s * S, S)] = jax.lax.fori_loop(
      0, K // KD, k_slice, jnp.zeros((S, S), cm.F32))


def scores(q, k, bc, *, chunk_size, config):
  """A [B, H, N, C, C] float32: unscaled, zero above the diagonal."""
  B, T, H, K = q.shape
  C = chunk_size
  N = T // C
  a_shape = jax.ShapeDtypeStruct((B, H, N, C, C), cm.F32)
  off = functools.partial(_scores_off_kernel, C=C, K=K, KD=cm.block(K, config.scores_kd),
                          dt=q.dtype)
  A = cm.call(off, a_shape, (B, H, N), config=config, num_warps=config.scores_warps,
              num_stages=config.scores_stages, name="gla_scores")(q, k, bc)
  diag = functools.partial(_diag_kernel, C=C, K=K, KD=cm.block(K, config.diag_kd))
  return cm.call(diag, a_shape, (B, H, N, C // S), config=config, num_warps=config.diag_warps,
                 num_stages=config.diag_stages, name="gla_scores_diag",
                 aliases={3: 0})(q, k, bc, A)


def _da_kernel(do_ref, v_ref, da_ref, *, C, V, BV, dt, scale):
  b, hd, n = (pl.program_id(i) for i in range(3))
  tc = pl.ds(n * C, C)

  def v_slice(iv, da):
    vs = pl.ds(iv * BV, BV)
    return da + cm.dot(do_ref[b, tc, hd, vs], v_ref[b, tc, hd, vs], dt, tb=True)

  da = jax.lax.fori_loop(0, V // BV, v_slice, jnp.zeros((C, C), cm.F32))
  da_ref[b, hd, n] = jnp.where(cm.iota((C, C), 0) >= cm.iota((C, C), 1), scale * da, 0.0)


def score_grad(do, v, *, scale, chunk_size, config):
  """dA = tril(scale * do v^T) [B, H, N, C, C] float32."""
  B, T, H, V = v.shape
  C = chunk_size
  BV = cm.block(V, config.da_bv)
  kern = functools.partial(_da_kernel, C=C, V=V, BV=BV, dt=v.dtype, scale=scale)
  return cm.call(kern, jax.ShapeDtypeStruct((B, H, T // C, C, C), cm.F32), (B, H, T // C),
                 config=config, num_warps=config.da_warps, num_stages=config.da_stages,
                 name="gla_score_grad")(do, v)


def _output_kernel(q_ref, v_ref, bc_ref, h_ref, a_ref, o_ref, *, C, K, BK, BV, dt, scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  tc, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  o = cm.dot(a_ref[b, hd, n], v_ref[b, tc, hd, vs], dt)
  for kk in range(K // BK):
    ks = pl.ds(kk * BK, BK)
    q_dec = q_ref[b, tc, hd, ks].astype(cm.F32) * jnp.exp(bc_ref[b, tc, hd, ks])
    o = o + cm.dot(q_dec, h_ref[b, hd, n, ks, vs], dt)
  o_ref[b, tc, hd, vs] = (scale * o).astype(o_ref.dtype)


def output(q, v, bc, h, A, *, scale, chunk_size, config):
  """o = scale * ((q e^bc) h[n] + A v): [B, T, H, V] in v's dtype."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  BK, BV = cm.block(K, config.out_bk), cm.block(V, config.out_bv)
  kern = functools.partial(_output_kernel, C=C, K=K, BK=BK, BV=BV, dt=q.dtype, scale=scale)
  return cm.call(kern, jax.ShapeDtypeStruct(v.shape, v.dtype), (B, H, N, V // BV),
                 config=config, num_warps=config.out_warps, num_stages=config.out_stages,
                 name="gla_output")(q, v, bc, h, A)
