"""Mosaic TPU variant of the chunked GLA kernels (``pltpu``): forward and backward.

Status: checked for lowering to Mosaic TPU on CPU (``lowering_platforms=("tpu",)``) and
tested in the Pallas interpreter against the reference; **never run on TPU hardware**
(no TPU is lent). Not selected automatically: on a TPU target ``chunk_gla(backend="auto")``
stays on the jnp path until this has been measured on a chip; ``backend="pallas"`` uses it
(``pallas_kernels.backend("tpu")``).

Same contract as :mod:`zeco_jax.chunked`, plus ``config`` (a
:class:`pallas_kernels.KernelConfig`; only its ``interpret`` is read here). No scalar-decay
path yet: a per-head scalar g is broadcast over K at entry, its gradient summed at exit.

TPU-shaped rather than GPU-shaped: inputs go head-major ``[B*H, T, D]`` (one XLA
transpose) so every block is a dense ``[C, D]`` VMEM tile; the chunk axis is the
sequential ("arbitrary") grid axis and the ``K x V`` state lives in a VMEM scratch, so
the forward is one fused kernel (state, scores and output per chunk) and the backward is
two (state recompute; reverse pass with the state gradient in scratch and every chunk
gradient). Mosaic has no cumsum: chunk-local cumsums are triangular float32 matmuls
(precision HIGHEST). Sub-chunk structure as on GPU: 16-row sub-chunks, reference rows,
exact log-space diagonal blocks, written with full-chunk masks so every op is 2-D.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common as cm

S = cm.SUB
F32 = jnp.float32
_HI = lax.Precision.HIGHEST


def _mm(a, b, dt, ta=False, tb=False):
  dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
  if dt == F32:
    return lax.dot_general(a.astype(F32), b.astype(F32), dims, precision=_HI,
                           preferred_element_type=F32)
  return lax.dot_general(a.astype(dt), b.astype(dt), dims, preferred_element_type=F32)


def _exact(a, b):
  """float32 a @ b at HIGHEST (cumsums and one-hot selections: exact up to rounding)."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HI,
                         preferred_element_type=F32)


def _iota(C, axis):
  return lax.broadcasted_iota(jnp.int32, (C, C), axis)


def _mexp(mask, x):
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


class _Chunk:
  """Log-decays of one chunk and the masks the sub-chunk scheme needs ([C, K] values)."""

  def __init__(self, g):
    C, K = g.shape
    self.C, self.K = C, K
    r, c = _iota(C, 0), _iota(C, 1)
    self.b = _exact((r >= c).astype(F32), g)                       # inclusive cumsum
    self.b_last = self.b[C - 1:C, :]                                # [1, K]
    self.row = lax.broadcasted_iota(jnp.int32, (C, K), 0)
    self.rc, self.cc = r, c

  def ref(self, a):
    """b at the row before sub-chunk a ([1, K]; 0 for a = 0)."""
    return jnp.zeros((1, self.K), F32) if a == 0 else self.b[a * S - 1:a * S, :]

  def end(self, a):
    return self.b[a * S + S - 1:a * S + S, :]

  def in_sub(self, a):
    return (self.row >= a * S) & (self.row < a * S + S)

  def pick(self, j):
    """One-hot [C, C]: row r selects column (r // S) * S + j (same sub-chunk, offset j)."""
    return (self.cc == (self.rc // S) * S + j).astype(F32)


def _scores(ch, q, k, dt):
  """A[r, i] = sum_k q_r k_i exp(b_r - b_i), i <= r: [C, C] float32."""
  C, b = ch.C, ch.b
  A = jnp.zeros((C, C), F32)
  for a in range(1, C // S):
    ref = ch.ref(a)
    q_fac = q * _mexp(ch.in_sub(a), b - ref)
    k_fac = k * _mexp(ch.row < a * S, ref - b)
    A = A + _mm(q_fac, k_fac, dt, tb=True)
  for j in range(S):
    P = ch.pick(j)
    k_sel, b_sel = _exact(P, k), _exact(P, b)
    val = jnp.sum(q * k_sel * _mexp(ch.row % S >= j, b - b_sel), axis=1, keepdims=True)
    A = A + P * val
  return A


def _row_side(ch, dA, k, dt):
  """sum_i dA[r, i] k_i exp(b_r - b_i): [C, K]."""
  C, b = ch.C, ch.b
  out = jnp.zeros((C, ch.K), F32)
  for a in range(1, C // S):
    ref = ch.ref(a)
    part = _mm(dA, k * _mexp(ch.row < a * S, ref - b), dt)
    out = out + part * _mexp(ch.in_sub(a), b - ref)
  for j in range(S):
    P = ch.pick(j)
    k_sel, b_sel = _exact(P, k), _exact(P, b)
    dA_sel = jnp.sum(dA * P, axis=1, keepdims=True)
    out = out + dA_sel * k_sel * _mexp(ch.row % S >= j, b - b_sel)
  return out


def _col_side(ch, dA, q, dt):
  """sum_r dA[r, i] q_r exp(b_r - b_i): [C, K]."""
  C, b = ch.C, ch.b
  out = jnp.zeros((C, ch.K), F32)
  for a in range(C // S - 1):
    end = ch.end(a)
    part = _mm(dA, q * _mexp(ch.row >= a * S + S, b - end), dt, ta=True)
    out = out + part * _mexp(ch.in_sub(a), end - b)
  dA_t = dA.T
  for j in range(S):
    P = ch.pick(j)
    q_sel, b_sel = _exact(P, q), _exact(P, b)
    dA_sel = jnp.sum(dA_t * P, axis=1, keepdims=True)
    out = out + dA_sel * q_sel * _mexp(ch.row % S <= j, b_sel - b)
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
  o = _mm(q * jnp.exp(ch.b), h, dt) + _mm(A, v, dt)
  o_ref[...] = (scale * o).astype(o_ref.dtype)
  h = _col(jnp.exp(ch.b_last)) * h + _mm(k * jnp.exp(ch.b_last - ch.b), v, dt, ta=True)
  state[...] = h

  @pl.when(n == N - 1)
  def _():
    ht_ref[...] = h


def _head_major(x):
  B, T, H, D = x.shape
  return x.transpose(0, 2, 1, 3).reshape(B * H, T, D)


def _from_head_major(x, B, H):
  BH, T, D = x.shape
  return x.reshape(B, H, T, D).transpose(0, 2, 1, 3)


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
  o, final = _forward(*map(_head_major, (q, k, v, g)),
                      initial_state.reshape(B * H, K, v.shape[-1]).astype(F32),
                      scale=scale, C=C, emit_h=False, config=config)
  return _from_head_major(o, B, H), final.reshape(B, H, K, v.shape[-1])


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
  causal = _iota(C, 0) >= _iota(C, 1)
  dA = jnp.where(causal, scale * _mm(do, v, dt, tb=True), 0.0)
  k_end = jnp.exp(ch.b_last - ch.b)
  dq = scale * _mm(do, h, dt, tb=True) * jnp.exp(ch.b) + _row_side(ch, dA, k, dt)
  dk_state = _mm(v, dH, dt, tb=True) * k_end
  dk = _col_side(ch, dA, q, dt) + dk_state
  dv = scale * _mm(A, do, dt, ta=True) + _mm(k * k_end, dH, dt)
  db = q * dq - k * dk
  d_last = (jnp.exp(ch.b_last) * jnp.sum(h * dH, axis=1, keepdims=True).T
            + jnp.sum(k * dk_state, axis=0, keepdims=True))
  dg = _exact((ch.rc <= ch.cc).astype(F32), db) + d_last         # reverse cumsum + total term
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  dg_ref[...] = dg
  new = _col(jnp.exp(ch.b_last)) * dH + scale * _mm(q * jnp.exp(ch.b), do, dt, ta=True)
  dstate[...] = new

  @pl.when(n == N - 1)
  def _():
    dh0_ref[...] = new


def bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size, config):
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  qh, kh, vh, gh, doh = map(_head_major, (q, k, v, cm.per_dim_decay(g, q.shape),
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
  back = lambda x: _from_head_major(x, B, H)
  return (back(dq), back(dk), back(dv), cm.decay_grad(back(dg), g),
          dh0.reshape(B, H, K, V))
