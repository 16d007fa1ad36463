"""Mosaic TPU kernels of Gated DeltaNet (``pltpu``): forward and backward.

Status: compiled ahead of time by libtpu for v5e / v5p / v6e and checked in the Pallas
interpreter against the jnp chunked form; **never run on TPU hardware** (no TPU is lent).

Same contract as :mod:`pallas_kernels.gated_delta.gpu` (``fwd``, ``fwd_res``, ``bwd``,
``bwd_res``); of ``config`` only ``interpret`` and ``states_in_input_dtype`` are read.
The maths per chunk is :mod:`pallas_kernels.gated_delta.chunk`'s (A, the UT inverse
T = (I + A)^{-1}, w, u, kd, v_new, the state update, the output, their backward).

TPU-shaped (as :mod:`pallas_kernels.gla.tpu`): q, k, v, do go head-major ``[B*H, T, D]``
(one XLA transpose) so every block is a dense ``[C, D]`` VMEM tile; g and beta go
lane-dense, one row of C per chunk (``[B*H, N8, C]``, blocks of 8 chunks, N padded to a
multiple of 8). Grid ``(B*H, N)``, the chunk axis sequential ("arbitrary"), the ``K x V``
state in a float32 VMEM scratch:

  forward  (one kernel, :func:`_fwd_kernel`): per chunk the decays, A, T, w, u,
           v_new = u - w h, o, h <- e^{gamma} h + kd^T v_new; optionally each h[n].
  backward (:func:`_bwd_kernel`, chunks in reverse): the chunk's T, w, u, v_new
           recomputed from h[n] (the residual, or a forward run that emits them), the
           state gradient in scratch, every gradient of the chunk.

Nothing per token is kept between kernels: the residual is the chunk states h
``[B, H, N, K, V]`` (input dtype with ``states_in_input_dtype``, else float32). dq, dk, dv
leave in the inputs' dtypes. Each pallas_call declares its matmul FLOPs
(``pl.CostEstimate``) for XLA's cost analysis.

Exactness (Mosaic has no cumsum; every op 2-D): every decay exponent is a sum of g over
exactly the tokens it spans, never a difference of cumulative sums, never positive. The
segment sums ``seg[i, j] = sum_{j < m <= i} g_m`` are a float32 triangular matmul
(precision HIGHEST) of the masked tile ``g_m [m > j]``; b, to_end and gamma are masked
reductions of the chunk's g row. The decay gradient collects, per token m, exactly the
terms whose span holds m (masked reductions and one triangular matmul). The UT inverse is
float32: forward substitution on the 16 x 16 diagonal blocks (all blocks at once, 15 row
steps), then blocks merged pairwise, ``X_21 = -X_22 A_21 X_11``, up to the chunk.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _delta
from pallas_kernels._delta_tpu import (ROWS, S, Kernels, exact, pick, put, to_col, to_row,
                                       ut_inverse)
from pallas_kernels._launch import F32, dot, iota, masked_exp
from pallas_kernels.gated_delta.gpu import check_dims

Residual = _delta.Residual


class _Chunk:
  """One chunk's decays and write strengths, from its g and beta rows ``[1, C]``.

  ``seg[i, j]`` = g summed over (j, i] (0 where i <= j); ``b`` ``[C, 1]`` over
  [chunk start, i]; ``to_end`` ``[C, 1]`` over (i, chunk end]; ``gamma`` ``[1, 1]`` the
  chunk's total; ``strict`` / ``incl`` = e^{seg} on the strictly / inclusively lower
  triangle (0 elsewhere); ``beta`` ``[C, 1]``.
  """

  def __init__(self, g, beta):
    C = g.shape[1]
    self.C = C
    self.r, self.c = iota((C, C), 0), iota((C, C), 1)
    r, c = self.r, self.c
    self.seg = exact((c <= r).astype(F32), jnp.where(r > c, to_col(g), 0.0))
    self.b = jnp.sum(jnp.where(c <= r, g, 0.0), axis=1, keepdims=True)
    self.to_end = jnp.sum(jnp.where(c > r, g, 0.0), axis=1, keepdims=True)
    self.gamma = jnp.sum(g, axis=1, keepdims=True)
    self.strict = masked_exp(r > c, self.seg)
    self.incl = masked_exp(r >= c, self.seg)
    self.beta = to_col(beta)


def _wy(ch, k, v, dt):
  """(T, w, u, rw = beta e^b k, ru = beta v, k k^T) of a chunk, float32."""
  kk = dot(k, k, dt, tb=True)
  X = ut_inverse(ch.beta * ch.strict * kk)
  rw = (ch.beta * jnp.exp(ch.b)) * k.astype(F32)
  ru = ch.beta * v.astype(F32)
  return X, dot(X, rw, dt), dot(X, ru, dt), rw, ru, kk


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, ht_ref, *rest, scale, dt,
                N):
  state = rest[-1]
  h_ref = rest[0] if len(rest) == 2 else None
  n = pl.program_id(1)

  @pl.when(n == 0)
  def _():
    state[...] = h0_ref[...]

  ch = _Chunk(pick(g_ref, n % ROWS), pick(beta_ref, n % ROWS))
  q, k = q_ref[...], k_ref[...]
  _, w, u, _, _, _ = _wy(ch, k, v_ref[...], dt)
  h = state[...]
  if h_ref is not None:
    h_ref[...] = h.astype(h_ref.dtype)
  vn = u - dot(w, h, dt)
  P = ch.incl * dot(q, k, dt, tb=True)
  o = dot(q.astype(F32) * jnp.exp(ch.b), h, dt) + dot(P, vn, dt)
  o_ref[...] = (scale * o).astype(o_ref.dtype)
  h = jnp.exp(ch.gamma) * h + dot(k.astype(F32) * jnp.exp(ch.to_end), vn, dt, ta=True)
  state[...] = h

  @pl.when(n == N - 1)
  def _():
    ht_ref[...] = h


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, h_ref, dht_ref, dq_ref, dk_ref,
                dv_ref, dg_ref, dbeta_ref, dh0_ref, dstate, *, scale, dt, N):
  n = pl.program_id(1)                     # walks chunks N-1 .. 0 (see the index maps)
  j = (N - 1 - n) % ROWS

  @pl.when(n == 0)
  def _():
    dstate[...] = dht_ref[...]

  ch = _Chunk(pick(g_ref, j), pick(beta_ref, j))
  r, c = ch.r, ch.c
  q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
  qf, kf = q.astype(F32), k.astype(F32)
  h = h_ref[...].astype(F32)
  dH = dstate[...]                         # cotangent of the state leaving this chunk
  X, w, u, rw, ru, kk = _wy(ch, k, v, dt)
  eb, ek, eg = jnp.exp(ch.b), jnp.exp(ch.to_end), jnp.exp(ch.gamma)
  vn = u - dot(w, h, dt)
  qk = dot(q, k, dt, tb=True)
  P = ch.incl * qk
  # Through the output and the state update.
  dvn = scale * dot(P, do, dt, ta=True) + dot(kf * ek, dH, dt)
  dS = scale * dot(do, vn, dt, tb=True) * ch.incl           # cotangent of q k^T
  dqb = scale * dot(do, h, dt, tb=True)                     # cotangent of e^b q
  dkd = dot(vn, dH, dt, tb=True)                            # cotangent of kd
  dq = eb * dqb + dot(dS, k, dt)
  dk = dot(dS, q, dt, ta=True) + ek * dkd
  db = eb * jnp.sum(qf * dqb, axis=1, keepdims=True)        # [C, 1] per b_i
  dto_end = ek * jnp.sum(kf * dkd, axis=1, keepdims=True)   # [C, 1] per to_end_j
  dgamma = eg * jnp.sum(jnp.sum(h * dH, axis=1, keepdims=True), axis=0, keepdims=True)
  dseg = dS * qk
  # Through w = T rw, u = T ru, T = (I + A)^{-1}: dA = strict(-T^T dT T^T), dT lower.
  dw = -dot(dvn, h, dt, tb=True)
  dT = jnp.where(r >= c, dot(dw, rw, dt, tb=True) + dot(dvn, ru, dt, tb=True), 0.0)
  dA = jnp.where(r > c, -dot(dot(X, dT, dt, ta=True), X, dt, tb=True), 0.0)
  dkk = ch.beta * dA * ch.strict                             # cotangent of k k^T
  dbeta = jnp.sum(dA * ch.strict * kk, axis=1, keepdims=True)
  dseg = dseg + dkk * kk
  drw = dot(X, dw, dt, ta=True)
  dru = dot(X, dvn, dt, ta=True)
  dk = dk + (ch.beta * eb) * drw + dot(dkk, k, dt) + dot(dkk, k, dt, ta=True)
  t_k = jnp.sum(kf * drw, axis=1, keepdims=True)
  dbeta = dbeta + jnp.sum(v.astype(F32) * dru, axis=1, keepdims=True) + eb * t_k
  db = db + ch.beta * eb * t_k
  # dg_m: b_i spans [0, i] (i >= m), to_end_j spans (j, C) (j < m), seg[i, j] spans
  # (j, i] (i >= m > j), gamma every token.
  per_token = jnp.where(r >= c, db, 0.0) + jnp.where(r < c, dto_end, 0.0)
  seg_part = jnp.where(r >= c, exact(dseg, (r < c).astype(F32)), 0.0)
  dg = jnp.sum(per_token + seg_part, axis=0, keepdims=True) + dgamma
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = (ch.beta * dru).astype(dv_ref.dtype)
  put(dg_ref, j, dg)
  put(dbeta_ref, j, to_row(dbeta))
  new = eg * dH + scale * dot(qf * eb, do, dt, ta=True) - dot(w, dvn, dt, ta=True)
  dstate[...] = new

  @pl.when(n == N - 1)
  def _():
    dh0_ref[...] = new


# --- launch -------------------------------------------------------------------------------

def _chunk_flops(C, K, V, backward):
  """Matmul FLOPs of one chunk (float32 products of the UT inverse and the segment sums
  counted once)."""
  levels = (C // S).bit_length() - 1
  exact = 2 * C ** 3 * (S - 1 + 2 * levels + 1)
  if not backward:
    return 2 * (C * C * (3 * K + 2 * V) + 3 * C * K * V) + exact
  return 2 * (C * C * (9 * K + 5 * V) + 7 * C * K * V + 3 * C ** 3) + exact


def _transcendentals(C, K, V, backward):
  return 2 * C * C + 3 * C


_KERNELS = Kernels(prefix="gdn", fwd_kernel=_fwd_kernel, bwd_kernel=_bwd_kernel,
                   g_per_key=False, check_dims=check_dims, flops=_chunk_flops,
                   transcendentals=_transcendentals)
fwd_res, fwd = _KERNELS.fwd_res, _KERNELS.fwd
bwd_res, bwd = _KERNELS.bwd_res, _KERNELS.bwd
