"""The blockwise core of softmax attention in XLA ops, which every method runs.

The core keeps flash attention's running statistics per query row (the running max ``m``,
the running sum ``l`` of ``exp(s - m)`` and the unnormalised output ``acc``, all float32)
and folds one block of keys into them (:func:`fold`); :func:`finish` divides. A key block
that no query of the block can see (above the causal diagonal, outside the window) is
skipped under ``lax.cond`` (:func:`fold_if_visible`), and a folded block is recomputed in
the backward (``jax.checkpoint``: the residuals are the running statistics, not the
block's probabilities). Scores are XLA dots in float32
(``precision=HIGHEST`` for float32 inputs); a query that sees no key outputs zero.

:func:`attend` runs the keys in blocks of ``block_size`` under one ``lax.scan`` (the
``"xla"`` backend of :mod:`zeco_jax.ops.attention.op`); the all-gather and ring methods
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
  """Queries ``qg`` against all of ``k``, ``v`` in key blocks of ``block_size`` (one
  ``lax.scan``, skipping invisible blocks): the folded :class:`Stats`."""
  B, Tq, Hkv, G, D = qg.shape
  Tk = k.shape[1]
  bs = block_size if Tk % block_size == 0 else Tk
  n = Tk // bs
  blocks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], n, bs, *x.shape[2:]), 1, 0)

  def step(stats, kb):
    kk, vv, kd, kp = kb
    return fold_if_visible(stats, qg, kk, vv, q_doc, q_pos, kd, kp, scale=scale,
                           causal=causal, window=window), None

  stats, _ = lax.scan(step, init_stats(B, Hkv, G, Tq, D, qg, k, v, q_doc, k_doc),
                      (blocks(k), blocks(v), blocks(k_doc), blocks(k_pos)))
  return stats


__all__ = ["Stats", "attend", "block_visible", "finish", "fold", "fold_if_visible",
           "group_queries", "init_stats"]
