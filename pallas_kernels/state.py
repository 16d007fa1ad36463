"""The sub-chunk-local cumulative log-decays, and the sequential passes over chunks.

``chunk_cumsum``, grid ``(B, H, N, K / KD)``, fully parallel, writes two float32
``[B, T, H, K]`` arrays, both local to each 16-row sub-chunk:

  p_r = sum_{start of r's sub-chunk <= j <= r} g_j   (inclusive prefix, restarts every 16 rows)
  s_i = sum_{i < j <= end of i's sub-chunk} g_j       (exclusive suffix)

so the sub-chunk totals ``T_u`` are ``p`` at each sub-chunk's last row. Every exponent in
every kernel is a sum of these same-sign (<= 0) parts, never the difference of two
chunk-cumulative sums (``bc_r - bc_i`` loses ``eps * |bc|`` in the exponent: 5e-3 with
one -1e4 token in a chunk, issue 16): ``bc_r = sum_{u < blk(r)} T_u + p_r``,
``b_last - bc_i = s_i + sum_{u > blk(i)} T_u``, ``b_last = sum_u T_u`` (``_common``'s
``chunk_prefix`` / ``chunk_suffix`` / ``chunk_total``). ``p`` is a forward cumsum of each
``[16, KD]`` sub-chunk tile; ``s`` is accumulated row by row from the sub-chunk's last
row down, all sub-chunks of the chunk at once (strided ``[C / 16, KD]`` row tiles: Triton
has no reverse cumsum, and ``total - cumsum`` would cancel).

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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm


def _cumsum_kernel(g_ref, p_ref, s_ref, *, C, KD):
  b, hd, n, ik = (pl.program_id(i) for i in range(4))
  ks = pl.ds(ik * KD, KD)
  S, L = cm.SUB, C // cm.SUB
  for u in range(L):                  # p: a forward cumsum of each [16, KD] sub-chunk tile
    sub = pl.ds(n * C + u * S, S)
    p_ref[b, sub, hd, ks] = jnp.cumsum(g_ref[b, sub, hd, ks].astype(cm.F32), axis=0)
  # s: row j of every sub-chunk at once (a [L, KD] tile, rows 16 apart), last row first,
  # accumulated exactly: s_j = g_{j+1} + s_{j+1}.
  def row(i, acc):
    rows = pl.ds(n * C + S - 1 - i, L, stride=S)
    s_ref[b, rows, hd, ks] = acc
    return acc + g_ref[b, rows, hd, ks].astype(cm.F32)

  jax.lax.fori_loop(0, S, row, jnp.zeros((L, KD), cm.F32))


def chunk_cumsum(g, *, chunk_size, config):
  """(p, s) [B, T, H, K] float32: the inclusive prefix and the exclusive suffix of g
  within each 16-row sub-chunk (module docstring); ``chunk_size`` a multiple of 16."""
  B, T, H, K = g.shape
  C = chunk_size
  KD = cm.block(K, config.cumsum_kd)
  kern = functools.partial(_cumsum_kernel, C=C, KD=KD)
  out = jax.ShapeDtypeStruct(g.shape, cm.F32)
  return cm.call(kern, (out, out), (B, H, T // C, K // KD), config=config,
                 num_warps=config.cumsum_warps, num_stages=1, name="gla_chunk_cumsum")(g)


def walk_params(k, v, *, chunk_size, config, both=False):
  """(grid, kernel keywords) of a state walk: one program per [BK, BV] state tile, BV
  ``config.state_both_bv`` when both walks share the launch (``both``), else
  ``config.state_bv`` (:func:`pallas_kernels.default_config` picks them per shape)."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  BK = cm.block(K, config.state_bk)
  BV = cm.block(V, config.state_both_bv if both else config.state_bv)
  return (B, H, K // BK, V // BV), dict(C=chunk_size, N=T // chunk_size, BK=BK, BV=BV,
                                        dt=k.dtype)


def walk_outputs(k, v, *, chunk_size, config, states, grads):
  """Output shapes: the state pass's (h [B, H, N, K, V], final) and/or the gradient
  pass's (dH [B, H, N, K, V], dh0); h and dH in ``state_store_dtype``, the rest float32."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  N = T // chunk_size
  store = cm.state_store_dtype(config, k.dtype)
  last = jax.ShapeDtypeStruct((B, H, K, V), cm.F32)
  return ((jax.ShapeDtypeStruct((B, H, N, K, V), store), last) if states else ()) + (
      (jax.ShapeDtypeStruct((B, H, N, K, V), store), last) if grads else ())


def walk_call(kernel, out, grid, name, config):
  return cm.call(kernel, out, grid, config=config, num_warps=config.state_warps,
                 num_stages=config.state_stages, name=name)


def _state_walk(k_ref, v_ref, p_ref, s_ref, h0_ref, h_ref, ht_ref, b, hd, ik, iv, *, C, N,
                BK, BV, dt):
  ks, vs = pl.ds(ik * BK, BK), pl.ds(iv * BV, BV)
  blk = cm.iota((C, BK), 0) // cm.SUB

  def body(n, state):
    h_ref[b, hd, n, ks, vs] = state.astype(h_ref.dtype)
    t = pl.ds(n * C, C)
    tot = cm.sub_totals(p_ref, b, n * C, hd, ks, C // cm.SUB)
    sc = cm.chunk_suffix(s_ref[b, t, hd, ks], tot, blk)           # b_last - bc, [C, BK]
    k_dec = k_ref[b, t, hd, ks].astype(cm.F32) * jnp.exp(sc)
    inc = cm.dot(k_dec, v_ref[b, t, hd, vs], dt, ta=True)          # [BK, BV]
    return jnp.exp(cm.chunk_total(tot))[:, None] * state + inc

  ht_ref[b, hd, ks, vs] = jax.lax.fori_loop(0, N, body, h0_ref[b, hd, ks, vs])


def _state_kernel(k_ref, v_ref, p_ref, s_ref, h0_ref, h_ref, ht_ref, **kw):
  _state_walk(k_ref, v_ref, p_ref, s_ref, h0_ref, h_ref, ht_ref,
              *(pl.program_id(i) for i in range(4)), **kw)


def state_pass(k, v, p, s, h0, *, chunk_size, config):
  """Returns (h [B, H, N, K, V]: the state entering each chunk, in
  ``state_store_dtype`` (the input dtype with ``config.states_in_input_dtype``, else
  float32), and the final state [B, H, K, V] in float32. ``p``, ``s``: chunk_cumsum's."""
  grid, kw = walk_params(k, v, chunk_size=chunk_size, config=config)
  out = walk_outputs(k, v, chunk_size=chunk_size, config=config, states=True, grads=False)
  return walk_call(functools.partial(_state_kernel, **kw), out, grid, "gla_state_pass",
                   config)(k, v, p, s, h0)


def _grad_walk(q_ref, do_ref, p_ref, dht_ref, dh_ref, dh0_ref, b, hd, ik, iv, *, C, N, BK, BV,
               dt, scale):
  ks, vs = pl.ds(ik * BK, BK), pl.ds(iv * BV, BV)
  blk = cm.iota((C, BK), 0) // cm.SUB

  def body(i, dstate):
    n = N - 1 - i
    dh_ref[b, hd, n, ks, vs] = dstate.astype(dh_ref.dtype)
    t = pl.ds(n * C, C)
    tot = cm.sub_totals(p_ref, b, n * C, hd, ks, C // cm.SUB)
    bc = cm.chunk_prefix(p_ref[b, t, hd, ks], tot, blk)            # [C, BK]
    q_dec = q_ref[b, t, hd, ks].astype(cm.F32) * (scale * jnp.exp(bc))
    loc = cm.dot(q_dec, do_ref[b, t, hd, vs], dt, ta=True)       # [BK, BV]
    return jnp.exp(cm.chunk_total(tot))[:, None] * dstate + loc

  dh0_ref[b, hd, ks, vs] = jax.lax.fori_loop(0, N, body, dht_ref[b, hd, ks, vs])


def _state_grad_kernel(q_ref, do_ref, p_ref, dht_ref, dh_ref, dh0_ref, **kw):
  _grad_walk(q_ref, do_ref, p_ref, dht_ref, dh_ref, dh0_ref,
             *(pl.program_id(i) for i in range(4)), **kw)


def state_grad_pass(q, do, p, dht, *, scale, chunk_size, config):
  """Returns (dH [B, H, N, K, V] cotangent of the state leaving each chunk, dh0 [B, H, K, V])."""
  grid, kw = walk_params(q, do, chunk_size=chunk_size, config=config)
  out = walk_outputs(q, do, chunk_size=chunk_size, config=config, states=False, grads=True)
  return walk_call(functools.partial(_state_grad_kernel, scale=scale, **kw), out, grid,
                   "gla_state_grad_pass", config)(q, do, p, dht)


def _both_kernel(k_ref, v_ref, q_ref, do_ref, p_ref, s_ref, h0_ref, dht_ref, h_ref, ht_ref,
                 dh_ref, dh0_ref, *, B, scale, **kw):
  pid, hd, ik, iv = (pl.program_id(i) for i in range(4))
  b = pid % B
  jax.lax.cond(
      pid < B,
      lambda: _state_walk(k_ref, v_ref, p_ref, s_ref, h0_ref, h_ref, ht_ref, b, hd, ik, iv,
                          **kw),
      lambda: _grad_walk(q_ref, do_ref, p_ref, dht_ref, dh_ref, dh0_ref, b, hd, ik, iv,
                         scale=scale, **kw))


def both_passes(q, k, v, do, p, s, h0, dht, *, scale, chunk_size, config):
  """The state pass and the state-gradient pass in one launch (the backward needs both and
  they are independent): twice the programs of either, so the two sequential walks run
  side by side on the GPU instead of one after the other. Returns (h, dH, dh0)."""
  (B, *rest), kw = walk_params(k, v, chunk_size=chunk_size, config=config, both=True)
  out = walk_outputs(k, v, chunk_size=chunk_size, config=config, states=True, grads=True)
  kern = functools.partial(_both_kernel, B=B, scale=scale, **kw)
  h, _, dH, dh0 = walk_call(kern, out, (2 * B, *rest), "gla_state_passes", config)(
      k, v, q, do, p, s, h0, dht)
  return h, dH, dh0
