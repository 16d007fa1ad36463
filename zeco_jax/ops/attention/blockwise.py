"""The blockwise core of softmax attention in XLA ops, which every method runs.

The core keeps flash attention's running statistics per query row (the running max ``m``,
the running sum ``l`` of ``exp(s - m)`` and the unnormalised output ``acc``, all float32)
and folds one block of keys into them (:func:`fold`); :func:`finish` divides. A key block
that no query of the block can see (above the causal diagonal, outside the window) is
skipped under ``lax.cond`` (:func:`fold_if_visible`), and a folded block is recomputed in
the backward (``jax.checkpoint``: the residuals are the running statistics, not the
block's probabilities). Scores are XLA dots in float32
(``precision=HIGHEST`` for float32 inputs); a query that sees no key outputs zero.

:func:`attend` runs queries and keys in blocks of ``block_size`` (the ``"xla"`` backend
of :mod:`zeco_jax.ops.attention.op`); the all-gather and ring methods
fold their blocks with :func:`fold_if_visible` directly.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zeco_jax._linalg import HI
from zeco_jax._vma import match_varying
from zeco_jax.ops.attention.reference import visible

NEG = -1e30          # a masked score: finite, so exp(NEG - m) is 0 and never NaN


class Stats(NamedTuple):
  """Running softmax statistics of a block of queries, grouped by key head:
  ``acc`` ``[B, Hkv, G, Tq, D]``, ``m`` and ``l`` ``[B, Hkv, G, Tq]``, float32."""
  acc: jax.Array
  m: jax.Array
  l: jax.Array


def init_stats(B, Hkv, G, Tq, D, *likes) -> Stats:
  """Nothing folded yet; varying over the manual axes any of ``likes`` varies over (the
  carry of a scan inside a shard_map)."""
  f32 = jnp.float32
  stats = Stats(jnp.zeros((B, Hkv, G, Tq, D), f32), jnp.full((B, Hkv, G, Tq), NEG, f32),
                jnp.zeros((B, Hkv, G, Tq), f32))
  return jax.tree.map(lambda x: match_varying(x, *likes), stats)


def group_queries(q, Hkv):
  """``[B, Tq, H, D]`` -> ``[B, Tq, Hkv, G, D]`` (query head h under key head h // G)."""
  B, Tq, H, D = q.shape
  return q.reshape(B, Tq, Hkv, H // Hkv, D)


def fold(stats: Stats, qg, k, v, q_doc, q_pos, k_doc, k_pos, *, scale, causal, window):
  """``stats`` with one key block folded in (flash attention's update)."""
  mask = visible(q_doc, q_pos, k_doc, k_pos, causal=causal, window=window)[:, None, None]
  prec = HI if qg.dtype == jnp.float32 else None
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=prec,
                 preferred_element_type=jnp.float32) * scale
  s = jnp.where(mask, s, NEG)
  m_new = lax.stop_gradient(jnp.maximum(stats.m, jnp.max(s, axis=-1)))
  p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
  corr = jnp.exp(stats.m - m_new)
  pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, precision=prec,
                  preferred_element_type=jnp.float32)
  return Stats(stats.acc * corr[..., None] + pv, m_new, stats.l * corr + jnp.sum(p, -1))


def block_visible(q_pos_first, q_pos_last, k_pos_first, k_pos_last, *, causal, window):
  """Whether any query of a block may see any key of another (positions bound the block)."""
  ok = jnp.bool_(True)
  if causal:
    ok = ok & (k_pos_first <= q_pos_last)
  if window is not None:
    ok = ok & (q_pos_first - k_pos_last < window)
  return ok


def fold_if_visible(stats, qg, k, v, q_doc, q_pos, k_doc, k_pos, *, scale, causal, window):
  """:func:`fold`, skipped (``lax.cond``) when no query of the block sees a key of it;
  positions are contiguous runs (first and last bound them)."""
  run = block_visible(q_pos[0, 0], q_pos[0, -1], k_pos[0, 0], k_pos[0, -1], causal=causal,
                      window=window)
  # Inside a shard_map both branches must vary over the same manual axes as the inputs.
  stats = jax.tree.map(lambda x: match_varying(x, qg, k, v, q_doc, k_doc), stats)
  # Rematerialised: the backward recomputes the block's scores from the statistics
  # before it (flash attention's trade), so no [Tq, Tk] probabilities are kept per block.
  folded = jax.checkpoint(functools.partial(fold, scale=scale, causal=causal, window=window))
  return lax.cond(run, lambda st: folded(st, qg, k, v, q_doc, q_pos, k_doc, k_pos),
                  lambda st: st, stats)


def finish(stats: Stats, dtype):
  """``[B, Tq, H, D]`` in ``dtype``: the output of the folded statistics."""
  o = stats.acc / jnp.where(stats.l > 0, stats.l, 1.0)[..., None]
  B, Hkv, G, Tq, D = o.shape
  return jnp.moveaxis(o, 3, 1).reshape(B, Tq, Hkv * G, D).astype(dtype)


def attend(qg, k, v, q_doc, q_pos, k_doc, k_pos, *, scale, causal, window, block_size):
  """Queries ``qg`` against all of ``k``, ``v``: the folded :class:`Stats`.

  Queries and keys both in blocks of ``block_size`` (the whole length where it does not
  divide it): one ``lax.map`` over the query blocks, each a ``lax.scan`` over the key
  blocks that skips a pair whose queries see none of its keys, so causal attention does
  about half the T^2 work and a window of w about T (w + block_size)."""
  B, Tq, Hkv, G, D = qg.shape
  Tk = k.shape[1]
  bk = block_size if Tk % block_size == 0 else Tk
  bq = block_size if Tq % block_size == 0 else Tq
  split = lambda x, n, b: jnp.moveaxis(x.reshape(x.shape[0], n, b, *x.shape[2:]), 1, 0)
  keys = tuple(split(x, Tk // bk, bk) for x in (k, v, k_doc, k_pos))

  def query_block(qb):
    qq, qd, qp = qb

    def step(stats, kb):
      kk, vv, kd, kp = kb
      return fold_if_visible(stats, qq, kk, vv, qd, qp, kd, kp, scale=scale, causal=causal,
                             window=window), None

    stats, _ = lax.scan(step, init_stats(B, Hkv, G, bq, D, qq, k, v, qd, k_doc), keys)
    return stats

  nq = Tq // bq
  if nq == 1:
    return query_block((qg, q_doc, q_pos))
  stats = lax.map(query_block, tuple(split(x, nq, bq) for x in (qg, q_doc, q_pos)))
  # [nq, B, Hkv, G, bq, ...] -> [B, Hkv, G, Tq, ...]
  return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], Tq, *x.shape[5:]),
                      stats)


__all__ = ["Stats", "attend", "block_visible", "finish", "fold", "fold_if_visible",
           "group_queries", "init_stats"]
