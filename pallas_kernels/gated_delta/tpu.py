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

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _delta
from pallas_kernels._config import state_store_dtype
from pallas_kernels._launch import (F32, HI, dot, from_head_major, head_major, iota, masked_exp,
                                    with_varying)
from pallas_kernels.gated_delta.gpu import check_dims

S = 16                       # rows of a diagonal block of the UT inverse
ROWS = 8                     # chunks per block of the g / beta rows (a sublane tile)


Residual = _delta.Residual


def _exact(a, b):
  """float32 a @ b at HIGHEST: segment sums and the UT inverse."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HI,
                         preferred_element_type=F32)


def _to_col(row):
  """``[1, C]`` -> ``[C, 1]`` (a masked reduction, exact)."""
  C = row.shape[1]
  return jnp.sum(jnp.where(iota((C, C), 0) == iota((C, C), 1), row, 0.0), axis=1,
                 keepdims=True)


def _to_row(col):
  """``[C, 1]`` -> ``[1, C]``."""
  C = col.shape[0]
  return jnp.sum(jnp.where(iota((C, C), 0) == iota((C, C), 1), col, 0.0), axis=0,
                 keepdims=True)


def _pick(ref, j):
  """Row j (traced) of an ``[ROWS, C]`` block: ``[1, C]`` float32."""
  x = ref[...].astype(F32)
  return jnp.sum(jnp.where(iota(x.shape, 0) == j, x, 0.0), axis=0, keepdims=True)


def _put(ref, j, row):
  """Row j (traced) of an ``[ROWS, C]`` output block := row."""
  ref[...] = jnp.where(iota(ref.shape, 0) == j, row, ref[...])


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
    self.seg = _exact((c <= r).astype(F32), jnp.where(r > c, _to_col(g), 0.0))
    self.b = jnp.sum(jnp.where(c <= r, g, 0.0), axis=1, keepdims=True)
    self.to_end = jnp.sum(jnp.where(c > r, g, 0.0), axis=1, keepdims=True)
    self.gamma = jnp.sum(g, axis=1, keepdims=True)
    self.strict = masked_exp(r > c, self.seg)
    self.incl = masked_exp(r >= c, self.seg)
    self.beta = _to_col(beta)


def _ut_inverse(A):
  """``(I + A)^{-1}`` of a strictly lower ``[C, C]`` float32 A (C a power of two >= 16).

  The 16 x 16 diagonal blocks by forward substitution (row step s fills row s of every
  block from the rows above it), then neighbouring blocks merged,
  ``[[X11, 0], [A21, X22]]^{-1} = [[X11, 0], [-X22 A21 X11, X22]]``, as one full-chunk
  product per level on the blocks' lower-left quadrants.
  """
  C = A.shape[0]
  r, c = iota((C, C), 0), iota((C, C), 1)
  eye = (r == c).astype(F32)
  diag = jnp.where(r // S == c // S, A, 0.0)
  off = r % S
  X = eye
  for s in range(1, S):
    X = jnp.where(off == s, eye - _exact(diag, X), X)
  size = S
  while size < C:
    lower_left = (r // (2 * size) == c // (2 * size)) & (r // size != c // size)
    X = X - _exact(X, _exact(jnp.where(lower_left, A, 0.0), X))
    size *= 2
  return X


def _wy(ch, k, v, dt):
  """(T, w, u, rw = beta e^b k, ru = beta v, k k^T) of a chunk, float32."""
  kk = dot(k, k, dt, tb=True)
  X = _ut_inverse(ch.beta * ch.strict * kk)
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

  ch = _Chunk(_pick(g_ref, n % ROWS), _pick(beta_ref, n % ROWS))
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

  ch = _Chunk(_pick(g_ref, j), _pick(beta_ref, j))
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
  seg_part = jnp.where(r >= c, _exact(dseg, (r < c).astype(F32)), 0.0)
  dg = jnp.sum(per_token + seg_part, axis=0, keepdims=True) + dgamma
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = (ch.beta * dru).astype(dv_ref.dtype)
  _put(dg_ref, j, dg)
  _put(dbeta_ref, j, _to_row(dbeta))
  new = eg * dH + scale * dot(qf * eb, do, dt, ta=True) - dot(w, dvn, dt, ta=True)
  dstate[...] = new

  @pl.when(n == N - 1)
  def _():
    dh0_ref[...] = new


# --- launch -------------------------------------------------------------------------------

def _chunk_rows(x, C):
  """``[B, T, H]`` -> float32 ``[B*H, N8, C]``: one row per chunk, N padded to ROWS."""
  B, T, H = x.shape
  N = T // C
  x = x.astype(F32).transpose(0, 2, 1).reshape(B * H, N, C)
  return jnp.pad(x, ((0, 0), (0, -N % ROWS), (0, 0)))


def _from_chunk_rows(x, B, H, T):
  C = x.shape[-1]
  return x[:, :T // C].reshape(B, H, T).transpose(0, 2, 1)


def _params(config):
  if config.interpret:
    return None
  return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def _call(kernel, *, out_shape, in_specs, out_specs, grid, scratch, config, name, cost):
  """pallas_call on Mosaic (or the interpreter); inside ``shard_map(check_vma=True)`` the
  inputs are cast to the union of their varying axes and the outputs declared so."""
  fn = functools.partial(pl.pallas_call, kernel, grid=grid, in_specs=in_specs,
                         out_specs=out_specs, scratch_shapes=scratch,
                         compiler_params=_params(config), interpret=config.interpret,
                         name=name, cost_estimate=None if config.interpret else cost)
  return lambda *args: with_varying(fn, out_shape, args)


def _chunk_flops(C, K, V, backward):
  """Matmul FLOPs of one chunk (float32 products of the UT inverse and the segment sums
  counted once)."""
  levels = (C // S).bit_length() - 1
  exact = 2 * C ** 3 * (S - 1 + 2 * levels + 1)
  if not backward:
    return 2 * (C * C * (3 * K + 2 * V) + 3 * C * K * V) + exact
  return 2 * (C * C * (9 * K + 5 * V) + 7 * C * K * V + 3 * C ** 3) + exact


def _cost(BH, N, C, K, V, args, outs, backward):
  nbytes = sum(x.size * x.dtype.itemsize for x in (*args, *jax.tree.leaves(outs)))
  return pl.CostEstimate(flops=int(BH * N * _chunk_flops(C, K, V, backward)),
                         transcendentals=int(BH * N * (2 * C * C + 3 * C)),
                         bytes_accessed=int(nbytes))


def _specs(C, K, V, N, reverse):
  at = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  tile = lambda D: pl.BlockSpec((None, C, D), lambda i, n: (i, at(n), 0))
  rows = pl.BlockSpec((None, ROWS, C), lambda i, n: (i, at(n) // ROWS, 0))
  state = pl.BlockSpec((None, K, V), lambda i, n: (i, 0, 0))
  chunk_state = pl.BlockSpec((None, None, K, V), lambda i, n: (i, at(n), 0, 0))
  return tile, rows, state, chunk_state


def _forward(q, k, v, g, beta, h0, *, scale, C, store, config):
  """Head-major forward: (o [BH, T, V], final [BH, K, V], h [BH, N, K, V] or None)."""
  BH, T, K = q.shape
  V = v.shape[-1]
  N = T // C
  tile, rows, state, chunk_state = _specs(C, K, V, N, reverse=False)
  out_shape = [jax.ShapeDtypeStruct((BH, T, V), v.dtype), jax.ShapeDtypeStruct((BH, K, V), F32)]
  out_specs = [tile(V), state]
  if store is not None:
    out_shape.append(jax.ShapeDtypeStruct((BH, N, K, V), store))
    out_specs.append(chunk_state)
  args = (q, k, v, g, beta, h0)
  outs = _call(functools.partial(_fwd_kernel, scale=scale, dt=q.dtype, N=N),
               out_shape=tuple(out_shape), in_specs=[tile(K), tile(K), tile(V), rows, rows, state],
               out_specs=tuple(out_specs), grid=(BH, N), scratch=[pltpu.VMEM((K, V), F32)],
               config=config, name="gdn_tpu_fwd",
               cost=_cost(BH, N, C, K, V, args, out_shape, False))(*args)
  return outs[0], outs[1], (outs[2] if store is not None else None)


def _inputs(q, k, v, g, beta, initial_state, C):
  B, T, H, K = q.shape
  V = v.shape[-1]
  return (*map(head_major, (q, k, v)), _chunk_rows(g, C), _chunk_rows(beta, C),
          initial_state.reshape(B * H, K, V).astype(F32))


def fwd_res(q, k, v, g, beta, *, scale, initial_state, chunk_size, config):
  """((o [B, T, H, V] in v's dtype, final_state float32), :class:`Residual`)."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  check_dims(K, V, chunk_size)
  o, final, h = _forward(*_inputs(q, k, v, g, beta, initial_state, chunk_size), scale=scale,
                         C=chunk_size, store=state_store_dtype(config, k.dtype), config=config)
  N = T // chunk_size
  return ((from_head_major(o, B, H), final.reshape(B, H, K, V)),
          Residual(h.reshape(B, H, N, K, V)))


def fwd(q, k, v, g, beta, *, scale, initial_state, chunk_size, config):
  """(o [B, T, H, V] in v's dtype, final_state float32); keeps no chunk states."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  check_dims(K, V, chunk_size)
  o, final, _ = _forward(*_inputs(q, k, v, g, beta, initial_state, chunk_size), scale=scale,
                         C=chunk_size, store=None, config=config)
  return from_head_major(o, B, H), final.reshape(B, H, K, V)


def bwd_res(res: Optional[Residual], q, k, v, g, beta, do, dht, *, scale, initial_state,
            chunk_size, config):
  """(dq, dk, dv [B, T, H, D] in q's, k's, v's dtype, dg, dbeta float32 [B, T, H], dh0
  float32); ``res`` is ``fwd_res``'s :class:`Residual`, or None (a forward run emits the
  chunk states)."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  check_dims(K, V, C)
  qh, kh, vh, gr, br, h0 = _inputs(q, k, v, g, beta, initial_state, C)
  if res is None:
    _, _, hs = _forward(qh, kh, vh, gr, br, h0, scale=scale, C=C,
                        store=state_store_dtype(config, k.dtype), config=config)
  else:
    hs = res.h.reshape(B * H, N, K, V)
  doh = head_major(do.astype(v.dtype))
  tile, rows, state, chunk_state = _specs(C, K, V, N, reverse=True)
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  out_shape = (like(qh), like(kh), like(vh), like(gr), like(br), like(h0))
  args = (qh, kh, vh, gr, br, doh, hs, dht.reshape(B * H, K, V).astype(F32))
  dq, dk, dv, dg, dbeta, dh0 = _call(
      functools.partial(_bwd_kernel, scale=scale, dt=q.dtype, N=N), out_shape=out_shape,
      in_specs=[tile(K), tile(K), tile(V), rows, rows, tile(V), chunk_state, state],
      out_specs=(tile(K), tile(K), tile(V), rows, rows, state), grid=(B * H, N),
      scratch=[pltpu.VMEM((K, V), F32)], config=config, name="gdn_tpu_bwd",
      cost=_cost(B * H, N, C, K, V, args, out_shape, True))(*args)
  back = lambda x: from_head_major(x, B, H)
  return (back(dq), back(dk), back(dv), _from_chunk_rows(dg, B, H, T),
          _from_chunk_rows(dbeta, B, H, T), dh0.reshape(B, H, K, V))


def bwd(q, k, v, g, beta, do, dht, *, scale, initial_state, chunk_size, config):
  return bwd_res(None, q, k, v, g, beta, do, dht, scale=scale, initial_state=initial_state,
                 chunk_size=chunk_size, config=config)
