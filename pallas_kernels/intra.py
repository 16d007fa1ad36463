"""Chunk-parallel forward stages: intra-chunk scores A (and dA for the backward), output.

Grid ``(B, H, N)`` for the scores, ``(B, H, N, V / BV)`` for the output.

Scores ``A[r, i] = sum_k q_rk k_ik exp(b_rk - b_ik)`` for ``i <= r`` (unscaled) are built
one 16-row sub-chunk ``a`` at a time. Columns before the sub-chunk factor through the
reference ``ref_a = b`` at the last row before it: ``exp(b_r - ref_a) * exp(ref_a - b_i)``,
both factors <= 1, one tensor-core dot. The diagonal ``16 x 16`` block takes every pair's
decay exactly in log space (a ``[16, 16, KD]`` tensor), so strong decay never overflows.
The diagonal block is placed into the row block with a one-hot float32 dot (exact).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm

S = cm.SUB


def _diag_block(q_a, k_a, bl):
  """[S, S]: sum_k q_r k_j exp(bl_r - bl_j) for j <= r (bl: sub-chunk-local cumsum)."""
  shape3 = (S, S, bl.shape[-1])
  decay = cm.masked_exp(cm.iota(shape3, 0) >= cm.iota(shape3, 1), bl[:, None, :] - bl[None, :, :])
  return jnp.sum(q_a[:, None, :] * k_a[None, :, :] * decay, axis=2)


def _score_rows(q_ref, k_ref, g_ref, b, hd, t0, a, *, C, K, KD, dt):
  """Rows of sub-chunk ``a`` of the unscaled scores A: [S, C] float32, zero above the
  diagonal. ``a`` may be traced (the caller loops over sub-chunks)."""
  tc = pl.ds(t0, C)
  rows = pl.ds(t0 + a * S, S)
  row = cm.iota((C, KD), 0)

  def k_slice(kk, acc):
    acc_off, acc_diag = acc
    ks = pl.ds(kk * KD, KD)
    bc = jnp.cumsum(g_ref[b, tc, hd, ks], axis=0)
    offset = jnp.sum(jnp.where(row == a * S - 1, bc, 0.0), axis=0, keepdims=True)
    bl = cm.rows_of(bc, a) - offset              # b_r - b at the row before a
    q_a = q_ref[b, rows, hd, ks].astype(cm.F32)
    k_a = k_ref[b, rows, hd, ks].astype(cm.F32)
    k_fac = k_ref[b, tc, hd, ks].astype(cm.F32) * cm.masked_exp(row < a * S, offset - bc)
    acc_off = acc_off + cm.dot(q_a * jnp.exp(bl), k_fac, dt, tb=True)
    return acc_off, acc_diag + _diag_block(q_a, k_a, bl)

  # Loops, not Python unrolling: the unrolled kernel took ~50 s to compile in Triton.
  acc_off, acc_diag = jax.lax.fori_loop(
      0, K // KD, k_slice, (jnp.zeros((S, C), cm.F32), jnp.zeros((S, S), cm.F32)))
  one_hot = ((cm.iota((S, C), 1) - cm.iota((S, C), 0)) == a * S).astype(cm.F32)
  return acc_off + cm.dot(acc_diag, one_hot, cm.F32)


def _scores_kernel(*refs, C, K, KD, V, BV, dt, scale, with_da):
  if with_da:
    q_ref, k_ref, g_ref, do_ref, v_ref, a_ref, da_ref = refs
  else:
    q_ref, k_ref, g_ref, a_ref = refs
  b, hd, n = (pl.program_id(i) for i in range(3))
  t0 = n * C
  tc = pl.ds(t0, C)

  def sub_chunk(a, carry):
    a_ref[b, hd, n, pl.ds(a * S, S), :] = _score_rows(q_ref, k_ref, g_ref, b, hd, t0, a, C=C,
                                                      K=K, KD=KD, dt=dt)
    return carry

  jax.lax.fori_loop(0, C // S, sub_chunk, 0)
  if with_da:
    def v_slice(iv, da):
      vs = pl.ds(iv * BV, BV)
      return da + cm.dot(do_ref[b, tc, hd, vs], v_ref[b, tc, hd, vs], dt, tb=True)

    da = jax.lax.fori_loop(0, V // BV, v_slice, jnp.zeros((C, C), cm.F32))
    causal = cm.iota((C, C), 0) >= cm.iota((C, C), 1)
    da_ref[b, hd, n] = jnp.where(causal, scale * da, 0.0)


def scores(q, k, g, *, chunk_size, do=None, v=None, scale=1.0):
  """A [B, H, N, C, C] float32 (unscaled, lower triangular); with do and v also
  dA = tril(scale * do v^T) [B, H, N, C, C]."""
  B, T, H, K = q.shape
  C = chunk_size
  N = T // C
  KD = cm.block(K, cm.TUNE['scores_kd'])
  with_da = do is not None
  V = v.shape[-1] if with_da else 16
  BV = cm.block(V, cm.TUNE['scores_bv'])
  kern = functools.partial(_scores_kernel, C=C, K=K, KD=KD, V=V, BV=BV, dt=q.dtype,
                           scale=scale, with_da=with_da)
  a_shape = jax.ShapeDtypeStruct((B, H, N, C, C), cm.F32)
  if with_da:
    return cm.call(kern, (a_shape, a_shape), (B, H, N),
                   num_warps=cm.TUNE['scores_warps'], num_stages=1,
                   name="gla_scores_bwd")(q, k, g, do, v)
  return cm.call(kern, a_shape, (B, H, N),
                   num_warps=cm.TUNE['scores_warps'], num_stages=1,
                 name="gla_scores")(q, k, g)


def _output_kernel(q_ref, v_ref, g_ref, h_ref, a_ref, o_ref, *, C, K, BK, BV, dt, scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  tc, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  o = cm.dot(a_ref[b, hd, n], v_ref[b, tc, hd, vs], dt)
  for kk in range(K // BK):
    ks = pl.ds(kk * BK, BK)
    q_dec = q_ref[b, tc, hd, ks].astype(cm.F32) * jnp.exp(jnp.cumsum(g_ref[b, tc, hd, ks], axis=0))
    o = o + cm.dot(q_dec, h_ref[b, hd, n, ks, vs], dt)
  o_ref[b, tc, hd, vs] = (scale * o).astype(o_ref.dtype)


def output(q, v, g, h, A, *, scale, chunk_size):
  """o = scale * ((q e^b) h[n] + A v): [B, T, H, V] in v's dtype."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  BK, BV = cm.block(K, cm.TUNE['out_bk']), cm.block(V, cm.TUNE['out_bv'])
  kern = functools.partial(_output_kernel, C=C, K=K, BK=BK, BV=BV, dt=q.dtype, scale=scale)
  return cm.call(kern, jax.ShapeDtypeStruct(v.shape, v.dtype), (B, H, N, V // BV),
                 num_warps=cm.TUNE['out_warps'], num_stages=cm.TUNE['out_stages'],
                 name="gla_output")(q, v, g, h, A)


def _fused_output_kernel(q_ref, k_ref, v_ref, g_ref, h_ref, o_ref, *, C, K, KD, BK, BV, dt,
                         scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  t0 = n * C
  tc, vs = pl.ds(t0, C), pl.ds(iv * BV, BV)
  v_tile = v_ref[b, tc, hd, vs]

  def sub_chunk(a, carry):
    rows = pl.ds(t0 + a * S, S)
    A_rows = _score_rows(q_ref, k_ref, g_ref, b, hd, t0, a, C=C, K=K, KD=KD, dt=dt)

    def k_block(kk, o):
      ks = pl.ds(kk * BK, BK)
      b_a = cm.rows_of(jnp.cumsum(g_ref[b, tc, hd, ks], axis=0), a)
      q_dec = q_ref[b, rows, hd, ks].astype(cm.F32) * jnp.exp(b_a)
      return o + cm.dot(q_dec, h_ref[b, hd, n, ks, vs], dt)

    o = jax.lax.fori_loop(0, K // BK, k_block, cm.dot(A_rows, v_tile, dt))
    o_ref[b, rows, hd, vs] = (scale * o).astype(o_ref.dtype)
    return carry

  jax.lax.fori_loop(0, C // S, sub_chunk, 0)


def fused_output(q, k, v, g, h, *, scale, chunk_size):
  """Scores and output in one kernel (A never written): the ``fuse_scores_output`` option.

  A is recomputed for each V tile; with V <= ``out_bv`` there is one tile and no recompute.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  KD = cm.block(K, cm.TUNE['scores_kd'])
  BK, BV = cm.block(K, cm.TUNE['out_bk']), cm.block(V, cm.TUNE['out_bv'])
  kern = functools.partial(_fused_output_kernel, C=C, K=K, KD=KD, BK=BK, BV=BV, dt=q.dtype,
                           scale=scale)
  return cm.call(kern, jax.ShapeDtypeStruct(v.shape, v.dtype), (B, H, N, V // BV),
                 num_warps=cm.TUNE['out_warps'], num_stages=cm.TUNE['out_stages'],
                 name="gla_scores_output")(q, k, v, g, h)
