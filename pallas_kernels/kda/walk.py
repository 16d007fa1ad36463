"""Kimi Delta Attention's two sequential walks over chunks, grid ``(B, H, V / BV)``: each
program owns a ``[K, BV]`` tile of one head's state (the delta rule's ``w h`` reads every
key channel, so K is never split) and walks the chunks in order, or in reverse.

  forward:  h[n] = the state entering chunk n;  v_new = u - w h;
            h <- Diag(e^{gamma}) h + kd^T v_new                 (and the final state)
  backward: dH[n] = the cotangent of the state leaving chunk n;
            dv_new = dvl + kd dH[n];
            dh <- Diag(e^{gamma}) dh + scale (e^{b} * q)^T do - w^T dv_new   (and dh0)

with the per-chunk operands of :mod:`pallas_kernels.kda.chunk` (``w``, ``u``, ``kd``,
``qb = scale e^{b} * q``, ``eg = e^{gamma}`` ``[B, H, N, K]``, the chunk's decay of each
key row of the state). As Gated DeltaNet's walks, each step loads the next chunk's
operands before its own chain of dots (they ride in the loop carry), so the loads
overlap the dependent math instead of stalling it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._launch import F32, block, call, dot


def _walk_kernel(w_ref, u_ref, kd_ref, eg_ref, h0_ref, h_ref, vn_ref, ht_ref, *, C, N, BV,
                 dt):
  b, hd, iv = (pl.program_id(i) for i in range(3))
  vs = pl.ds(iv * BV, BV)

  def load(n):
    t = pl.ds(n * C, C)
    return w_ref[b, t, hd, :], u_ref[b, t, hd, vs], kd_ref[b, t, hd, :], eg_ref[b, hd, n, :]

  def body(n, carry):
    h, (w, u, kd, eg) = carry
    ahead = load(jnp.minimum(n + 1, N - 1))   # issued before this chunk's chain
    h_ref[b, hd, n, :, vs] = h.astype(h_ref.dtype)
    vn = u.astype(F32) - dot(w, h, dt)
    vn_ref[b, pl.ds(n * C, C), hd, vs] = vn.astype(vn_ref.dtype)
    return eg[:, None] * h + dot(kd, vn, dt, ta=True), ahead

  h, _ = jax.lax.fori_loop(0, N, body, (h0_ref[b, hd, :, vs].astype(F32), load(0)))
  ht_ref[b, hd, :, vs] = h


def state_walk(w, u, kd, eg, h0, *, chunk_size, config, store_dtype):
  """(h [B, H, N, K, V] in ``store_dtype``, v_new [B, T, H, V] in u's dtype, final state
  float32); ``eg`` float32 ``[B, H, N, K]``."""
  B, T, H, K = w.shape
  V = u.shape[-1]
  N = T // chunk_size
  BV = block(V, config.walk.bv)
  kern = functools.partial(_walk_kernel, C=chunk_size, N=N, BV=BV, dt=w.dtype)
  out = (jax.ShapeDtypeStruct((B, H, N, K, V), store_dtype),
         jax.ShapeDtypeStruct(u.shape, u.dtype), jax.ShapeDtypeStruct((B, H, K, V), F32))
  return call(kern, out, (B, H, V // BV), config=config, num_warps=config.walk.warps,
              num_stages=config.walk.stages, name="kda_state_walk")(w, u, kd, eg, h0)


def _dwalk_kernel(qb_ref, eg_ref, w_ref, kd_ref, do_ref, dvl_ref, dht_ref, dh_ref, dvn_ref,
                  dh0_ref, *, C, N, BV, dt):
  b, hd, iv = (pl.program_id(i) for i in range(3))
  vs = pl.ds(iv * BV, BV)

  def load(n):
    t = pl.ds(n * C, C)
    return (qb_ref[b, t, hd, :], eg_ref[b, hd, n, :], w_ref[b, t, hd, :],
            kd_ref[b, t, hd, :], do_ref[b, t, hd, vs], dvl_ref[b, t, hd, vs])

  def body(i, carry):
    dh, (qb, eg, w, kd, do, dvl) = carry
    n = N - 1 - i
    ahead = load(jnp.maximum(n - 1, 0))       # issued before this chunk's chain
    dh_ref[b, hd, n, :, vs] = dh.astype(dh_ref.dtype)
    dvn = dvl + dot(kd, dh, dt)
    dvn_ref[b, pl.ds(n * C, C), hd, vs] = dvn
    return (eg[:, None] * dh + dot(qb, do, dt, ta=True) - dot(w, dvn, dt, ta=True)), ahead

  dh, _ = jax.lax.fori_loop(0, N, body, (dht_ref[b, hd, :, vs].astype(F32), load(N - 1)))
  dh0_ref[b, hd, :, vs] = dh


def grad_walk(qb, eg, w, kd, do, dvl, dht, *, chunk_size, config, store_dtype):
  """(dH [B, H, N, K, V] in ``store_dtype``, dv_new [B, T, H, V] float32, dh0 float32);
  ``qb = scale e^{b} * q`` and ``eg`` from :func:`pallas_kernels.kda.chunk.wu`."""
  B, T, H, K = qb.shape
  V = do.shape[-1]
  N = T // chunk_size
  BV = block(V, config.dwalk.bv)
  kern = functools.partial(_dwalk_kernel, C=chunk_size, N=N, BV=BV, dt=qb.dtype)
  out = (jax.ShapeDtypeStruct((B, H, N, K, V), store_dtype),
         jax.ShapeDtypeStruct(dvl.shape, F32), jax.ShapeDtypeStruct((B, H, K, V), F32))
  return call(kern, out, (B, H, V // BV), config=config, num_warps=config.dwalk.warps,
              num_stages=config.dwalk.stages, name="kda_grad_walk")(qb, eg, w, kd, do, dvl,
                                                                    dht)
