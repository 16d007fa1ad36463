"""Mosaic TPU variant of the chunked GLA kernels (``pltpu``): forward and backward.

Status: checked for lowering to Mosaic TPU on CPU (``lowering_platforms=("tpu",)``) and
tested in the Pallas interpreter against the reference; **never run on TPU hardware**
(no TPU is lent). On a TPU target ``backend="auto"`` selects it, as ``backend="pallas"``
does (``pallas_kernels.backend("gla", "tpu")``, by the target's platform).

Same contract as :mod:`zeco_jax.ops.gla.chunked`, plus ``config`` (a
:class:`pallas_kernels.KernelConfig`; only its ``interpret`` is read here). No scalar-decay
path yet: a per-head scalar g is broadcast over K at entry, its gradient summed at exit.

TPU-shaped rather than GPU-shaped: inputs go head-major ``[B*H, T, D]`` (one XLA
transpose) so every block is a dense ``[C, D]`` VMEM tile; the chunk axis is the
sequential ("arbitrary") grid axis and the ``K x V`` state lives in a VMEM scratch, so
the forward is one fused kernel (state, scores and output per chunk) and the backward is
two (state recompute; reverse pass with the state gradient in scratch and every chunk
gradient). Mosaic has no cumsum: chunk-local cumsums are triangular float32 matmuls
(precision HIGHEST). Sub-chunk structure as on GPU: 16-row sub-chunks, reference rows,
exact log-space diagonal blocks, written with full-chunk masks so every op is 2-D. Every
decay exponent is a sum of same-sign log-decays over the interval it spans, never a
difference of chunk cumsums (:class:`_Chunk`): exact to float32 for any mix of per-token
log-decays in [-1e4, 0].
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gla import _common as cm

S = cm.SUB
F32 = jnp.float32


def _exact(a, b):
  """float32 a @ b at HIGHEST (cumsums and one-hot selections: exact up to rounding)."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=cm.HI,
                         preferred_element_type=F32)


def _mexp(mask, x):
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


class _Chunk:
  """Log-decays of one chunk and the masks the sub-chunk scheme needs ([C, K] values).

  No exponent is a difference of two cumulative sums (in float32 ``b_r - b_i`` loses
  ~eps * |b|, 1e-3 once a chunk holds a -1e4 log-decay): each is a sum of same-sign g's
  over the interval it spans (``zeco_jax.ops.gla.chunked._ChunkDecay`` has the same scheme):
  ``p`` g over [sub-chunk start, r], ``s`` g over (i, sub-chunk end] (triangular matmuls
  within each 16-row sub-chunk), the sub-chunk totals ``tots[a]`` ([1, K]), and sums of
  totals accumulated term by term: ``b`` = g over [chunk start, r], ``to_end`` = g over
  (i, chunk end], ``total`` = the chunk's ([1, K]), ``mid[a]`` = per row i of a sub-chunk
  before a, g over the sub-chunks strictly between i's and a. The diagonal blocks add
  the g's of the pair's interval one row offset at a time (see :func:`_scores`).
  """

  def __init__(self, g):
    C, K = g.shape
    self.C, self.K, self.g = C, K, g
    r, c = cm.iota((C, C), 0), cm.iota((C, C), 1)
    same = (r // S) == (c // S)
    self.p = _exact((same & (r >= c)).astype(F32), g)
    self.s = _exact((same & (c > r)).astype(F32), g)
    self.exp_p = jnp.exp(self.p)
    self.row = cm.iota((C, K), 0)
    self.off = self.row % S
    self.rc, self.cc = r, c
    zero = jnp.zeros((C, K), F32)
    before, acc, total = zero, zero, jnp.zeros((1, K), F32)
    self.mid = []
    for a in range(C // S):
      tot = self.p[a * S + S - 1:a * S + S, :]
      self.mid.append(acc)                       # sum over a' < a with i before a' * S
      acc = acc + jnp.where(self.row < a * S, tot, 0.0)
      before = before + jnp.where(self.row >= a * S + S, tot, 0.0)
      total = total + tot
    self.b = before + self.p                     # g over [chunk start, r]
    self.to_end = self.s + acc                   # g over (i, chunk end]
    self.total = total                           # g over the chunk, [1, K]

  def in_sub(self, a):
    return (self.row >= a * S) & (self.row < a * S + S)

  def k_fac(self, a):
    """exp(g over (i, start of sub-chunk a)) for rows i before sub-chunk a, else 0."""
    return _mexp(self.row < a * S, self.s + self.mid[a])

  def q_fac(self, a):
    """exp(g over [start of sub-chunk a, r]) for rows r in sub-chunk a, else 0."""
    return jnp.where(self.in_sub(a), self.exp_p, 0.0)

  def pick(self, j):
    """One-hot [C, C]: row r selects column (r // S) * S + j (same sub-chunk, offset j)."""
    return (self.cc == (self.rc // S) * S + j).astype(F32)


def _scores(ch, q, k, dt):
  """A[r, i] = sum_k q_r k_i exp(b_r - b_i), i <= r: [C, C] float32.

  Diagonal blocks: for column offset j (descending) ``acc`` holds g over
  (j, r] of each row's sub-chunk, grown by one g per step (a sum, never a difference).
  """
  C = ch.C
  A = jnp.zeros((C, C), F32)
  for a in range(1, C // S):
    A = A + cm.dot(q * ch.q_fac(a), k * ch.k_fac(a), dt, tb=True)
  acc = jnp.zeros((C, ch.K), F32)
  for j in reversed(range(S)):
    P = ch.pick(j)
    k_sel, g_sel = _exact(P, k), _exact(P, ch.g)
    val = jnp.sum(q * k_sel * _mexp(ch.off >= j, acc), axis=1, keepdims=True)
    A = A + P * val
    acc = acc + jnp.where(ch.off >= j, g_sel, 0.0)
  return A


def _row_side(ch, dA, k, dt):
  """sum_i dA[r, i] k_i exp(b_r - b_i): [C, K]."""
  C = ch.C
  out = jnp.zeros((C, ch.K), F32)
  for a in range(1, C // S):
    out = out + cm.dot(dA, k * ch.k_fac(a), dt) * ch.q_fac(a)
  acc = jnp.zeros((C, ch.K), F32)
  for j in reversed(range(S)):
    P = ch.pick(j)
    k_sel, g_sel = _exact(P, k), _exact(P, ch.g)
    dA_sel = jnp.sum(dA * P, axis=1, keepdims=True)
    out = out + dA_sel * k_sel * _mexp(ch.off >= j, acc)
    acc = acc + jnp.where(ch.off >= j, g_sel, 0.0)
  return out


def _col_side(ch, dA, q, dt):
  """sum_r dA[r, i] q_r exp(b_r - b_i): [C, K].

  Diagonal blocks: for row offset j (ascending) ``acc`` holds g over (i, j] of each
  column's sub-chunk.
  """
  C = ch.C
  out = jnp.zeros((C, ch.K), F32)
  for a in range(1, C // S):
    out = out + cm.dot(dA, q * ch.q_fac(a), dt, ta=True) * ch.k_fac(a)
  dA_t = dA.T
  acc = jnp.zeros((C, ch.K), F32)
  for j in range(S):
    P = ch.pick(j)
    q_sel, g_sel = _exact(P, q), _exact(P, ch.g)
    acc = acc + jnp.where(ch.off < j, g_sel, 0.0)
    dA_sel = jnp.sum(dA_t * P, axis=1, keepdims=True)
    out = out + dA_sel * q_sel * _mexp(ch.off <= j, acc)
  return out


def _col(x_row):
  """[1, K] -> [K, 1]."""
  return x_row.T


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, h0_ref, o_ref, ht_ref, *h_out, scale, dt, N):
  state, = h_out[-1:]
  h_ref = h_out[0] if len(h_out) == 2 else None
  n = pl.program_id(1)

  @pl.when(n == 0)
  def _():
    state[...] = h0_ref[...]

  q = q_ref[...].astype(F32)
  k = k_ref[...].astype(F32)
  v = v_ref[...]
  ch = _Chunk(g_ref[...])
  h = state[...]
  if h_ref is not None:
    h_ref[...] = h
  A = _scores(ch, q, k, dt)
  o = cm.dot(q * jnp.exp(ch.b), h, dt) + cm.dot(A, v, dt)
  o_ref[...] = (scale * o).astype(o_ref.dtype)
  h = _col(jnp.exp(ch.total)) * h + cm.dot(k * jnp.exp(ch.to_end), v, dt, ta=True)
  state[...] = h

  @pl.when(n == N - 1)
  def _():
    ht_ref[...] = h


def _params(config):
  if config.interpret:
    return None
  return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def _forward(q, k, v, g, h0, *, scale, C, emit_h, config):
  BH, T, K = q.shape
  V = v.shape[-1]
  N = T // C
  tile = lambda D: pl.BlockSpec((None, C, D), lambda i, n: (i, n, 0))
  state_spec = pl.BlockSpec((None, K, V), lambda i, n: (i, 0, 0))
  out_shape = [jax.ShapeDtypeStruct((BH, T, V), v.dtype), jax.ShapeDtypeStruct((BH, K, V), F32)]
  out_specs = [tile(V), state_spec]
  if emit_h:
    out_shape.append(jax.ShapeDtypeStruct((BH, N, K, V), F32))
    out_specs.append(pl.BlockSpec((None, None, K, V), lambda i, n: (i, n, 0, 0)))
  kern = functools.partial(_fwd_kernel, scale=scale, dt=q.dtype, N=N)
  return pl.pallas_call(
      kern, out_shape=tuple(out_shape), grid=(BH, N),
      in_specs=[tile(K), tile(K), tile(V), tile(K), state_spec], out_specs=tuple(out_specs),
      scratch_shapes=[pltpu.VMEM((K, V), F32)], compiler_params=_params(config),
      interpret=config.interpret, name="gla_tpu_fwd")(q, k, v, g, h0)


def fwd(q, k, v, g, *, scale, initial_state, chunk_size, config):
  B, T, H, K = q.shape
  C = chunk_size
  g = cm.per_dim_decay(g, q.shape)
  o, final = _forward(*map(cm.head_major, (q, k, v, g)),
                      initial_state.reshape(B * H, K, v.shape[-1]).astype(F32),
                      scale=scale, C=C, emit_h=False, config=config)
  return cm.from_head_major(o, B, H), final.reshape(B, H, K, v.shape[-1])


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, do_ref, h_ref, dht_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, dh0_ref, dstate, *, scale, dt, N):
  n = pl.program_id(1)                     # walks chunks N-1 .. 0 (see the index maps)

  @pl.when(n == 0)
  def _():
    dstate[...] = dht_ref[...]

  q = q_ref[...].astype(F32)
  k = k_ref[...].astype(F32)
  v = v_ref[...]
  do = do_ref[...]
  C = q.shape[0]
  ch = _Chunk(g_ref[...])
  h = h_ref[...]
  dH = dstate[...]                         # cotangent of the state leaving this chunk
  A = _scores(ch, q, k, dt)
  causal = cm.iota((C, C), 0) >= cm.iota((C, C), 1)
  dA = jnp.where(causal, scale * cm.dot(do, v, dt, tb=True), 0.0)
  k_end = jnp.exp(ch.to_end)
  dq = scale * cm.dot(do, h, dt, tb=True) * jnp.exp(ch.b) + _row_side(ch, dA, k, dt)
  dk_state = cm.dot(v, dH, dt, tb=True) * k_end
  dk = _col_side(ch, dA, q, dt) + dk_state
  dv = scale * cm.dot(A, do, dt, ta=True) + cm.dot(k * k_end, dH, dt)
  db = q * dq - k * dk
  d_last = (jnp.exp(ch.total) * jnp.sum(h * dH, axis=1, keepdims=True).T
            + jnp.sum(k * dk_state, axis=0, keepdims=True))
  dg = _exact((ch.rc <= ch.cc).astype(F32), db) + d_last         # reverse cumsum + total term
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  dg_ref[...] = dg
  new = _col(jnp.exp(ch.total)) * dH + scale * cm.dot(q * jnp.exp(ch.b), do, dt, ta=True)
  dstate[...] = new

  @pl.when(n == N - 1)
  def _():
    dh0_ref[...] = new


def bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size, config):
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  qh, kh, vh, gh, doh = map(cm.head_major, (q, k, v, cm.per_dim_decay(g, q.shape),
                                          do.astype(v.dtype)))
  _, _, hs = _forward(qh, kh, vh, gh, initial_state.reshape(B * H, K, V).astype(F32),
                      scale=scale, C=C, emit_h=True, config=config)
  rev = lambda D: pl.BlockSpec((None, C, D), lambda i, n: (i, N - 1 - n, 0))
  state_spec = pl.BlockSpec((None, K, V), lambda i, n: (i, 0, 0))
  h_spec = pl.BlockSpec((None, None, K, V), lambda i, n: (i, N - 1 - n, 0, 0))
  kern = functools.partial(_bwd_kernel, scale=scale, dt=q.dtype, N=N)
  out_shape = (jax.ShapeDtypeStruct(qh.shape, q.dtype), jax.ShapeDtypeStruct(kh.shape, k.dtype),
               jax.ShapeDtypeStruct(vh.shape, v.dtype), jax.ShapeDtypeStruct(gh.shape, F32),
               jax.ShapeDtypeStruct((B * H, K, V), F32))
  dq, dk, dv, dg, dh0 = pl.pallas_call(
      kern, out_shape=out_shape, grid=(B * H, N),
      in_specs=[rev(K), rev(K), rev(V), rev(K), rev(V), h_spec, state_spec],
      out_specs=(rev(K), rev(K), rev(V), rev(K), state_spec),
      scratch_shapes=[pltpu.VMEM((K, V), F32)], compiler_params=_params(config),
      interpret=config.interpret, name="gla_tpu_bwd")(
          qh, kh, vh, gh, doh, hs, dht.reshape(B * H, K, V).astype(F32))
  back = lambda x: cm.from_head_major(x, B, H)
  return (back(dq), back(dk), back(dv), cm.decay_grad(back(dg), g),
          dh0.reshape(B, H, K, V))


def fwd_res(q, k, v, g, **kwargs):
  """:func:`fwd` and no residual of its own (the backward recomputes the states)."""
  return fwd(q, k, v, g, **kwargs), None


def bwd_res(residual, q, k, v, g, do, dht, **kwargs):
  """:func:`bwd` (``residual`` is :func:`fwd_res`'s None)."""
  del residual
  return bwd(q, k, v, g, do, dht, **kwargs)
