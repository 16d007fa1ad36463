"""Chunk-parallel backward stages: dv, and dq / dk / dg (chunked.py's formulas).

  dv = scale A^T do + (k e^{b_last - b}) dH[n]
  dq = scale (do h[n]^T) e^{b} + row_side(dA, k)
  dk = col_side(dA, q) + (v dH[n]^T) e^{b_last - b}
  dg = reverse cumsum over the chunk of (q dq - k dk), plus on every row the chunk-total
       term e^{b_last} sum_v(h dH) + sum_i k dk_state (the state leaving the chunk
       depends on every gate of the chunk).

The intra-chunk terms are per 16-row sub-chunk with the same references as the scores:
rows use the row before the sub-chunk, columns use the sub-chunk's last row, and the
diagonal block is exact in log space. Each program owns one ``BK`` slice of K for one
chunk, so dg's reverse cumsum runs over the sub-chunks in reverse inside the program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm

S = cm.SUB


def _dv_kernel(k_ref, g_ref, do_ref, a_ref, dh_ref, dv_ref, *, C, K, BK, BV, dt, scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  tc, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  dv = scale * cm.dot(a_ref[b, hd, n], do_ref[b, tc, hd, vs], dt, ta=True)
  for kk in range(K // BK):
    ks = pl.ds(kk * BK, BK)
    g = g_ref[b, tc, hd, ks]
    bc = jnp.cumsum(g, axis=0)
    k_dec = k_ref[b, tc, hd, ks].astype(cm.F32) * jnp.exp(cm.last_row(bc) - bc)
    dv = dv + cm.dot(k_dec, dh_ref[b, hd, n, ks, vs], dt)
  dv_ref[b, tc, hd, vs] = dv.astype(dv_ref.dtype)


def dv(k, g, do, A, dH, *, scale, chunk_size):
  B, T, H, K = k.shape
  V = do.shape[-1]
  C = chunk_size
  BK, BV = cm.block(K, cm.TUNE['dv_bk']), cm.block(V, cm.TUNE['dv_bv'])
  kern = functools.partial(_dv_kernel, C=C, K=K, BK=BK, BV=BV, dt=k.dtype, scale=scale)
  return cm.call(kern, jax.ShapeDtypeStruct(do.shape, do.dtype), (B, H, T // C, V // BV),
                 num_warps=cm.TUNE['dv_warps'], num_stages=cm.TUNE['dv_stages'],
                 name="gla_dv")(k, g, do, A, dH)


def _dqdk_kernel(q_ref, k_ref, v_ref, g_ref, do_ref, h_ref, dh_ref, da_ref,
                 dq_ref, dk_ref, dg_ref, *, C, V, BK, BV, dt, scale):
  b, hd, n, ik = (pl.program_id(i) for i in range(4))
  t0 = n * C
  tc, ks = pl.ds(t0, C), pl.ds(ik * BK, BK)
  row = cm.iota((C, BK), 0)
  bc = jnp.cumsum(g_ref[b, tc, hd, ks], axis=0)
  b_last = cm.last_row(bc)
  k_full = k_ref[b, tc, hd, ks].astype(cm.F32)

  # Chunk-total gate term: e^{b_last} sum_v(h dH) + sum_i k_i dk_state_i.
  def v_total(iv, acc):
    h_dh, v_dh = acc
    vs = pl.ds(iv * BV, BV)
    dH = dh_ref[b, hd, n, ks, vs].astype(cm.F32)
    h_dh = h_dh + jnp.sum(h_ref[b, hd, n, ks, vs].astype(cm.F32) * dH, axis=1)[None, :]
    return h_dh, v_dh + cm.dot(v_ref[b, tc, hd, vs], dH, dt, tb=True)

  h_dh, v_dh = jax.lax.fori_loop(0, V // BV, v_total, (jnp.zeros((1, BK), cm.F32),
                                                      jnp.zeros((C, BK), cm.F32)))
  d_last = jnp.exp(b_last) * h_dh + jnp.sum(k_full * v_dh * jnp.exp(b_last - bc), axis=0,
                                            keepdims=True)
  shape3 = (S, S, BK)
  causal3 = cm.iota(shape3, 0) >= cm.iota(shape3, 1)

  # Sub-chunks in reverse, carrying dg's reverse cumsum (a loop: unrolled, Triton compiles
  # this kernel for minutes).
  def sub_chunk(i, carry):
    a = C // S - 1 - i
    rows = pl.ds(t0 + a * S, S)
    start = jnp.sum(jnp.where(row == a * S - 1, bc, 0.0), axis=0, keepdims=True)
    end = jnp.sum(jnp.where(row == a * S + S - 1, bc, 0.0), axis=0, keepdims=True)
    b_a = cm.rows_of(bc, a)
    bl = b_a - start                      # <= 0; exact differences of the one cumsum
    q_a = q_ref[b, rows, hd, ks].astype(cm.F32)
    k_a = k_ref[b, rows, hd, ks].astype(cm.F32)

    def v_slice(iv, acc):
      dq_i, dk_i = acc
      vs = pl.ds(iv * BV, BV)
      dq_i = dq_i + cm.dot(do_ref[b, rows, hd, vs], h_ref[b, hd, n, ks, vs], dt, tb=True)
      dk_i = dk_i + cm.dot(v_ref[b, rows, hd, vs], dh_ref[b, hd, n, ks, vs], dt, tb=True)
      return dq_i, dk_i

    zero = jnp.zeros((S, BK), cm.F32)
    dq_i, dk_i = jax.lax.fori_loop(0, V // BV, v_slice, (zero, zero))
    dq = scale * dq_i * jnp.exp(b_a)
    dk = dk_i * jnp.exp(b_last - b_a)
    # Columns before the sub-chunk (reference: the row before it); zero for a = 0.
    k_fac = k_full * cm.masked_exp(row < a * S, start - bc)
    dq = dq + jnp.exp(bl) * cm.dot(da_ref[b, hd, n, pl.ds(a * S, S), :], k_fac, dt)
    # Rows after the sub-chunk (reference: its last row); zero for the last sub-chunk.
    q_fac = q_ref[b, tc, hd, ks].astype(cm.F32) * cm.masked_exp(row >= a * S + S, bc - end)
    dk = dk + jnp.exp(end - b_a) * cm.dot(da_ref[b, hd, n, :, pl.ds(a * S, S)], q_fac, dt,
                                          ta=True)
    dA_diag = da_ref[b, hd, n, pl.ds(a * S, S), pl.ds(a * S, S)]
    decay = cm.masked_exp(causal3, bl[:, None, :] - bl[None, :, :])        # [r, j, k]
    w = dA_diag[:, :, None] * decay
    dq = dq + jnp.sum(w * k_a[None, :, :], axis=1)
    dk = dk + jnp.sum(w * q_a[:, None, :], axis=0)
    db = q_a * dq - k_a * dk
    dq_ref[b, rows, hd, ks] = dq.astype(dq_ref.dtype)
    dk_ref[b, rows, hd, ks] = dk.astype(dk_ref.dtype)
    dg_ref[b, rows, hd, ks] = carry + cm.rev_cumsum(db)
    return carry + jnp.sum(db, axis=0, keepdims=True)

  jax.lax.fori_loop(0, C // S, sub_chunk, d_last)


def dqdk(q, k, v, g, do, h, dH, dA, *, scale, chunk_size):
  """Returns (dq, dk in q's dtype, dg float32), all [B, T, H, K]."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  BK, BV = cm.block(K, cm.TUNE['dqdk_bk']), cm.block(V, cm.TUNE['dqdk_bv'])
  kern = functools.partial(_dqdk_kernel, C=C, V=V, BK=BK, BV=BV, dt=q.dtype, scale=scale)
  out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(q.shape, cm.F32))
  return cm.call(kern, out, (B, H, T // C, K // BK),
                 num_warps=cm.TUNE['dqdk_warps'], num_stages=1,
                 name="gla_dqdk")(q, k, v, g, do, h, dH, dA)
