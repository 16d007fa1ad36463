"""Softmax attention's spec: the full masked softmax in plain jnp, and its float64 truth.

Conventions (FLA / flash-attn layout): q ``[B, T, H, D]``, k and v ``[B, T, Hkv, D]`` with
Hkv dividing H (grouped queries: query head h reads key head ``h // (H // Hkv)``); the
output ``[B, T, H, D]`` in v's dtype; ``scale`` defaults to ``D ** -0.5``.

Masks, all applied to the scores before the softmax:

* ``causal``: query t sees keys s <= t;
* ``segment_ids`` (``zeco_jax.segments``: a document is a run of equal non-negative ids, a
  negative id is padding): a query sees only keys of its own document; a padding query
  sees nothing and outputs zero;
* ``window``: query t sees keys s > t - window (a sliding window of ``window`` tokens,
  itself included).

A query that sees no key outputs zero (never NaN).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from zeco_jax._linalg import HI


def document_numbers(segment_ids, B: int, T: int):
  """int32 ``[B, T]``: each token's document, counted from 0 along the row (a run of equal
  non-negative ids is one document), -1 for padding; ``zeros`` without ids."""
  if segment_ids is None:
    return jnp.zeros((B, T), jnp.int32)
  ids = jnp.asarray(segment_ids)
  start = jnp.concatenate([jnp.ones((B, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  doc = jnp.cumsum(start.astype(jnp.int32), axis=1) - 1
  return jnp.where(ids < 0, -1, doc)


def visible(q_doc, q_pos, k_doc, k_pos, *, causal: bool, window):
  """bool ``[B, Tq, Tk]``: which key each query sees (the module's masks)."""
  mask = (q_doc[:, :, None] == k_doc[:, None, :]) & (q_doc[:, :, None] >= 0)
  if causal:
    mask = mask & (k_pos[:, None, :] <= q_pos[:, :, None])
  if window is not None:
    mask = mask & (q_pos[:, :, None] - k_pos[:, None, :] < window)
  return mask


def attention_reference(q, k, v, *, causal: bool = True, segment_ids=None, scale=None,
                        window=None):
  """The whole ``[T, T]`` masked softmax in float32 (the spec; O(T^2) memory)."""
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  scale = D ** -0.5 if scale is None else scale
  doc = document_numbers(segment_ids, B, T)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = visible(doc, pos, doc, pos, causal=causal, window=window)[:, None, None]
  f32 = jnp.float32
  qg = q.astype(f32).reshape(B, T, Hkv, H // Hkv, D)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(f32), precision=HI) * scale
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(f32), precision=HI)
  return o.reshape(B, T, H, D).astype(v.dtype)


def attention_float64(q, k, v, do, *, causal=True, segment_ids=None, scale=None, window=None):
  """Float64 truth: ``(o, {"q": dq, "k": dk, "v": dv})``, the gradients the vjp of ``do``.

  The softmax's backward written out (dP = dO V^T, dS = P (dP - rowsum(dO O)))."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, do = map(f, (q, k, v, do))
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  G = H // Hkv
  scale = D ** -0.5 if scale is None else scale
  doc = np.asarray(document_numbers(segment_ids, B, T))
  pos = np.broadcast_to(np.arange(T), (B, T))
  mask = np.asarray(visible(jnp.asarray(doc), jnp.asarray(pos), jnp.asarray(doc),
                            jnp.asarray(pos), causal=causal, window=window))[:, None, None]
  qg = q.reshape(B, T, Hkv, G, D)
  dog = do.reshape(B, T, Hkv, G, D)
  s = np.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
  s = np.where(mask, s, -np.inf)
  m = s.max(axis=-1, keepdims=True)
  p = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
  l = p.sum(axis=-1, keepdims=True)
  p = p / np.where(l > 0, l, 1.0)
  o = np.einsum("bhgqk,bkhd->bqhgd", p, v)
  dp = np.einsum("bqhgd,bkhd->bhgqk", dog, v)
  ds = p * (dp - np.einsum("bqhgd,bqhgd->bhgq", dog, o)[..., None])
  dq = np.einsum("bhgqk,bkhd->bqhgd", ds, k) * scale
  dk = np.einsum("bhgqk,bqhgd->bkhd", ds, qg) * scale
  dv = np.einsum("bhgqk,bqhgd->bkhd", p, dog)
  return o.reshape(B, T, H, D), {"q": dq.reshape(B, T, H, D), "k": dk, "v": dv}


__all__ = ["attention_float64", "attention_reference", "document_numbers", "visible"]
