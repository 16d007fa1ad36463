"""The sub-chunk-local cumulative log-decays, the decay folded into q and k, and the
sequential passes over chunks.

``chunk_cumsum``, grid ``(B, H, N, K / KD)``, fully parallel, writes two float32
``[B, T, H, K]`` arrays, both local to each 16-row sub-chunk:

  p_r = sum_{start of r's sub-chunk <= j <= r} g_j   (inclusive prefix, restarts every 16 rows)
  s_i = sum_{i < j <= end of i's sub-chunk} g_j       (exclusive suffix)

so the sub-chunk totals ``T_u`` are ``p`` at each sub-chunk's last row. Every exponent in
every kernel is a sum of these same-sign (<= 0) parts, never the difference of two
chunk-cumulative sums (``bc_r - bc_i`` loses ``eps * |bc|`` in the exponent: 5e-3 with
one -1e4 token in a chunk): ``bc_r = sum_{u < blk(r)} T_u + p_r``,
``b_last - bc_i = s_i + sum_{u > blk(i)} T_u``, ``b_last = sum_u T_u`` (``_common``'s
``chunk_prefix`` / ``chunk_suffix`` / ``chunk_total``). ``p`` is a forward cumsum of each
``[16, KD]`` sub-chunk tile; ``s`` is accumulated row by row from the sub-chunk's last
row down, all sub-chunks of the chunk at once (strided ``[C / 16, KD]`` row tiles: Triton
has no reverse cumsum, and ``total - cumsum`` would cancel).

``chunk_decays`` (the forward's) is the same program writing, instead of p and s, the
operands of the forward's kernels with the decay folded in, in q's and k's dtype: ``q
e^{p}``, ``k e^{s}`` and ``k e^{-max(p, -16)}`` (the scores, the output), ``kd = k
e^{b_last - bc}`` (the state walk), and in float32 the sub-chunk totals and ``dl =
e^{b_last}`` per chunk ``[B, H, N, K]``. Every dot that reads them casts its operands to
the input dtype anyway, so the forward walk's sequential chunk steps do a dot and a scale
and nothing else (no exp, no select), and the scores and the output read half the bytes
of float32 p and s. Measured on one H200 (``docs/kernels.md``), folding made the forward
faster (6-7% for the walk's keys, 11% more for the scores' operands); a backward that
recomputes the states keeps ``chunk_cumsum`` and forms the decayed keys and queries inside
its two walks (folding both there made it slower: its extra writes cost more than the two
walks, side by side in one launch, saved).

``chunk_cumsum_folded`` is ``chunk_cumsum`` also writing the state-gradient walk's
operands with the decay folded in: ``qd = scale q e^{bc}`` in q's dtype and ``dl =
e^{b_last}``, ``bc`` and ``b_last`` added from the sub-chunk totals in ``chunk_prefix``'s
and ``chunk_total``'s order, so ``folded_state_grad_pass`` dots the operands the unfolded
walk would. The backward that keeps the forward's states (``config.save_states``) runs
that walk alone over them: 0.04 ms faster than the unfolded walk at B1 T16384 H16 K=V=128
on an H200, the same at the second benchmark shape.

State passes, grid ``(B, H, K / BK, V / BV)``: each program owns one ``[BK, BV]`` tile of
one head's state and walks the chunks in order (or in reverse); this ``K x V`` recurrence
is the only sequential work in the algorithm.

  state pass:  h[n] = state entering chunk n, n = 0..N-1, and the final state;
               state <- e^{b_last} state + (k e^{b_last - bc})^T v
  grad pass:   dH[n] = cotangent of the state leaving chunk n;
               dstate <- e^{b_last} dstate + scale (q e^{bc})^T do
               (folded: dstate <- dl[n] dstate + qd^T do)
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gla import _common as cm


class Decays(NamedTuple):
  """What :func:`chunk_decays` writes for the forward's kernels (module docstring)."""
  qp: jax.Array     # [B, T, H, K] q's dtype: q e^{p}
  ks: jax.Array     # [B, T, H, K] k's dtype: k e^{s}
  kn: jax.Array     # [B, T, H, K] k's dtype: k e^{-max(p, -16)}
  kd: jax.Array     # [B, T, H, K] k's dtype: k e^{b_last - bc}
  dl: jax.Array     # [B, H, N, K] float32: e^{b_last}, the chunk's decay of the state
  tots: jax.Array   # [B, H, N, C / 16, K] float32: the sub-chunk totals T_u


def _cumsum_kernel(*refs, C, KD, fold, grad_fold=False, scale=None, unroll=1):
  """p and s of one chunk's [C, KD] tile (``chunk_cumsum``); with ``grad_fold``
  (``chunk_cumsum_folded``) also qd and dl; with ``fold`` (``chunk_decays``) instead qp,
  ks, kn, kd, dl and the totals."""
  if fold:
    g_ref, q_ref, k_ref, qp_ref, ks_ref, kn_ref, kd_ref, dl_ref, tots_ref = refs
  elif grad_fold:
    g_ref, q_ref, p_ref, s_ref, qd_ref, dl_ref = refs
  else:
    g_ref, p_ref, s_ref = refs
  b, hd, n, ik = (pl.program_id(i) for i in range(4))
  ks = pl.ds(ik * KD, KD)
  S, L = cm.SUB, C // cm.SUB
  last = cm.iota((S, KD), 0) == S - 1
  # p: a forward cumsum of each [16, KD] sub-chunk tile. Folding: its last row is the
  # sub-chunk's total T_u (a masked sum: exact), and b_last = T_0 + ... + T_{L-1}, added
  # in the order _common.chunk_total adds them; ``before`` entering sub-chunk u is T_0 +
  # ... + T_{u-1} in the order _common.chunk_prefix adds them, so the gradient fold's bc
  # = before + p is the unfolded walk's, bit for bit.
  tot, before = [], None
  for u in range(L):
    sub = pl.ds(n * C + u * S, S)
    p = jnp.cumsum(g_ref[b, sub, hd, ks].astype(cm.F32), axis=0)
    if not fold:
      p_ref[b, sub, hd, ks] = p
    if grad_fold:                                      # scale q e^{bc}, bc = before + p
      bc = p if before is None else p + before[None, :]
      qd_ref[b, sub, hd, ks] = (q_ref[b, sub, hd, ks].astype(cm.F32)
                                * (scale * jnp.exp(bc))).astype(qd_ref.dtype)
    elif fold:
      q_f, k_f = q_ref[b, sub, hd, ks].astype(cm.F32), k_ref[b, sub, hd, ks].astype(cm.F32)
      qp_ref[b, sub, hd, ks] = (q_f * jnp.exp(p)).astype(qp_ref.dtype)
      kn_ref[b, sub, hd, ks] = (k_f * jnp.exp(-jnp.maximum(p, -cm.DIAG_DOT_SPAN))).astype(
          kn_ref.dtype)
    else:
      continue
    tot.append(jnp.sum(jnp.where(last, p, 0.0), axis=0))
    if fold:
      tots_ref[b, hd, n, u, ks] = tot[-1]
    before = tot[-1] if before is None else before + tot[-1]
  if fold or grad_fold:
    dl_ref[b, hd, n, ks] = jnp.exp(before)                            # b_last = sum_u T_u
  if fold:
    # The later sub-chunks' totals per sub-chunk as a [L, KD] tile (row u: T_{u+1} + ...
    # + T_{L-1}, added in _common.chunk_suffix's order).
    lrow, acc, after = cm.iota((L, KD), 0), None, jnp.zeros((L, KD), cm.F32)
    for u in range(L - 2, -1, -1):
      acc = tot[L - 1] if acc is None else acc + tot[u + 1]
      after = jnp.where(lrow == u, acc[None, :], after)

  # s: row j of every sub-chunk at once (a [L, KD] tile, rows 16 apart), last row first,
  # accumulated exactly: s_j = g_{j+1} + s_{j+1}. Folding: b_last - bc = s + the later
  # totals, and the 16 steps are unrolled at trace time (the row loads issued ahead).
  def row(i, acc):
    rows = pl.ds(n * C + S - 1 - i, L, stride=S)
    if fold:
      k_f = k_ref[b, rows, hd, ks].astype(cm.F32)
      kd_ref[b, rows, hd, ks] = (k_f * jnp.exp(acc + after)).astype(kd_ref.dtype)
      ks_ref[b, rows, hd, ks] = (k_f * jnp.exp(acc)).astype(ks_ref.dtype)
    else:
      s_ref[b, rows, hd, ks] = acc
    return acc + g_ref[b, rows, hd, ks].astype(cm.F32)

  cm.unrolled(S, unroll, row, jnp.zeros((L, KD), cm.F32))


def chunk_cumsum(g, *, chunk_size, config):
  """(p, s) [B, T, H, K] float32: the inclusive prefix and the exclusive suffix of g
  within each 16-row sub-chunk (module docstring); ``chunk_size`` a multiple of 16."""
  B, T, H, K = g.shape
  C = chunk_size
  KD = cm.block(K, config.cumsum.kd)
  kern = functools.partial(_cumsum_kernel, C=C, KD=KD, fold=False)
  out = jax.ShapeDtypeStruct(g.shape, cm.F32)
  return cm.call(kern, (out, out), (B, H, T // C, K // KD), config=config,
                 num_warps=config.cumsum.warps, num_stages=1, name="gla_chunk_cumsum")(g)


def chunk_decays(g, q, k, *, chunk_size, config):
  """:class:`Decays`: the forward's operands with the decay folded in (module docstring),
  in one launch (tile ``config.decays.kd``): ``qp = q e^{p}``, ``ks = k e^{s}``, ``kn = k
  e^{-max(p, -16)}`` (exact where the diagonal dots use it), ``kd = k e^{b_last - bc}``
  in the input dtype, ``dl = e^{b_last}`` and the sub-chunk totals in float32; p and s
  themselves are not written."""
  B, T, H, K = g.shape
  C = chunk_size
  N = T // C
  KD = cm.block(K, config.decays.kd)
  kern = functools.partial(_cumsum_kernel, C=C, KD=KD, fold=True,
                           unroll=cm.unroll_for(config, cm.SUB))
  qs, kss = jax.ShapeDtypeStruct(g.shape, q.dtype), jax.ShapeDtypeStruct(g.shape, k.dtype)
  out = (qs, kss, kss, kss, jax.ShapeDtypeStruct((B, H, N, K), cm.F32),
         jax.ShapeDtypeStruct((B, H, N, C // cm.SUB, K), cm.F32))
  return Decays(*cm.call(kern, out, (B, H, N, K // KD), config=config,
                         num_warps=config.cumsum.warps, num_stages=1,
                         name="gla_chunk_decays")(g, q, k))


def chunk_cumsum_folded(g, q, *, scale, chunk_size, config):
  """(p, s, qd, dl): :func:`chunk_cumsum`'s p and s (which the backward's other kernels
  read), and the state-gradient walk's operands with the decay folded in (the backward
  with ``config.save_states``): ``qd = scale q e^{bc}`` [B, T, H, K] in q's dtype (what
  the unfolded walk casts to it before its dot) and ``dl = e^{b_last}`` [B, H, N, K]
  float32, both formed from the sub-chunk totals as the unfolded walk forms them."""
  B, T, H, K = g.shape
  C = chunk_size
  N = T // C
  KD = cm.block(K, config.cumsum.kd)
  kern = functools.partial(_cumsum_kernel, C=C, KD=KD, fold=False, grad_fold=True,
                           scale=scale)
  f32 = jax.ShapeDtypeStruct(g.shape, cm.F32)
  out = (f32, f32, jax.ShapeDtypeStruct(g.shape, q.dtype),
         jax.ShapeDtypeStruct((B, H, N, K), cm.F32))
  return cm.call(kern, out, (B, H, N, K // KD), config=config,
                 num_warps=config.cumsum.warps, num_stages=1,
                 name="gla_chunk_cumsum_fold")(g, q)


def walk_params(k, v, *, chunk_size, config, both=False):
  """(grid, kernel keywords) of a state walk: one program per [BK, BV] state tile, BV
  ``config.state.both_bv`` when both walks share the launch (``both``), else
  ``config.state.bv`` (:func:`pallas_kernels.default_config` picks them per shape)."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  BK = cm.block(K, config.state.bk)
  BV = cm.block(V, config.state.both_bv if both else config.state.bv)
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
  return cm.call(kernel, out, grid, config=config, num_warps=config.state.warps,
                 num_stages=config.state.stages, name=name)


def _state_walk(keys, v_ref, h0_ref, h_ref, ht_ref, b, hd, ik, iv, *, C, N, BK, BV, dt):
  """One [BK, BV] state tile walked over the chunks; ``keys(n, t, ks)`` gives chunk n's
  decayed keys ``k e^{b_last - bc}`` [C, BK] and its decay ``e^{b_last}`` [BK]."""
  ks, vs = pl.ds(ik * BK, BK), pl.ds(iv * BV, BV)

  def body(n, state):
    h_ref[b, hd, n, ks, vs] = state.astype(h_ref.dtype)
    t = pl.ds(n * C, C)
    k_dec, decay = keys(n, t, ks)
    inc = cm.dot(k_dec, v_ref[b, t, hd, vs], dt, ta=True)          # [BK, BV]
    return decay[:, None] * state + inc

  ht_ref[b, hd, ks, vs] = jax.lax.fori_loop(0, N, body, h0_ref[b, hd, ks, vs])


def _decayed_keys(k_ref, p_ref, s_ref, b, hd, *, C, BK):
  """``keys`` of :func:`_state_walk` formed from k, p and s (chunk_cumsum's)."""
  blk = cm.iota((C, BK), 0) // cm.SUB

  def keys(n, t, ks):
    tot = cm.sub_totals(p_ref, b, n * C, hd, ks, C // cm.SUB)
    sc = cm.chunk_suffix(s_ref[b, t, hd, ks], tot, blk)           # b_last - bc, [C, BK]
    return (k_ref[b, t, hd, ks].astype(cm.F32) * jnp.exp(sc),
            jnp.exp(cm.chunk_total(tot)))

  return keys


def _state_kernel(k_ref, v_ref, p_ref, s_ref, h0_ref, h_ref, ht_ref, **kw):
  b, hd, ik, iv = (pl.program_id(i) for i in range(4))
  keys = _decayed_keys(k_ref, p_ref, s_ref, b, hd, C=kw["C"], BK=kw["BK"])
  _state_walk(keys, v_ref, h0_ref, h_ref, ht_ref, b, hd, ik, iv, **kw)


def _folded_state_kernel(kd_ref, v_ref, dl_ref, h0_ref, h_ref, ht_ref, **kw):
  b, hd, ik, iv = (pl.program_id(i) for i in range(4))
  keys = lambda n, t, ks: (kd_ref[b, t, hd, ks], dl_ref[b, hd, n, ks])
  _state_walk(keys, v_ref, h0_ref, h_ref, ht_ref, b, hd, ik, iv, **kw)


def state_pass(k, v, p, s, h0, *, chunk_size, config):
  """Returns (h [B, H, N, K, V]: the state entering each chunk, in
  ``state_store_dtype`` (the input dtype with ``config.states_in_input_dtype``, else
  float32), and the final state [B, H, K, V] in float32. ``p``, ``s``: chunk_cumsum's."""
  grid, kw = walk_params(k, v, chunk_size=chunk_size, config=config)
  out = walk_outputs(k, v, chunk_size=chunk_size, config=config, states=True, grads=False)
  return walk_call(functools.partial(_state_kernel, **kw), out, grid, "gla_state_pass",
                   config)(k, v, p, s, h0)


def folded_state_pass(kd, v, dl, h0, *, chunk_size, config):
  """:func:`state_pass` from :func:`chunk_decays`' ``kd`` and ``dl`` (the forward's)."""
  grid, kw = walk_params(kd, v, chunk_size=chunk_size, config=config)
  out = walk_outputs(kd, v, chunk_size=chunk_size, config=config, states=True, grads=False)
  return walk_call(functools.partial(_folded_state_kernel, **kw), out, grid,
                   "gla_state_pass", config)(kd, v, dl, h0)


def _grad_walk(queries, do_ref, dht_ref, dh_ref, dh0_ref, b, hd, ik, iv, *, C, N, BK, BV,
               dt):
  """One [BK, BV] tile of the state's cotangent walked over the chunks in reverse;
  ``queries(n, t, ks)`` gives chunk n's decayed queries ``scale q e^{bc}`` [C, BK] and
  its decay ``e^{b_last}`` [BK]."""
  ks, vs = pl.ds(ik * BK, BK), pl.ds(iv * BV, BV)

  def body(i, dstate):
    n = N - 1 - i
    dh_ref[b, hd, n, ks, vs] = dstate.astype(dh_ref.dtype)
    t = pl.ds(n * C, C)
    q_dec, decay = queries(n, t, ks)
    loc = cm.dot(q_dec, do_ref[b, t, hd, vs], dt, ta=True)       # [BK, BV]
    return decay[:, None] * dstate + loc

  dh0_ref[b, hd, ks, vs] = jax.lax.fori_loop(0, N, body, dht_ref[b, hd, ks, vs])


def _decayed_queries(q_ref, p_ref, b, hd, *, C, BK, scale):
  """``queries`` of :func:`_grad_walk` formed from q and p (chunk_cumsum's)."""
  blk = cm.iota((C, BK), 0) // cm.SUB

  def queries(n, t, ks):
    tot = cm.sub_totals(p_ref, b, n * C, hd, ks, C // cm.SUB)
    bc = cm.chunk_prefix(p_ref[b, t, hd, ks], tot, blk)            # [C, BK]
    return (q_ref[b, t, hd, ks].astype(cm.F32) * (scale * jnp.exp(bc)),
            jnp.exp(cm.chunk_total(tot)))

  return queries


def _state_grad_kernel(q_ref, do_ref, p_ref, dht_ref, dh_ref, dh0_ref, *, scale, **kw):
  b, hd, ik, iv = (pl.program_id(i) for i in range(4))
  queries = _decayed_queries(q_ref, p_ref, b, hd, C=kw["C"], BK=kw["BK"], scale=scale)
  _grad_walk(queries, do_ref, dht_ref, dh_ref, dh0_ref, b, hd, ik, iv, **kw)


def _folded_state_grad_kernel(qd_ref, do_ref, dl_ref, dht_ref, dh_ref, dh0_ref, **kw):
  b, hd, ik, iv = (pl.program_id(i) for i in range(4))
  queries = lambda n, t, ks: (qd_ref[b, t, hd, ks], dl_ref[b, hd, n, ks])
  _grad_walk(queries, do_ref, dht_ref, dh_ref, dh0_ref, b, hd, ik, iv, **kw)


def state_grad_pass(q, do, p, dht, *, scale, chunk_size, config):
  """Returns (dH [B, H, N, K, V] cotangent of the state leaving each chunk, dh0 [B, H, K, V])."""
  grid, kw = walk_params(q, do, chunk_size=chunk_size, config=config)
  out = walk_outputs(q, do, chunk_size=chunk_size, config=config, states=False, grads=True)
  return walk_call(functools.partial(_state_grad_kernel, scale=scale, **kw), out, grid,
                   "gla_state_grad_pass", config)(q, do, p, dht)


def folded_state_grad_pass(qd, do, dl, dht, *, chunk_size, config):
  """:func:`state_grad_pass` from :func:`chunk_cumsum_folded`'s ``qd`` and ``dl`` (the
  scale is in qd): each chunk step a dot and a scale, no exp in the chain."""
  grid, kw = walk_params(qd, do, chunk_size=chunk_size, config=config)
  out = walk_outputs(qd, do, chunk_size=chunk_size, config=config, states=False, grads=True)
  return walk_call(functools.partial(_folded_state_grad_kernel, **kw), out, grid,
                   "gla_state_grad_pass", config)(qd, do, dl, dht)


def _both_kernel(k_ref, v_ref, q_ref, do_ref, p_ref, s_ref, h0_ref, dht_ref, h_ref, ht_ref,
                 dh_ref, dh0_ref, *, B, scale, **kw):
  pid, hd, ik, iv = (pl.program_id(i) for i in range(4))
  b = pid % B
  jax.lax.cond(
      pid < B,
      lambda: _state_walk(_decayed_keys(k_ref, p_ref, s_ref, b, hd, C=kw["C"], BK=kw["BK"]),
                          v_ref, h0_ref, h_ref, ht_ref, b, hd, ik, iv, **kw),
      lambda: _grad_walk(_decayed_queries(q_ref, p_ref, b, hd, C=kw["C"], BK=kw["BK"],
                                          scale=scale),
                         do_ref, dht_ref, dh_ref, dh0_ref, b, hd, ik, iv, **kw))


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
