"""Mosaic TPU kernels of Kimi Delta Attention (``pltpu``): forward and backward.

Status: compiled ahead of time by libtpu for v5e / v5p / v6e and checked in the Pallas
interpreter against the jnp chunked form; **never run on TPU hardware** (no TPU is lent).

Same contract as :mod:`pallas_kernels.kda.gpu` (``fwd``, ``fwd_res``, ``bwd``, ``bwd_res``;
g float32 ``[B, T, H, K]``, beta float32 ``[B, T, H]``); of ``config`` only ``interpret``
and ``states_in_input_dtype`` are read. The maths per chunk is
:mod:`pallas_kernels.kda.chunk`'s and :mod:`pallas_kernels.kda.pairs`'s (the per-channel
pairwise matrices A and P, the UT inverse T = (I + A)^{-1}, w, u, kd, v_new, the state
update with a decay per key row, the output, their backward).

TPU-shaped as :mod:`pallas_kernels.gated_delta.tpu` (the launch, layout helpers and UT
inverse both use are :mod:`pallas_kernels._delta_tpu`): q, k, v, g, do go head-major
``[B*H, T, D]`` so every block is a dense ``[C, D]`` VMEM tile; beta goes lane-dense, one
row of C per chunk (``[B*H, N8, C]``). Grid ``(B*H, N)``, the chunk axis sequential
("arbitrary"), the ``K x V`` state in a float32 VMEM scratch:

  forward  (``kda_tpu_fwd``, :func:`_fwd_kernel`): per chunk the decays, A and P, T, w,
           u, v_new = u - w h, o, h <- Diag(e^{gamma}) h + kd^T v_new; optionally h[n].
  backward (``kda_tpu_bwd``, :func:`_bwd_kernel`, chunks in reverse): the chunk's A, P,
           T, w, u, v_new recomputed from h[n] (the residual, or a forward run that emits
           them), the state gradient in scratch, every gradient of the chunk.

Nothing per token is kept between kernels: the residual is the chunk states h
``[B, H, N, K, V]`` (input dtype with ``states_in_input_dtype``, else float32). dq, dk, dv
leave in the inputs' dtypes, dg and dbeta float32. Each pallas_call declares its matmul
FLOPs (``pl.CostEstimate``) for XLA's cost analysis.

Exactness (Mosaic has no cumsum; every op is 2-D, on whole-chunk ``[C, K]`` / ``[C, C]``
tiles with masks): every decay exponent is a sum of g over exactly the tokens it spans,
never a difference of cumulative sums, never positive (:class:`_Decay`, the scheme of
:mod:`pallas_kernels.gla.tpu`): g summed within each 16-token sub-chunk by float32
triangular matmuls at HIGHEST (``p`` from the sub-chunk start, ``s`` to its end), the
sub-chunks' totals added term by term. The pairwise decays ``e^{sum_{j < m <= i} g_m}``
(per channel) come by sub-chunks: rows of sub-chunk I times ``e^{p}`` against columns
before I times ``e^{g over (j, start of I)}`` (each factor <= 1, one matmul per I), and
the 16 x 16 diagonal blocks in log space, one column offset at a time from the last (the
exponent grown by one g per step). The decay gradient sums exactly the terms whose span
holds each token m (:func:`_pair_grads`): through b (the tokens m <= i) and to_end
(m > j) by triangular matmuls, e^{gamma} every token, and the pairs (j < m <= i) by
sub-chunks: the rows of sub-chunk I against earlier columns reach m in I with m <= i (a
within-sub-chunk reverse cumsum of the rows' sums) and the m before I with m > j (a
cumsum of the columns' sums), the diagonal blocks column by column.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _delta
from pallas_kernels._delta_tpu import (ROWS, S, Kernels, exact, pick, put, to_col, to_row,
                                       ut_inverse)
from pallas_kernels._launch import F32, dot, iota, masked_exp
from pallas_kernels.kda.gpu import check_dims

Residual = _delta.Residual


class _Decay:
  """One chunk's log-decays g ``[C, K]`` (float32) as the sub-chunk scheme needs them.

  ``p`` = g over [sub-chunk start, r]; ``s`` = g over (i, sub-chunk end]; ``b`` = g over
  [chunk start, r]; ``to_end`` = g over (i, chunk end]; ``total`` ``[1, K]`` the chunk's;
  ``mid[a]`` (rows before sub-chunk a) = the totals of the whole sub-chunks strictly
  between the row's and a. Each a sum of the tokens it spans (no cancellation).
  """

  def __init__(self, g):
    C, K = g.shape
    self.C, self.K, self.L, self.g = C, K, C // S, g
    r, c = iota((C, C), 0), iota((C, C), 1)
    self.r, self.c = r, c
    same = (r // S) == (c // S)
    self.same = same
    self.p = exact((same & (r >= c)).astype(F32), g)
    self.s = exact((same & (c > r)).astype(F32), g)
    self.exp_p = jnp.exp(self.p)
    self.row = iota((C, K), 0)
    self.sub = self.row // S
    self.off = self.row % S
    zero = jnp.zeros((C, K), F32)
    before, later, total = zero, zero, jnp.zeros((1, K), F32)
    self.mid = []
    for a in range(self.L):
      tot = self.p[a * S + S - 1:a * S + S, :]
      self.mid.append(later)
      later = later + jnp.where(self.row < a * S, tot, 0.0)
      before = before + jnp.where(self.row >= a * S + S, tot, 0.0)
      total = total + tot
    self.b = before + self.p
    self.to_end = self.s + later
    self.total = total

  def q_fac(self, a):
    """``e^{g over [start of a, r]}`` on the rows r of sub-chunk a, 0 elsewhere."""
    return jnp.where(self.sub == a, self.exp_p, 0.0)

  def k_fac(self, a):
    """``e^{g over (i, start of a)}`` on the rows i before sub-chunk a, 0 elsewhere."""
    return masked_exp(self.row < a * S, self.s + self.mid[a])

  def at(self, j):
    """``[C, C]`` bool: row r's column at offset j of its own sub-chunk."""
    return self.c == (self.r // S) * S + j

  def sel(self, x, j):
    """``[C, K]``: on the rows of each sub-chunk, that sub-chunk's row at offset j of x."""
    out = None
    for a in range(self.L):
      row = x[a * S + j:a * S + j + 1, :]
      out = (jnp.broadcast_to(row, x.shape) if out is None
             else jnp.where(self.sub == a, row, out))
    return out

  def col_sums(self, y, j):
    """``[C, K]``: each sub-chunk's column sum of y, at its row of offset j (0 elsewhere)."""
    out = jnp.zeros(y.shape, F32)
    for a in range(self.L):
      total = jnp.sum(jnp.where(self.sub == a, y, 0.0), axis=0, keepdims=True)
      out = jnp.where(self.row == a * S + j, total, out)
    return out


def _pairs(dec, q, k, dt):
  """``(Pq, Pk)`` ``[C, C]`` float32, ``Px[i, j] = sum_d x_id k_jd e^{sum_{j < m <= i}
  g_md}`` for j <= i (0 above): P's and A's pairwise sums (q, k float32 ``[C, K]``)."""
  C = dec.C
  Pq = jnp.zeros((C, C), F32)
  Pk = jnp.zeros((C, C), F32)
  for a in range(1, dec.L):            # rows of sub-chunk a, columns before it
    kc = k * dec.k_fac(a)
    qa = dec.q_fac(a)
    Pq = Pq + dot(q * qa, kc, dt, tb=True)
    Pk = Pk + dot(k * qa, kc, dt, tb=True)
  acc = jnp.zeros((C, dec.K), F32)     # g over (column at offset j, r] on rows off >= j
  for j in reversed(range(S)):
    ke = dec.sel(k, j) * masked_exp(dec.off >= j, acc)
    at = dec.at(j)
    Pq = Pq + jnp.where(at, jnp.sum(q * ke, axis=1, keepdims=True), 0.0)
    Pk = Pk + jnp.where(at, jnp.sum(k * ke, axis=1, keepdims=True), 0.0)
    acc = acc + jnp.where(dec.off >= j, dec.sel(dec.g, j), 0.0)
  return Pq, Pk


def _pair_grads(dec, q, k, dP, dK, dt):
  """``(dq, dk, dg)`` ``[C, K]`` float32 through ``P = Pq`` and ``Kst = Pk`` (strict) of
  :func:`_pairs`, from their cotangents ``dP`` (inclusive lower) and ``dK`` (strict).

  ``dseg[i, j, d] = (dP_ij q_id + dK_ij k_id) k_jd e^{seg_ijd}`` reaches the tokens
  j < m <= i: for the rows of sub-chunk a against the columns before it, the m in a with
  m <= i (a reverse cumsum inside the sub-chunk of the rows' sums) and the m before a
  with m > j (a cumsum of the columns' sums); inside a diagonal block, column offset j
  reaches the rows m > j of its sub-chunk with the sum over r >= m.
  """
  C, K = dec.C, dec.K
  r, c = dec.r, dec.c
  from_here = (dec.same & (c >= r)).astype(F32)     # [m, i]: i >= m, same sub-chunk
  after_col = (c < r).astype(F32)                   # [m, j]: j < m
  dq = jnp.zeros((C, K), F32)
  dk = jnp.zeros((C, K), F32)
  dg = jnp.zeros((C, K), F32)
  row_sums = jnp.zeros((C, K), F32)
  for a in range(1, dec.L):
    qa, ka = dec.q_fac(a), dec.k_fac(a)
    kc, xq, xk = k * ka, q * qa, k * qa
    rp, rk = dot(dP, kc, dt), dot(dK, kc, dt)
    dq = dq + qa * rp
    dk = dk + qa * rk
    row_sums = row_sums + xq * rp + xk * rk
    cs = dot(dP, xq, dt, ta=True) + dot(dK, xk, dt, ta=True)
    dk = dk + ka * cs
    dg = dg + jnp.where(dec.row < a * S, exact(after_col, kc * cs), 0.0)
  dg = dg + exact(from_here, row_sums)
  acc = jnp.zeros((C, K), F32)
  for j in reversed(range(S)):
    e = masked_exp(dec.off >= j, acc)
    ks = dec.sel(k, j)
    at = dec.at(j)
    dp_j = jnp.sum(jnp.where(at, dP, 0.0), axis=1, keepdims=True)    # dP[r, column j]
    dk_j = jnp.sum(jnp.where(at, dK, 0.0), axis=1, keepdims=True)
    ke = ks * e
    dq = dq + dp_j * ke
    dk = dk + dk_j * ke
    y = (dp_j * q + dk_j * k) * e        # column j's terms per row, over k_j
    dk = dk + dec.col_sums(y, j)
    dg = dg + jnp.where(dec.off > j, exact(from_here, y * ks), 0.0)
    acc = acc + jnp.where(dec.off >= j, dec.sel(dec.g, j), 0.0)
  return dq, dk, dg


def _wy(dec, beta, q, k, v, dt):
  """(P, Kst, T, w, u, rw = beta e^b k, ru = beta v, e^b), float32, of one chunk."""
  r, c = dec.r, dec.c
  Pq, Pk = _pairs(dec, q, k, dt)
  P = jnp.where(r >= c, Pq, 0.0)
  Kst = jnp.where(r > c, Pk, 0.0)
  X = ut_inverse(beta * Kst)
  eb = jnp.exp(dec.b)
  rw = beta * eb * k
  ru = beta * v.astype(F32)
  return P, Kst, X, dot(X, rw, dt), dot(X, ru, dt), rw, ru, eb


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, ht_ref, *rest, scale, dt,
                N):
  state = rest[-1]
  h_ref = rest[0] if len(rest) == 2 else None
  n = pl.program_id(1)

  @pl.when(n == 0)
  def _():
    state[...] = h0_ref[...]

  dec = _Decay(g_ref[...].astype(F32))
  beta = to_col(pick(beta_ref, n % ROWS))
  q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
  P, _, _, w, u, _, _, eb = _wy(dec, beta, q, k, v_ref[...], dt)
  h = state[...]
  if h_ref is not None:
    h_ref[...] = h.astype(h_ref.dtype)
  vn = u - dot(w, h, dt)
  o = dot(q * eb, h, dt) + dot(P, vn, dt)
  o_ref[...] = (scale * o).astype(o_ref.dtype)
  h = jnp.exp(dec.total).T * h + dot(k * jnp.exp(dec.to_end), vn, dt, ta=True)
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

  dec = _Decay(g_ref[...].astype(F32))
  r, c = dec.r, dec.c
  beta = to_col(pick(beta_ref, j))
  q, k, v, do = q_ref[...].astype(F32), k_ref[...].astype(F32), v_ref[...], do_ref[...]
  h = h_ref[...].astype(F32)
  dH = dstate[...]                         # cotangent of the state leaving this chunk
  P, Kst, X, w, u, rw, ru, eb = _wy(dec, beta, q, k, v, dt)
  ek = jnp.exp(dec.to_end)
  eg = jnp.exp(dec.total)                  # [1, K]
  vn = u - dot(w, h, dt)
  # Through the output and the state update.
  dvn = scale * dot(P, do, dt, ta=True) + dot(k * ek, dH, dt)
  dP = jnp.where(r >= c, scale * dot(do, vn, dt, tb=True), 0.0)
  dqb = scale * dot(do, h, dt, tb=True)                     # cotangent of e^b * q
  dkd = dot(vn, dH, dt, tb=True)                            # cotangent of e^to_end * k
  dq = eb * dqb
  dk = ek * dkd
  db = q * eb * dqb                                         # per b_i, channel d
  dto_end = k * ek * dkd                                    # per to_end_j
  dgamma = eg * jnp.sum(h * dH, axis=1, keepdims=True).T    # [1, K]
  # Through w = T rw, u = T ru, T = (I + A)^{-1}, A = beta Kst.
  dw = -dot(dvn, h, dt, tb=True)
  dT = jnp.where(r >= c, dot(dw, rw, dt, tb=True) + dot(dvn, ru, dt, tb=True), 0.0)
  dA = jnp.where(r > c, -dot(dot(X, dT, dt, ta=True), X, dt, tb=True), 0.0)
  drw = dot(X, dw, dt, ta=True)
  dru = dot(X, dvn, dt, ta=True)
  t_k = eb * k * drw
  dk = dk + beta * eb * drw
  db = db + beta * t_k
  dbeta = (jnp.sum(dA * Kst, axis=1, keepdims=True) + jnp.sum(t_k, axis=1, keepdims=True)
           + jnp.sum(v.astype(F32) * dru, axis=1, keepdims=True))
  # Through the pairwise sums P and Kst.
  dq2, dk2, dg = _pair_grads(dec, q, k, dP, beta * dA, dt)
  # b_i spans [0, i] (i >= m), to_end_j spans (j, C) (j < m), gamma every token.
  dg = (dg + exact((c >= r).astype(F32), db) + exact((c < r).astype(F32), dto_end)
        + dgamma)
  dq_ref[...] = (dq + dq2).astype(dq_ref.dtype)
  dk_ref[...] = (dk + dk2).astype(dk_ref.dtype)
  dv_ref[...] = (beta * dru).astype(dv_ref.dtype)
  dg_ref[...] = dg
  put(dbeta_ref, j, to_row(dbeta))
  new = (eg.T * dH + scale * dot(q * eb, do, dt, ta=True) - dot(w, dvn, dt, ta=True))
  dstate[...] = new

  @pl.when(n == N - 1)
  def _():
    dh0_ref[...] = new


# --- launch -------------------------------------------------------------------------------

def _chunk_flops(C, K, V, backward):
  """Matmul FLOPs of one chunk: the MXU dots, the float32 exact products (decay sums, the
  UT inverse, the decay gradient's cumsums) counted once."""
  L = C // S
  levels = (C // S).bit_length() - 1
  inverse = 2 * C ** 3 * (S - 1 + 2 * levels)
  decays = 2 * 2 * C * C * K
  pairs = (L - 1) * 2 * 2 * C * C * K
  fwd = pairs + decays + inverse + 2 * C * C * (K + V) + 2 * C * C * V + 3 * 2 * C * K * V
  if not backward:
    return fwd
  grads = (2 * pairs + 2 * C * C * K * (L - 1 + S + 3)          # through A and P; dg sums
           + 2 * C * C * (2 * V + K + V + 2 * C + K + V)        # dvn, dP, dT, dA, drw, dru
           + 2 * C * K * V * 6)                                 # dvn, dqb, dkd, dw, new
  return fwd + grads


def _transcendentals(C, K, V, backward):
  return (S + 4) * C * K * (2 if backward else 1)


_KERNELS = Kernels(prefix="kda", fwd_kernel=_fwd_kernel, bwd_kernel=_bwd_kernel,
                   g_per_key=True, check_dims=check_dims, flops=_chunk_flops,
                   transcendentals=_transcendentals)
fwd_res, fwd = _KERNELS.fwd_res, _KERNELS.fwd
bwd_res, bwd = _KERNELS.bwd_res, _KERNELS.bwd
