"""The chunk-local cumulative log-decay, and the sequential passes over chunks.

``chunk_cumsum``: ``bc = cumsum of g within each chunk`` (float32 ``[B, T, H, K]``), grid
``(B, H, N, K / KD)``, fully parallel. Every later kernel reads its decays from this one
array, so every exponent ``bc_r - bc_i`` anywhere is a difference of the same float32
values (as in the reference), and the chunk's total decay is ``bc`` at the chunk's last
row, loaded as a row, so ``b_last - bc`` is exactly 0 there.

State passes, grid ``(B, H, K / BK, V / BV)``: each program owns one ``[BK, BV]`` tile of
one head's state and walks the chunks in order (or in reverse); this ``K x V`` recurrence
is the only sequential work in the algorithm.

  state pass:  h[n] = state entering chunk n, n = 0..N-1, and the final state;
               state <- e^{b_last} state + (k e^{b_last - bc})^T v
  grad pass:   dH[n] = cotangent of the state leaving chunk n;
               dstate <- e^{b_last} dstate + scale (q e^{bc})^T do
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm


def _cumsum_kernel(g_ref, bc_ref, *, C, KD):
  b, hd, n, ik = (pl.program_id(i) for i in range(4))
  t, ks = pl.ds(n * C, C), pl.ds(ik * KD, KD)
  bc_ref[b, t, hd, ks] = jnp.cumsum(g_ref[b, t, hd, ks].astype(cm.F32), axis=0)


def chunk_cumsum(g, *, chunk_size):
  """bc [B, T, H, K] float32: cumulative sum of g within each chunk of ``chunk_size``."""
  B, T, H, K = g.shape
  C = chunk_size
  KD = cm.block(K, cm.TUNE["cumsum_kd"])
  kern = functools.partial(_cumsum_kernel, C=C, KD=KD)
  return cm.call(kern, jax.ShapeDtypeStruct(g.shape, cm.F32), (B, H, T // C, K // KD),
                 num_warps=cm.TUNE["cumsum_warps"], num_stages=1,
                 name="gla_chunk_cumsum")(g)


def walk_tiles(B, H, K, V, *, walks=1):
  """[BK, BV] state tile of a walk. ``TUNE["state_bv"] = None`` (default) picks BV in
  32..128 so that the launch's ``walks * B * H * (K / BK) * (V / BV)`` programs come
  closest to the GPU's SM count (larger tile on a tie): a walk is a chain of dependent
  chunk steps, fastest with about one program per SM (measured on the H200, run 8:
  state pass 0.45 ms with 128 programs against 0.55 ms with 64 and 0.72 with 32 at B1
  H16 K128 V128; 0.14 ms with 128 against 0.20 with 256 and 0.43 with 512 at B8 H4 V256).
  """
  BK = cm.block(K, cm.TUNE["state_bk"])
  if cm.TUNE["state_bv"]:
    return BK, cm.block(V, cm.TUNE["state_bv"])
  target = cm.TUNE["state_programs"] or cm.sm_count()
  options = sorted({cm.block(V, cap) for cap in (32, 64, 128)}, reverse=True)
  progs = lambda bv: walks * B * H * (K // BK) * (V // bv)
  return BK, min(options, key=lambda bv: abs(math.log(progs(bv) / target)))


def walk_params(k, v, *, chunk_size, walks=1):
  """(grid, kernel keywords) of a state walk: one program per [BK, BV] state tile;
  ``walks``: how many walks share the launch (for the tile choice)."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  BK, BV = walk_tiles(B, H, K, V, walks=walks)
  return (B, H, K // BK, V // BV), dict(C=chunk_size, N=T // chunk_size, BK=BK, BV=BV,
                                        dt=k.dtype)


def walk_outputs(k, v, *, chunk_size, states, grads):
  """Output shapes: the state pass's (h [B, H, N, K, V], final) and/or the gradient
  pass's (dH [B, H, N, K, V], dh0); h and dH in ``state_store_dtype``, the rest float32."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  N = T // chunk_size
  store = cm.state_store_dtype(k.dtype)
  last = jax.ShapeDtypeStruct((B, H, K, V), cm.F32)
  return ((jax.ShapeDtypeStruct((B, H, N, K, V), store), last) if states else ()) + (
      (jax.ShapeDtypeStruct((B, H, N, K, V), store), last) if grads else ())


def walk_call(kernel, out, grid, name):
  return cm.call(kernel, out, grid, num_warps=cm.TUNE['state_warps'],
                 num_stages=cm.TUNE['state_stages'], name=name)


def _state_walk(k_ref, v_ref, bc_ref, h0_ref, h_ref, ht_ref, b, hd, ik, iv, *, C, N, BK, BV,
                dt):
  ks, vs = pl.ds(ik * BK, BK), pl.ds(iv * BV, BV)

  def body(n, state):
    h_ref[b, hd, n, ks, vs] = state.astype(h_ref.dtype)
    t = pl.ds(n * C, C)
    b_last = bc_ref[b, n * C + C - 1, hd, ks]                      # [BK]
    k_dec = k_ref[b, t, hd, ks].astype(cm.F32) * jnp.exp(b_last[None, :] - bc_ref[b, t, hd, ks])
    inc = cm.dot(k_dec, v_ref[b, t, hd, vs], dt, ta=True)          # [BK, BV]
    return jnp.exp(b_last)[:, None] * state + inc

  ht_ref[b, hd, ks, vs] = jax.lax.fori_loop(0, N, body, h0_ref[b, hd, ks, vs])


def _state_kernel(k_ref, v_ref, bc_ref, h0_ref, h_ref, ht_ref, **kw):
  _state_walk(k_ref, v_ref, bc_ref, h0_ref, h_ref, ht_ref, *(pl.program_id(i) for i in range(4)),
              **kw)


def state_pass(k, v, bc, h0, *, chunk_size):
  """Returns (h [B, H, N, K, V]: the state entering each chunk, in
  ``state_store_dtype`` (the input dtype with ``TUNE["states_in_input_dtype"]``, else
  float32), and the final state [B, H, K, V] in float32."""
  grid, kw = walk_params(k, v, chunk_size=chunk_size)
  out = walk_outputs(k, v, chunk_size=chunk_size, states=True, grads=False)
  return walk_call(functools.partial(_state_kernel, **kw), out, grid,
                   "gla_state_pass")(k, v, bc, h0)


def _grad_walk(q_ref, do_ref, bc_ref, dht_ref, dh_ref, dh0_ref, b, hd, ik, iv, *, C, N, BK, BV,
               dt, scale):
  ks, vs = pl.ds(ik * BK, BK), pl.ds(iv * BV, BV)

  def body(i, dstate):
    n = N - 1 - i
    dh_ref[b, hd, n, ks, vs] = dstate.astype(dh_ref.dtype)
    t = pl.ds(n * C, C)
    b_last = bc_ref[b, n * C + C - 1, hd, ks]
    q_dec = q_ref[b, t, hd, ks].astype(cm.F32) * (scale * jnp.exp(bc_ref[b, t, hd, ks]))
    loc = cm.dot(q_dec, do_ref[b, t, hd, vs], dt, ta=True)       # [BK, BV]
    return jnp.exp(b_last)[:, None] * dstate + loc

  dh0_ref[b, hd, ks, vs] = jax.lax.fori_loop(0, N, body, dht_ref[b, hd, ks, vs])


def _state_grad_kernel(q_ref, do_ref, bc_ref, dht_ref, dh_ref, dh0_ref, **kw):
  _grad_walk(q_ref, do_ref, bc_ref, dht_ref, dh_ref, dh0_ref,
             *(pl.program_id(i) for i in range(4)), **kw)


def state_grad_pass(q, do, bc, dht, *, scale, chunk_size):
  """Returns (dH [B, H, N, K, V] cotangent of the state leaving each chunk, dh0 [B, H, K, V])."""
  grid, kw = walk_params(q, do, chunk_size=chunk_size)
  out = walk_outputs(q, do, chunk_size=chunk_size, states=False, grads=True)
  return walk_call(functools.partial(_state_grad_kernel, scale=scale, **kw), out, grid,
                   "gla_state_grad_pass")(q, do, bc, dht)


def _both_kernel(k_ref, v_ref, q_ref, do_ref, bc_ref, h0_ref, dht_ref, h_ref, ht_ref, dh_ref,
                 dh0_ref, *, B, scale, **kw):
  p, hd, ik, iv = (pl.program_id(i) for i in range(4))
  b = p % B
  jax.lax.cond(
      p < B,
      lambda: _state_walk(k_ref, v_ref, bc_ref, h0_ref, h_ref, ht_ref, b, hd, ik, iv, **kw),
      lambda: _grad_walk(q_ref, do_ref, bc_ref, dht_ref, dh_ref, dh0_ref, b, hd, ik, iv,
                         scale=scale, **kw))


def both_passes(q, k, v, do, bc, h0, dht, *, scale, chunk_size):
  """The state pass and the state-gradient pass in one launch (the backward needs both and
  they are independent): twice the programs of either, so the two sequential walks run
  side by side on the GPU instead of one after the other. Returns (h, dH, dh0)."""
  (B, *rest), kw = walk_params(k, v, chunk_size=chunk_size, walks=2)
  out = walk_outputs(k, v, chunk_size=chunk_size, states=True, grads=True)
  kern = functools.partial(_both_kernel, B=B, scale=scale, **kw)
  h, _, dH, dh0 = walk_call(kern, out, (2 * B, *rest), "gla_state_passes")(
      k, v, q, do, bc, h0, dht)
  return h, dH, dh0
