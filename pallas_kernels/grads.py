"""Chunk-parallel backward stages: dv, and dq / dk / dg (chunked.py's formulas).

  dv = scale A^T do + (k e^{b_last - bc}) dH[n]
  dq = scale (do h[n]^T) e^{bc} + row_side(dA, k)
  dk = col_side(dA, q) + (v dH[n]^T) e^{b_last - bc}
  dg = reverse cumsum over the chunk of (q dq - k dk), plus on every row the chunk-total
       term sum_v(h[n+1] * dH[n]): the state leaving the chunk depends on every gate of
       the chunk. It is computed as e^{b_last} sum_v(h[n] dH[n]) + sum_i k_i dk_state_i
       (h[n+1] = e^{b_last} h[n] + sum_i (k_i e^{b_last - bc_i}) v_i^T, and dk_state_i =
       (v_i dH[n]^T) e^{b_last - bc_i}), so h[n+1] is never read.

The intra-chunk terms use the same references as the scores: blocks below the diagonal
factor through the row before the sub-chunk (dq) or its last row (dk), one masked
``[C, C] x [C, BK]`` dot per sub-chunk in ``gla_dqdk`` (grid ``(B, H, N, K / BK)``, which
also does the state terms and dg's reverse cumsum over the chunk); the diagonal 16 x 16
blocks are exact in log space, one ``j`` at a time on ``[16, BK]`` tiles in
``gla_dqdk_diag`` (grid ``(B, H, N, C / 16, K / BK)``, partial dq and dk in float32).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm

S = cm.SUB


def _dv_kernel(k_ref, bc_ref, do_ref, a_ref, dh_ref, dv_ref, *, C, K, BK, BV, dt, scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  tc, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  dv = scale * cm.dot(a_ref[b, hd, n], do_ref[b, tc, hd, vs], dt, ta=True)
  for kk in range(K // BK):
    ks = pl.ds(kk * BK, BK)
    b_last = bc_ref[b, n * C + C - 1, hd, ks][None, :]
    k_dec = k_ref[b, tc, hd, ks].astype(cm.F32) * jnp.exp(b_last - bc_ref[b, tc, hd, ks])
    dv = dv + cm.dot(k_dec, dh_ref[b, hd, n, ks, vs], dt)
  dv_ref[b, tc, hd, vs] = dv.astype(dv_ref.dtype)


def dv(k, bc, do, A, dH, *, scale, chunk_size, config):
  B, T, H, K = k.shape
  V = do.shape[-1]
  C = chunk_size
  BK, BV = cm.block(K, config.dv_bk), cm.block(V, config.dv_bv)
  kern = functools.partial(_dv_kernel, C=C, K=K, BK=BK, BV=BV, dt=k.dtype, scale=scale)
  return cm.call(kern, jax.ShapeDtypeStruct(do.shape, do.dtype), (B, H, T // C, V // BV),
                 config=config, num_warps=config.dv_warps, num_stages=config.dv_stages,
                 name="gla_dv")(k, bc, do, A, dH)


def _diag_grad_kernel(q_ref, k_ref, bc_ref, da_ref, dqd_ref, dkd_ref, *, C, BK):
  """Diagonal-block terms of dq and dk for sub-chunk s, exact in log space:
  dq_r += sum_{j <= r} dA[r, j] k_j e^{bc_r - bc_j},  dk_i += sum_{j >= i} dA[j, i] q_j
  e^{bc_j - bc_i}, one j at a time on [16, BK] tiles (small: many programs per SM)."""
  b, hd, n, s, ik = (pl.program_id(i) for i in range(5))
  r0 = n * C + s * S
  rows, ks = pl.ds(r0, S), pl.ds(ik * BK, BK)
  row = cm.iota((S, BK), 0)
  bc_a = bc_ref[b, rows, hd, ks]

  def step(j, acc):
    dq, dk = acc
    t = r0 + j
    bj = bc_ref[b, t, hd, ks][None, :]
    kj = k_ref[b, t, hd, ks].astype(cm.F32)[None, :]
    qj = q_ref[b, t, hd, ks].astype(cm.F32)[None, :]
    da_col = da_ref[b, hd, n, pl.ds(s * S, S), s * S + j][:, None]       # dA[r, j]
    da_row = da_ref[b, hd, n, s * S + j, pl.ds(s * S, S)][:, None]       # dA[j, i]
    dq = dq + da_col * kj * cm.masked_exp(row >= j, bc_a - bj)
    dk = dk + da_row * qj * cm.masked_exp(row <= j, bj - bc_a)
    return dq, dk

  zero = jnp.zeros((S, BK), cm.F32)
  dq, dk = jax.lax.fori_loop(0, S, step, (zero, zero))
  dqd_ref[b, rows, hd, ks] = dq.astype(dqd_ref.dtype)
  dkd_ref[b, rows, hd, ks] = dk.astype(dkd_ref.dtype)


def _dqdk_kernel(q_ref, k_ref, v_ref, bc_ref, do_ref, h_ref, dh_ref, da_ref, dqd_ref, dkd_ref,
                 dq_ref, dk_ref, dg_ref, *, C, V, BK, BV, dt, scale):
  b, hd, n, ik = (pl.program_id(i) for i in range(4))
  t0 = n * C
  tc, ks = pl.ds(t0, C), pl.ds(ik * BK, BK)
  bc = bc_ref[b, tc, hd, ks]                                        # [C, BK]
  b_last = bc_ref[b, t0 + C - 1, hd, ks][None, :]

  def v_slice(iv, acc):
    dq_s, dk_s, d_last = acc
    vs = pl.ds(iv * BV, BV)
    h = h_ref[b, hd, n, ks, vs]
    dH = dh_ref[b, hd, n, ks, vs]
    dq_s = dq_s + cm.dot(do_ref[b, tc, hd, vs], h, dt, tb=True)
    dk_s = dk_s + cm.dot(v_ref[b, tc, hd, vs], dH, dt, tb=True)
    d_last = d_last + jnp.sum(h.astype(cm.F32) * dH.astype(cm.F32), axis=1)   # h[n] dH[n]
    return dq_s, dk_s, d_last

  zero = jnp.zeros((C, BK), cm.F32)
  dq_s, dk_s, d_last = jax.lax.fori_loop(0, V // BV, v_slice,
                                         (zero, zero, jnp.zeros((BK,), cm.F32)))
  q = q_ref[b, tc, hd, ks].astype(cm.F32)
  k = k_ref[b, tc, hd, ks].astype(cm.F32)
  dq = scale * dq_s * jnp.exp(bc) + dqd_ref[b, tc, hd, ks].astype(cm.F32)
  dk_state = dk_s * jnp.exp(b_last - bc)
  # Chunk-total gate term sum_v h[n+1] dH[n] (module docstring).
  d_last = jnp.exp(b_last) * d_last[None, :] + jnp.sum(k * dk_state, axis=0, keepdims=True)
  dk = dk_state + dkd_ref[b, tc, hd, ks].astype(cm.F32)
  dA = da_ref[b, hd, n]                                             # [C, C]
  row = cm.iota((C, BK), 0)
  blk = row // S
  rc, cc = cm.iota((C, C), 0) // S, cm.iota((C, C), 1) // S
  for s in range(C // S):
    if s > 0:     # rows of s, columns before s (reference: the row before s)
      ref = bc_ref[b, t0 + s * S - 1, hd, ks][None, :]
      k_fac = k * cm.masked_exp(row < s * S, ref - bc)
      part = cm.dot(jnp.where((rc == s) & (cc < s), dA, 0.0), k_fac, dt)
      dq = dq + cm.masked_exp(blk == s, bc - ref) * part
    if s < C // S - 1:     # columns of s, rows after s (reference: the last row of s)
      end = bc_ref[b, t0 + s * S + S - 1, hd, ks][None, :]
      q_fac = q * cm.masked_exp(row >= s * S + S, bc - end)
      part = cm.dot(jnp.where((cc == s) & (rc > s), dA, 0.0), q_fac, dt, ta=True)
      dk = dk + cm.masked_exp(blk == s, end - bc) * part
  dq_ref[b, tc, hd, ks] = dq.astype(dq_ref.dtype)
  dk_ref[b, tc, hd, ks] = dk.astype(dk_ref.dtype)
  dg_ref[b, tc, hd, ks] = cm.rev_cumsum(q * dq - k * dk) + d_last


def diag_grads(q, k, bc, dA, *, chunk_size, config):
  """(dq_d, dk_d) float32: the diagonal-block terms of dq and dk (``gla_dqdk_diag``)."""
  B, T, H, K = q.shape
  C = chunk_size
  BK = cm.block(K, config.dqdk_diag_bk)
  part = jax.ShapeDtypeStruct(q.shape, cm.F32)
  return cm.call(functools.partial(_diag_grad_kernel, C=C, BK=BK), (part, part),
                 (B, H, T // C, C // S, K // BK), config=config,
                 num_warps=config.dqdk_diag_warps, num_stages=config.dqdk_diag_stages,
                 name="gla_dqdk_diag")(q, k, bc, dA)


def dqdk(q, k, v, bc, do, h, dH, dA, *, scale, chunk_size, config, diag=None):
  """Returns (dq, dk in q's dtype, dg float32), all [B, T, H, K]; ``h`` and ``dH`` are
  the N chunk states and their cotangents.
  ``diag``: the diagonal-block terms (dq_d, dk_d) when already computed."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  f32 = jax.ShapeDtypeStruct(q.shape, cm.F32)
  dq_d, dk_d = (diag_grads(q, k, bc, dA, chunk_size=C, config=config) if diag is None
                else diag)
  BK, BV = cm.block(K, config.dqdk_bk), cm.block(V, config.dqdk_bv)
  kern = functools.partial(_dqdk_kernel, C=C, V=V, BK=BK, BV=BV, dt=q.dtype, scale=scale)
  out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype), f32)
  return cm.call(kern, out, (B, H, N, K // BK), config=config,
                 num_warps=config.dqdk_warps, num_stages=config.dqdk_stages,
                 name="gla_dqdk")(q, k, v, bc, do, h, dH, dA, dq_d, dk_d)
