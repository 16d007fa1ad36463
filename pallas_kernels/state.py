"""Sequential passes over chunks: the chunk states (forward) and their cotangents (backward).

Grid ``(B, H, K / BK, V / BV)``: each program owns one ``[BK, BV]`` tile of one head's
state and walks the chunks in order (or in reverse), so the only sequential work in the
whole algorithm is this ``K x V`` recurrence; everything else is chunk-parallel.

  state pass:  h[n] = state entering chunk n;   state <- e^{b_last} state + (k e^{b_last - b})^T v
  grad pass:   dH[n] = cotangent of the state leaving chunk n;
               dstate <- e^{b_last} dstate + scale (q e^{b})^T do
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm


def _state_kernel(k_ref, v_ref, g_ref, h0_ref, h_ref, ht_ref, *, C, N, BK, BV, dt):
  b, hd, ik, iv = (pl.program_id(i) for i in range(4))
  ks, vs = pl.ds(ik * BK, BK), pl.ds(iv * BV, BV)

  def body(n, state):
    h_ref[b, hd, n, ks, vs] = state.astype(h_ref.dtype)
    t = pl.ds(n * C, C)
    g = g_ref[b, t, hd, ks]
    bc = jnp.cumsum(g, axis=0)
    b_last = cm.last_row(bc)                   # [1, BK]
    k_dec = k_ref[b, t, hd, ks].astype(cm.F32) * jnp.exp(b_last - bc)
    inc = cm.dot(k_dec, v_ref[b, t, hd, vs], dt, ta=True)         # [BK, BV]
    return jnp.exp(b_last).reshape(BK, 1) * state + inc

  ht_ref[b, hd, ks, vs] = jax.lax.fori_loop(0, N, body, h0_ref[b, hd, ks, vs])


def state_pass(k, v, g, h0, *, chunk_size):
  """Returns (h [B, H, N, K, V] state entering each chunk (float32, or the input dtype with
  ``TUNE["states_in_input_dtype"]``), final [B, H, K, V] float32)."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  BK, BV = cm.block(K, cm.TUNE['state_bk']), cm.block(V, cm.TUNE['state_bv'])
  kern = functools.partial(_state_kernel, C=C, N=N, BK=BK, BV=BV, dt=k.dtype)
  out = (jax.ShapeDtypeStruct((B, H, N, K, V), cm.state_store_dtype(k.dtype)),
         jax.ShapeDtypeStruct((B, H, K, V), cm.F32))
  return cm.call(kern, out, (B, H, K // BK, V // BV), num_warps=cm.TUNE['state_warps'],
                 num_stages=cm.TUNE['state_stages'], name="gla_state_pass")(k, v, g, h0)


def _state_grad_kernel(q_ref, do_ref, g_ref, dht_ref, dh_ref, dh0_ref, *, C, N, BK, BV, dt,
                       scale):
  b, hd, ik, iv = (pl.program_id(i) for i in range(4))
  ks, vs = pl.ds(ik * BK, BK), pl.ds(iv * BV, BV)

  def body(i, dstate):
    n = N - 1 - i
    dh_ref[b, hd, n, ks, vs] = dstate.astype(dh_ref.dtype)
    t = pl.ds(n * C, C)
    g = g_ref[b, t, hd, ks]
    bc = jnp.cumsum(g, axis=0)
    b_last = cm.last_row(bc)
    q_dec = q_ref[b, t, hd, ks].astype(cm.F32) * (scale * jnp.exp(bc))
    loc = cm.dot(q_dec, do_ref[b, t, hd, vs], dt, ta=True)       # [BK, BV]
    return jnp.exp(b_last).reshape(BK, 1) * dstate + loc

  dh0_ref[b, hd, ks, vs] = jax.lax.fori_loop(0, N, body, dht_ref[b, hd, ks, vs])


def state_grad_pass(q, do, g, dht, *, scale, chunk_size):
  """Returns (dH [B, H, N, K, V] cotangent of the state leaving each chunk, dh0 [B, H, K, V])."""
  B, T, H, K = q.shape
  V = do.shape[-1]
  C = chunk_size
  N = T // C
  BK, BV = cm.block(K, cm.TUNE['state_bk']), cm.block(V, cm.TUNE['state_bv'])
  kern = functools.partial(_state_grad_kernel, C=C, N=N, BK=BK, BV=BV, dt=q.dtype, scale=scale)
  out = (jax.ShapeDtypeStruct((B, H, N, K, V), cm.state_store_dtype(q.dtype)),
         jax.ShapeDtypeStruct((B, H, K, V), cm.F32))
  return cm.call(kern, out, (B, H, K // BK, V // BV), num_warps=cm.TUNE['state_warps'],
                 num_stages=cm.TUNE['state_stages'], name="gla_state_grad_pass")(q, do, g, dht)
