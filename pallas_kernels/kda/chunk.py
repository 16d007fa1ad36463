"""The per-chunk kernels of Kimi Delta Attention that work on whole-chunk tiles (grid over
batch, head and chunk, some also V tiles; no state): the WY factors, the output, and the
backward's state, WY and UT-inverse terms. The per-channel intra-chunk matrices A and P
and their backward are :mod:`pallas_kernels.kda.pairs`.

One chunk of C tokens, log-decays g ``[C, K]`` (one per key channel), b_i = the sum of g
from the chunk start to token i (``[C, K]``), to_end[j] = the sum of g after token j to
the chunk end, gamma = the chunk's total (``[K]``), T = (I + A)^{-1} the UT transform of
:mod:`pallas_kernels.kda.pairs` (``zeco_jax.ops.kda.chunked`` is the spec):

  w   = T diag(beta) (e^{b} * k),   u = T diag(beta) v                (the WY factors)
  kd  = e^{to_end} * k      (the keys as the state at the chunk end sees them, per channel)

  entered with state h:  v_new = u - w h,   h' = Diag(e^{gamma}) h + kd^T v_new,
                         o = scale ((e^{b} * q) h + P v_new)

Kernels: :func:`wu` (w, u, kd and ``eg = e^{gamma}`` per chunk; in the backward also
``qb = scale e^{b} * q``), :func:`output`; the backward's :func:`vnew` (v_new and the
local part of its cotangent, ``scale P^T do``), :func:`dqk` (dq, dk, dg through the
state terms, dw, and the cotangent of P), :func:`dwy` (through w, u and T: dk, dv, dbeta,
dg, and the cotangent of A). Each loops over K and V tiles so that few float32
accumulators are live.

Exactness: every exponent is a sum of g over exactly the tokens it spans, never the
difference of two cumulative sums and never positive: b is a cumulative sum of the
chunk's g tile (:func:`inclusive`), to_end a sum of the tokens after each one
(:func:`to_end`, one reverse exclusive Triton scan, ``pallas_kernels._scan.rows_sum``, in
the forward's kernels; :func:`after` in the backward's), gamma a column sum. The decay
gradient sums exactly the terms whose span holds each token: b_i's cotangent goes to the
tokens m <= i (:func:`from_here`), to_end's of token j to the tokens m > j
(:func:`before`), gamma's to every token of the chunk. The backward's masked sums are dots
with 0 / 1 matrices on the tensor cores, the float32 operand split into three bfloat16
parts (:func:`pallas_kernels._launch.dot01`): forward + backward 14.94 ms at B1 T16384 H16
K=V=128 on an H200, against 22.69 ms with IEEE float32 dots (CUDA cores), the same
session. As Triton scans (``rows_sum``) they measured slower in ``kda_dqk`` and
``kda_dwy`` at both shapes and in ``kda_dpairs`` at B8 (below, :func:`after`;
``benchmarks/results/kda_h200.md``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._launch import F32, block, call, dot, dot01, fast_exp, iota, tiles
from pallas_kernels._scan import rows_sum

S = 16                       # rows of a sub-chunk (the pairwise decays, the UT inverse)


# --- masked sums along a tile's rows (token axis) -------------------------------------------

def _tri(n, keep):
  r, c = iota((n, n), 0), iota((n, n), 1)
  return jnp.where(keep(r, c), 1.0, 0.0).astype(F32)


def inclusive(x):
  """``out[i] = sum_{m <= i} x[m]`` of a ``[n, D]`` tile (a cumulative sum; Triton's scan
  measured faster here than :func:`dot01` with a lower triangle)."""
  return jnp.cumsum(x, axis=0)


def to_end(x):
  """``out[i] = sum_{m > i} x[m]`` of a ``[n, D]`` tile (0 on the last row) as one reverse
  exclusive Triton scan (:func:`pallas_kernels._scan.rows_sum`): to_end in ``kda_wu`` and
  the sub-chunk columns' after in ``kda_intra``. On an H100 (2026-12-07, one process, H16
  K=V=128) the op's forward took 1.193 / 2.052 ms at B1 T16384 / B8 T4096 with it, against
  1.250 / 2.156 with the forms before it: ``kda_wu`` scanned the tile loaded last token
  first (a second load of g and of k, kd stored in that order) and ``kda_intra`` took an
  IEEE float32 dot with a 0 / 1 triangle (``kda_intra`` 0.532 -> 0.440 ms at B8,
  ``kda_wu`` 0.465 -> 0.455)."""
  return rows_sum(x, reverse=True, exclusive=True)


def after(x):
  """``out[i] = sum_{m > i} x[m]`` of a ``[n, D]`` tile (0 on the last row), as
  :func:`pallas_kernels._launch.dot01` with a 0 / 1 triangle: the backward's form. As
  Triton scans (:func:`to_end` here, and :func:`from_here` and :func:`before` likewise),
  on an H100 (2026-12-07, one process, the forward on its scans in every row) the op's
  forward + backward took, at B1 T16384 / B8 T4096 H16 K=V=128: 5.772 / 10.215 ms with the
  backward on these dots; 5.788 / 10.267 with scans in ``kda_dqk``; 5.785 / 10.229 in
  ``kda_dwy``; 5.716 / 10.447 in ``kda_dpairs``; 5.747 / 10.513 in all three."""
  return dot01(_tri(x.shape[0], lambda r, c: c > r), x)


def from_here(x):
  """``out[i] = sum_{m >= i} x[m]`` of a ``[n, D]`` tile (:func:`after`'s form)."""
  return dot01(_tri(x.shape[0], lambda r, c: c >= r), x)


def before(x):
  """``out[i] = sum_{m < i} x[m]`` of a ``[n, D]`` tile (0 on the first row;
  :func:`after`'s form)."""
  return dot01(_tri(x.shape[0], lambda r, c: c < r), x)


# --- forward ------------------------------------------------------------------------------

def _wu_kernel(t_ref, k_ref, v_ref, g_ref, beta_ref, *refs, C, K, V, BD, dt, scale):
  if scale is None:
    w_ref, u_ref, kd_ref, eg_ref = refs
  else:
    q_ref, w_ref, u_ref, kd_ref, eg_ref, qb_ref = refs
  b, hd, n = (pl.program_id(i) for i in range(3))
  t = pl.ds(n * C, C)
  Tm = t_ref[b, t, hd, :]
  beta = beta_ref[b, t, hd].astype(F32)
  w_of = lambda k, eb: dot(Tm, beta[:, None] * eb * k, dt).astype(w_ref.dtype)
  kd_of = lambda k, g: (fast_exp(to_end(g)) * k).astype(kd_ref.dtype)
  eg_of = lambda g: fast_exp(jnp.sum(g, axis=0))
  for ks in tiles(K, BD):
    g = g_ref[b, t, hd, ks].astype(F32)
    if scale is None:                                   # the forward: w first
      eb = fast_exp(inclusive(g))
      k = k_ref[b, t, hd, ks].astype(F32)
      w_ref[b, t, hd, ks] = w_of(k, eb)
      kd_ref[b, t, hd, ks] = kd_of(k, g)
      eg_ref[b, hd, n, ks] = eg_of(g)
    else:                                               # the backward's: e^{gamma}, kd first
      eg_ref[b, hd, n, ks] = eg_of(g)
      k = k_ref[b, t, hd, ks].astype(F32)
      kd_ref[b, t, hd, ks] = kd_of(k, g)
      eb = fast_exp(inclusive(g))
      w_ref[b, t, hd, ks] = w_of(k, eb)
      qb_ref[b, t, hd, ks] = (scale * eb * q_ref[b, t, hd, ks].astype(F32)).astype(
          qb_ref.dtype)
  for vs in tiles(V, BD):
    u_ref[b, t, hd, vs] = dot(Tm, beta[:, None] * v_ref[b, t, hd, vs].astype(F32),
                              dt).astype(u_ref.dtype)


def wu(Tinv, k, v, g, beta, *, chunk_size, config, q=None, scale=None):
  """(w [B, T, H, K], u [B, T, H, V], kd [B, T, H, K] in k's dtype, eg = e^{gamma}
  float32 [B, H, N, K]) from the inverse T (:func:`pallas_kernels.kda.pairs.intra`).
  g float32 ``[B, T, H, K]``, beta float32 ``[B, T, H]``. With q and scale (the
  backward) also ``qb = scale e^{b} * q`` in q's dtype. g and k are loaded once per K
  tile (kd from :func:`to_end`'s scan of the loaded g). Each output is stored as soon as
  it is formed: in the forward w first; in the backward's copy e^{gamma} and kd first, then
  w and qb, which spills nothing on sm_90 where w first spilled 360 bytes, and measured
  faster on an H100, the op's forward + backward 5.774 -> 5.732 ms at B1 T16384 H16
  K=V=128 and 10.246 -> 10.135 at B8 T4096. The forward's copy in that order measured
  slower (1.193 -> 1.210 and 2.053 -> 2.091 ms), though it too stops spilling. In the form
  before :func:`to_end` (g and k loaded a second time, last token first), every load issued
  before the first store measured slower on an H100, the op's forward 2.378 against 2.160
  ms at B8 T4096 H16 K=V=128, and so did the tiles as loops pipelined over 3 stages (FLA's
  launch of this work): 2.320 / 2.201 ms with tiles of 64 / 32, against 2.155
  (``benchmarks/results/kda_h200.md``)."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  N = T // chunk_size
  kern = functools.partial(_wu_kernel, C=chunk_size, K=K, V=V, BD=config.wu.bv, dt=k.dtype,
                           scale=None if q is None else scale)
  kshape = jax.ShapeDtypeStruct((B, T, H, K), k.dtype)
  out = (kshape, jax.ShapeDtypeStruct((B, T, H, V), k.dtype), kshape,
         jax.ShapeDtypeStruct((B, H, N, K), F32)) + ((kshape,) if q is not None else ())
  args = (Tinv, k, v, g, beta) + ((q,) if q is not None else ())
  return call(kern, out, (B, H, N), config=config, num_warps=config.wu.warps,
              num_stages=config.wu.stages, name="kda_wu")(*args)


def _out_kernel(q_ref, g_ref, p_ref, vn_ref, h_ref, o_ref, *, C, K, BK, BV, dt, scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  t, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  o = dot(p_ref[b, t, hd, :], vn_ref[b, t, hd, vs], dt)
  for ks in tiles(K, BK):
    qe = q_ref[b, t, hd, ks].astype(F32) * fast_exp(inclusive(g_ref[b, t, hd, ks].astype(F32)))
    o = o + dot(qe, h_ref[b, hd, n, ks, vs], dt)
  o_ref[b, t, hd, vs] = (scale * o).astype(o_ref.dtype)


def output(q, g, P, vn, h, *, scale, chunk_size, config):
  """o [B, T, H, V] in v_new's dtype, from the states entering each chunk and the
  intra-chunk scores P (``[B, T, H, C]``, :func:`pallas_kernels.kda.pairs.intra`).

  ``e^{b} q`` is formed here from q and g. Reading ``qb = scale e^{b} q`` written by
  :func:`wu` instead (as the backward has it) measured neutral at B1 T16384 and slower at
  B8 T4096 (H16 K=V=128, H100, 2026-12-06 and again 2026-12-07: the op's forward 2.301 /
  2.303 against 2.283 / 2.276 ms, ``benchmarks/results/kda_h200.md``): at V = 128 this
  kernel forms it once per chunk, and ``kda_wu`` pays the bytes the output saves."""
  B, T, H, K = q.shape
  V = vn.shape[-1]
  BV = block(V, config.out.bv)
  kern = functools.partial(_out_kernel, C=chunk_size, K=K, BK=config.out.bk, BV=BV,
                           dt=q.dtype, scale=scale)
  return call(kern, jax.ShapeDtypeStruct(vn.shape, vn.dtype), (B, H, T // chunk_size, V // BV),
              config=config, num_warps=config.out.warps, num_stages=config.out.stages,
              name="kda_output")(q, g, P, vn, h)


# --- backward -----------------------------------------------------------------------------

def _vnew_kernel(p_ref, w_ref, u_ref, h_ref, do_ref, vn_ref, dvl_ref, *, C, BV, dt, scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  t, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  vn = u_ref[b, t, hd, vs].astype(F32) - dot(w_ref[b, t, hd, :], h_ref[b, hd, n, :, vs], dt)
  vn_ref[b, t, hd, vs] = vn.astype(vn_ref.dtype)
  dvl_ref[b, t, hd, vs] = scale * dot(p_ref[b, t, hd, :], do_ref[b, t, hd, vs], dt, ta=True)


def vnew(P, w, u, h, do, *, scale, chunk_size, config):
  """(v_new [B, T, H, V] in u's dtype, recomputed from the kept states; the local part of
  its cotangent ``scale P^T do`` float32)."""
  B, T, H, V = u.shape
  BV = block(V, config.vnew.bv)
  kern = functools.partial(_vnew_kernel, C=chunk_size, BV=BV, dt=w.dtype, scale=scale)
  out = (jax.ShapeDtypeStruct(u.shape, u.dtype), jax.ShapeDtypeStruct(u.shape, F32))
  return call(kern, out, (B, H, T // chunk_size, V // BV), config=config,
              num_warps=config.vnew.warps, num_stages=config.vnew.stages,
              name="kda_vnew")(P, w, u, h, do)


def _dqk_kernel(q_ref, k_ref, g_ref, vn_ref, dvn_ref, do_ref, h_ref, dh_ref, dq_ref, dk_ref,
                dw_ref, dg_ref, dp_ref, *, C, K, V, KS, BK, BV, dt, scale):
  b, hd, f = (pl.program_id(i) for i in range(3))
  NKS = K // KS                        # programs per chunk, each a K slice of KS channels
  n, kk = f // NKS, f % NKS
  t = pl.ds(n * C, C)
  bk = block(KS, BK)
  ktiles = [pl.ds(kk * KS + i * bk, bk) for i in range(KS // bk)]
  vtiles = tiles(V, BV)
  r, c = iota((C, C), 0), iota((C, C), 1)

  @pl.when(kk == 0)
  def _():
    dP = jnp.zeros((C, C), F32)
    for vs in vtiles:
      dP = dP + dot(do_ref[b, t, hd, vs], vn_ref[b, t, hd, vs], dt, tb=True)
    dp_ref[b, t, hd, :] = jnp.where(r >= c, scale * dP, 0.0)      # the cotangent of P

  for ks in ktiles:
    dqs = jnp.zeros((C, bk), F32)      # do h^T
    dkd = jnp.zeros((C, bk), F32)      # v_new dh'^T
    dwa = jnp.zeros((C, bk), F32)      # dv_new h^T
    dgam = jnp.zeros((bk,), F32)       # sum_v h dh'
    for vs in vtiles:
      do, vn, dvn = do_ref[b, t, hd, vs], vn_ref[b, t, hd, vs], dvn_ref[b, t, hd, vs]
      h, dh = h_ref[b, hd, n, ks, vs], dh_ref[b, hd, n, ks, vs]
      dqs = dqs + dot(do, h, dt, tb=True)
      dkd = dkd + dot(vn, dh, dt, tb=True)
      dwa = dwa + dot(dvn, h, dt, tb=True)
      dgam = dgam + jnp.sum(h.astype(F32) * dh.astype(F32), axis=1)
    g = g_ref[b, t, hd, ks].astype(F32)
    dq = (scale * fast_exp(inclusive(g))) * dqs
    dk = fast_exp(after(g)) * dkd
    dq_ref[b, t, hd, ks] = dq
    dk_ref[b, t, hd, ks] = dk
    dw_ref[b, t, hd, ks] = (-dwa).astype(dw_ref.dtype)
    # b_i's cotangent q_i dq_i reaches the tokens m <= i; to_end_j's the tokens m > j;
    # gamma's (e^{gamma} sum_v h dh') every token of the chunk.
    dg_ref[b, t, hd, ks] = (from_here(q_ref[b, t, hd, ks].astype(F32) * dq)
                            + before(k_ref[b, t, hd, ks].astype(F32) * dk)
                            + (fast_exp(jnp.sum(g, axis=0)) * dgam)[None, :])


def dqk(q, k, g, vn, dvn, do, h, dh, *, scale, chunk_size, config):
  """(dq, dk through the output's state term and kd, float32 [B, T, H, K]; dw [B, T, H, K]
  in q's dtype, :func:`dwy`'s dot operand; dg's part float32 [B, T, H, K]; dP =
  incl_lower(scale do v_new^T), the cotangent of P, float32 [B, T, H, C]). A program per
  chunk and K slice of ``config.dqk.kd`` channels (the first also forms dP), in K and V
  tiles of ``config.dqk.bv``."""
  B, T, H, K = q.shape
  V = vn.shape[-1]
  KS = block(K, config.dqk.kd)
  kern = functools.partial(_dqk_kernel, C=chunk_size, K=K, V=V, KS=KS, BK=config.dqk.bv,
                           BV=config.dqk.bv, dt=q.dtype, scale=scale)
  f32k = jax.ShapeDtypeStruct((B, T, H, K), F32)
  out = (f32k, f32k, jax.ShapeDtypeStruct((B, T, H, K), q.dtype), f32k,
         jax.ShapeDtypeStruct((B, T, H, chunk_size), F32))
  return call(kern, out, (B, H, (T // chunk_size) * (K // KS)), config=config,
              num_warps=config.dqk.warps, num_stages=config.dqk.stages,
              name="kda_dqk")(q, k, g, vn, dvn, do, h, dh)


def _dwy_kernel(t_ref, k_ref, v_ref, g_ref, beta_ref, dw_ref, du_ref, dk_in_ref, dg_in_ref,
                dk_ref, dv_ref, dbeta_ref, dg_ref, da_ref, *, C, K, V, BD, dt):
  """w = T rw, u = T ru (rw = beta e^{b} * k, ru = beta v), T = (I + A)^{-1}: drw = T^T dw,
  dru = T^T du, dT = dw rw^T + du ru^T, dA = strict_lower(-T^T dT T^T). dk and dg are
  written with ``dk_in`` and ``dg_in`` (the parts :func:`dqk` formed) added."""
  b, hd, n = (pl.program_id(i) for i in range(3))
  t = pl.ds(n * C, C)
  Tm = t_ref[b, t, hd, :]
  beta = beta_ref[b, t, hd].astype(F32)
  ktiles, vtiles = tiles(K, BD), tiles(V, BD)
  r, c = iota((C, C), 0), iota((C, C), 1)
  dT = jnp.zeros((C, C), F32)
  for ks in ktiles:
    eb = fast_exp(inclusive(g_ref[b, t, hd, ks].astype(F32)))
    rw = beta[:, None] * eb * k_ref[b, t, hd, ks].astype(F32)
    dT = dT + dot(dw_ref[b, t, hd, ks], rw, dt, tb=True)
  for vs in vtiles:
    dT = dT + dot(du_ref[b, t, hd, vs], beta[:, None] * v_ref[b, t, hd, vs].astype(F32), dt,
                  tb=True)
  dT = jnp.where(r >= c, dT, 0.0)
  dA = -dot(dot(Tm, dT, dt, ta=True), Tm, dt, tb=True)
  da_ref[b, t, hd, :] = jnp.where(r > c, dA, 0.0)
  dbeta = jnp.zeros((C,), F32)
  for ks in ktiles:
    eb = fast_exp(inclusive(g_ref[b, t, hd, ks].astype(F32)))
    k = k_ref[b, t, hd, ks].astype(F32)
    drw = dot(Tm, dw_ref[b, t, hd, ks], dt, ta=True)
    dk_ref[b, t, hd, ks] = dk_in_ref[b, t, hd, ks] + (beta[:, None] * eb) * drw
    ekd = eb * k * drw                        # the cotangent of beta e^{b} * k, times k
    dbeta = dbeta + jnp.sum(ekd, axis=1)
    # b_i's: the tokens m <= i
    dg_ref[b, t, hd, ks] = dg_in_ref[b, t, hd, ks] + from_here(beta[:, None] * ekd)
  for vs in vtiles:
    dru = dot(Tm, du_ref[b, t, hd, vs], dt, ta=True)
    dv_ref[b, t, hd, vs] = (beta[:, None] * dru).astype(dv_ref.dtype)
    dbeta = dbeta + jnp.sum(v_ref[b, t, hd, vs].astype(F32) * dru, axis=1)
  dbeta_ref[b, t, hd] = dbeta


def dwy(Tinv, k, v, g, beta, dw, du, dk_in, dg_in, *, chunk_size, config):
  """(dk float32: ``dk_in`` plus the part through w; dv in v's dtype; dbeta's part; dg
  float32: ``dg_in`` plus the part through w; dA float32 [B, T, H, C], the cotangent of A,
  strictly lower per chunk): the backward of the WY factors from the cotangents of w and u
  (v_new's), adding the parts of dk and dg formed before (:func:`dqk`'s) in the kernel
  instead of in an XLA pass."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  kern = functools.partial(_dwy_kernel, C=chunk_size, K=K, V=V, BD=config.dwy.bv, dt=k.dtype)
  out = (jax.ShapeDtypeStruct((B, T, H, K), F32), jax.ShapeDtypeStruct((B, T, H, V), v.dtype),
         jax.ShapeDtypeStruct((B, T, H), F32), jax.ShapeDtypeStruct((B, T, H, K), F32),
         jax.ShapeDtypeStruct((B, T, H, chunk_size), F32))
  return call(kern, out, (B, H, T // chunk_size), config=config, num_warps=config.dwy.warps,
              num_stages=config.dwy.stages, name="kda_dwy", aliases={7: 0, 8: 3})(
                  Tinv, k, v, g, beta, dw, du, dk_in, dg_in)
