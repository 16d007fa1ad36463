"""Reference GLA in plain jnp, float32 math: the spec every fast path is tested against.

Two forms of the same function (docs/design.md §1 and §2):

* :func:`recurrent_gla` walks the tokens one by one with ``lax.scan``. It is the
  definition and nothing else; it keeps a ``[K, V]`` state per token for autodiff, so
  use it on short sequences only.
* :func:`chunk_gla_reference` is the chunked form written the obvious way: inside a
  chunk every pair ``(r, i)`` gets its exact decay ``exp(b_r - b_i)`` in log space
  (a ``[C, C, K]`` tensor per chunk, each exponent the sum of g over ``(i, r]``, never a
  difference of cumsums), between chunks a ``lax.scan`` carries the state.
  It is stable under any decay, and slow and memory-hungry on purpose.

Neither is meant to be fast; :func:`zeco_jax.chunk_gla` is. :func:`gla_float64` is the
float64 truth (numpy, forward and vjp) the tests and benchmarks measure every path against.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from zeco_jax import _checks
from zeco_jax import segments
from zeco_jax._linalg import HI as _HI


def recurrent_gla(q, k, v, g=None, *, scale=None, initial_state=None,
                  output_final_state=False, chunk_size=64, segment_ids=None):
  """Token-by-token GLA: ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``.

  Args:
    q, k: ``[B, T, H, K]``.  v: ``[B, T, H, V]``.
    g: log-decay, ``[B, T, H, K]`` (per dimension), ``[B, T, H]`` (scalar per head) or
      None (no decay). Must be <= 0.
    scale: defaults to ``K ** -0.5``.
    initial_state: ``[B, H, K, V]`` or None (zeros).
    output_final_state: also return the state after the last token.
    chunk_size: accepted for signature parity with the chunked ops; unused.
    segment_ids: None or integer ``[B, T]``, packed documents (:mod:`zeco_jax.segments`,
      ``docs/design.md`` §10): at a start t > 0 the state is set to zero before token t
      writes (``S_t = k_t v_t^T``); padding (a negative id) leaves the state unchanged and
      outputs zero. Here the reset is exact (a select), not the chunked ops' sentinel
      decay.

  Returns:
    ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state ``[B, H, K, V]``
    float32, or None unless ``output_final_state``.
  """
  del chunk_size
  args = _checks.check_gla_inputs(q, k, v, g, initial_state, scale, name="recurrent_gla")
  B, T, H, K, V, scale = args.B, args.T, args.H, args.K, args.V, args.scale
  f32 = jnp.float32
  q_, k_, v_ = (x.astype(f32) for x in (q, k, v))
  g_ = _checks.full_log_decay(g, B, T, H, K)
  h0 = (jnp.zeros((B, H, K, V), f32) if initial_state is None
        else initial_state.astype(f32))
  if segment_ids is None:
    reset = pad = jnp.zeros((B, T), bool)
  else:
    segments.check_segment_ids(segment_ids, B, T, name="recurrent_gla")
    reset, pad = segments.resets(segment_ids), segments.padding_mask(segment_ids)

  def step(S_BxHxKxV, xs):
    q_t, k_t, v_t, g_t, reset_t, pad_t = xs
    keep = ~pad_t[:, None, None, None]
    decayed = jnp.where(reset_t[:, None, None, None], 0.0, jnp.exp(g_t)[..., None] * S_BxHxKxV)
    S_BxHxKxV = jnp.where(keep, decayed + k_t[..., :, None] * v_t[..., None, :], S_BxHxKxV)
    o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, S_BxHxKxV, precision=_HI)
    return S_BxHxKxV, jnp.where(keep[..., 0], o_t, 0.0)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  S, o_TxBxHxV = lax.scan(step, h0, tuple(map(time_major, (q_, k_, v_, g_, reset, pad))))
  o = jnp.moveaxis(o_TxBxHxV, 0, 1).astype(v.dtype)
  return o, (S if output_final_state else None)


def chunk_gla_reference(q, k, v, g=None, *, scale=None, initial_state=None,
                        output_final_state=False, chunk_size=64, segment_ids=None):
  """Chunked GLA with exact log-space decays inside each chunk (docs/design.md §2).

  Same signature and result as :func:`recurrent_gla`; any ``T`` (padded internally with
  ``k = v = 0`` and ``g = 0``, which leaves the state unchanged). ``segment_ids`` as in
  :func:`zeco_jax.chunk_gla` (the reset as a sentinel decay, docs/design.md §10).
  """
  args = _checks.check_gla_inputs(q, k, v, g, initial_state, scale, name="chunk_gla_reference",
                                  chunk_size=chunk_size)
  B, T, H, K, V, scale, C = args.B, args.T, args.H, args.K, args.V, args.scale, chunk_size
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, B, T, name="chunk_gla_reference")
    q, k, g = segments.apply(q, k, g, segment_ids)
  f32 = jnp.float32
  g_ = _checks.full_log_decay(g, B, T, H, K)
  q_, k_, v_, g_ = (_checks.pad_time(x.astype(f32), C) for x in (q, k, v, g_))
  N = q_.shape[1] // C
  # [B, T, H, D] -> [N, B, H, C, D]: chunk-major so lax.scan walks the chunks.
  to_chunks = lambda x: x.reshape(B, N, C, H, -1).transpose(1, 0, 3, 2, 4)
  qc, kc, vc, gc = map(to_chunks, (q_, k_, v_, g_))
  # Every exponent is a sum of same-sign g's over the interval it spans (never a difference
  # b_r - b_i of cumsums: it cancels in float32 once the chunk holds a large log-decay).
  bc = jnp.cumsum(gc, axis=-2)                     # b_r: g over [chunk start, r]
  g_next = jnp.concatenate([gc[..., 1:, :], jnp.zeros_like(gc[..., :1, :])], axis=-2)
  to_end = jnp.flip(jnp.cumsum(jnp.flip(g_next, -2), axis=-2), -2)   # g over (i, chunk end]
  causal = jnp.tril(jnp.ones((C, C), bool))
  after = ~causal.T                                # [r, i]: r > i
  h0 = (jnp.zeros((B, H, K, V), f32) if initial_state is None
        else initial_state.astype(f32))

  def chunk(h_BxHxKxV, xs):
    q_c, k_c, v_c, g_c, b_c, e_c = xs             # [B, H, C, D]
    # Exact pairwise decay exp(g over (i, r]): a cumsum along r of g masked to r > i,
    # masked to i <= r before exp (no overflow).
    within = jnp.cumsum(jnp.where(after[:, :, None], g_c[..., :, None, :], 0.0), axis=-3)
    decay = jnp.exp(jnp.where(causal[:, :, None], within, -jnp.inf))   # [B, H, C, C, K]
    scores = jnp.einsum("bhrk,bhik,bhrik->bhri", q_c, k_c, decay, precision=_HI)
    o = scale * (jnp.einsum("bhrk,bhkv->bhrv", q_c * jnp.exp(b_c), h_BxHxKxV, precision=_HI)
                 + jnp.einsum("bhri,bhiv->bhrv", scores, v_c, precision=_HI))
    h_next = (jnp.exp(b_c[..., -1, :])[..., None] * h_BxHxKxV
              + jnp.einsum("bhik,bhiv->bhkv", k_c * jnp.exp(e_c), v_c, precision=_HI))
    return h_next, o

  S, oc = lax.scan(chunk, h0, (qc, kc, vc, gc, bc, to_end))
  o = oc.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T].astype(v.dtype)
  return o, (S if output_final_state else None)


def gla_float64(q, k, v, g, h0, do, dht, scale):
  """The float64 truth, in numpy (no jax x64 mode): ``(o, final state, grads)`` with
  ``grads`` the vjp of ``(do, dht)`` for q, k, v, g (``[B, T, H, K]`` or ``[B, T, H]``)
  and h0, from the token loop and its hand-written reverse pass.

  S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t (docs/design.md §1).
  ``dht`` None: no final-state cotangent. Tests and benchmarks share it."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, g, h0, do = map(f, (q, k, v, g, h0, do))
  dS = np.zeros(h0.shape) if dht is None else f(dht)
  B, T, H, K = q.shape
  gk = np.broadcast_to(g[..., None], q.shape) if g.ndim == 3 else g
  S = h0
  states = [S]
  o = np.zeros(v.shape)
  for t in range(T):
    S = np.exp(gk[:, t])[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
    states.append(S)
    o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
  dq, dk, dv, dg = (np.zeros(x.shape) for x in (q, k, v, gk))
  for t in reversed(range(T)):
    dS = dS + scale * q[:, t, :, :, None] * do[:, t, :, None, :]
    dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", states[t + 1], do[:, t])
    dk[:, t] = np.einsum("bhkv,bhv->bhk", dS, v[:, t])
    dv[:, t] = np.einsum("bhkv,bhk->bhv", dS, k[:, t])
    decay = np.exp(gk[:, t])
    dg[:, t] = decay * np.sum(states[t] * dS, -1)
    dS = decay[..., None] * dS
  if g.ndim == 3:
    dg = dg.sum(-1)
  return o, S, dict(q=dq, k=dk, v=dv, g=dg, h0=dS)


def gla_float64_documents(q, k, v, g, h0, do, dht, segment_ids, scale):
  """:func:`gla_float64` on packed rows (docs/design.md §10): every document alone, from
  ``h0`` for the one holding token 0 and from zero for every other; padding gets zero
  outputs and gradients; the final state is the last document's. ``g``, ``h0``, ``dht``
  may be None (no decay, zeros)."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, do = map(f, (q, k, v, do))
  B, T, H, K = q.shape
  g = np.zeros((B, T, H)) if g is None else f(g)
  h0 = np.zeros((B, H, K, v.shape[-1])) if h0 is None else f(h0)
  dht = np.zeros(h0.shape) if dht is None else f(dht)
  o, final = np.zeros(v.shape), np.array(h0)
  grads = dict(q=np.zeros(q.shape), k=np.zeros(k.shape), v=np.zeros(v.shape),
               g=np.zeros(g.shape), h0=np.array(dht))
  for b in range(B):
    docs = segments.document_spans(np.asarray(segment_ids)[b])
    for n, (s, e) in enumerate(docs):
      first, last = s == 0, n == len(docs) - 1
      start = h0[b:b + 1] if first else np.zeros((1,) + h0.shape[1:])
      sl = lambda x: x[b:b + 1, s:e]
      o_d, S_d, g_d = gla_float64(sl(q), sl(k), sl(v), sl(g), start, sl(do),
                                  dht[b:b + 1] if last else None, scale)
      o[b, s:e] = o_d[0]
      if last:
        final[b] = S_d[0]
      for name in "qkvg":
        grads[name][b, s:e] = g_d[name][0]
      if first:
        grads["h0"][b] = g_d["h0"][0]
    if docs and docs[0][0] != 0:       # h0 is dropped at the first document start
      grads["h0"][b] = 0.0
  return o, final, grads
