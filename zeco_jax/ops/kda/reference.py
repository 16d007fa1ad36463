"""Kimi Delta Attention's references: the float32 token loop (the spec) and the float64 truth.

Per token and head (``docs/design.md`` §13; FLA's ``naive_recurrent_kda``: the per-channel
decay first, then the delta update)::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
    o_t = scale S_t^T q_t

with g_t ``[K]`` (<= 0) a log-decay per key channel: the rows of the state decay
separately, as in GLA, and the write is the delta rule's, as in Gated DeltaNet.

* :func:`recurrent_kda` walks the tokens with ``lax.scan`` in float32: the definition,
  slow, and it keeps a state per token for autodiff (short sequences only).
* :func:`kda_float64` / :func:`kda_float64_documents`: the same loop and its hand-written
  reverse pass in numpy float64 (no jax x64 mode), the truth tests measure every path
  against.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from zeco_jax import segments
from zeco_jax._linalg import HI as _HI
from zeco_jax._linalg import l2norm
from zeco_jax.ops.kda.op import check_inputs


def token_step(S_BxHxKxV, q_t, k_t, v_t, g_t, beta_t, scale):
  """One token of the recurrence (float32): ``(S_t, o_t)`` from ``S_{t-1}``.

  Decay the rows of the state by ``exp(g_t)`` (per key channel), read ``k_t^T S``, write
  ``beta_t (v_t - k_t^T S)`` along ``k_t``; ``o_t = scale S_t^T q_t``."""
  S_BxHxKxV = jnp.exp(g_t)[..., :, None] * S_BxHxKxV
  kS = jnp.einsum("bhk,bhkv->bhv", k_t, S_BxHxKxV, precision=_HI)
  u = beta_t[..., None] * (v_t - kS)
  S_BxHxKxV = S_BxHxKxV + k_t[..., :, None] * u[..., None, :]
  return S_BxHxKxV, scale * jnp.einsum("bhk,bhkv->bhv", q_t, S_BxHxKxV, precision=_HI)


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None,
                  output_final_state=False, use_qk_l2norm=False, segment_ids=None):
  """Token-by-token Kimi Delta Attention in float32 (the spec; FLA's ``naive_recurrent_kda``).

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-decay per key
      channel (<= 0); beta: ``[B, T, H]`` in (0, 1).
    scale: defaults to ``K ** -0.5``. initial_state: ``[B, H, K, V]`` or None (zeros).
    output_final_state: also return the float32 state after the last token.
    use_qk_l2norm: l2-normalise q and k over K first (FLA's ``use_qk_l2norm_in_kernel``).
    segment_ids: None or integer ``[B, T]`` packed documents (docs/design.md §10): the
      state is zero before every document start at t > 0; a negative id is padding (no
      write, zero output).

  Returns:
    ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; the float32 state after the
    last token ``[B, H, K, V]`` if ``output_final_state``, else None.
  """
  name = "recurrent_kda"
  args = check_inputs(q, k, v, g, beta, initial_state, scale, name=name)
  B, H, K, V, scale = args.B, args.H, args.K, args.V, args.scale
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, B, args.T, name=name)
    q, k, g = segments.apply(q, k, g, segment_ids)
  f32 = jnp.float32
  h0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)

  xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v, g, beta))
  S, o_TxBxHxV = lax.scan(lambda S, x: token_step(S, *x, scale), h0, xs)
  return jnp.moveaxis(o_TxBxHxV, 0, 1).astype(v.dtype), (S if output_final_state else None)


def kda_float64(q, k, v, g, beta, h0, do, dht, scale=None):
  """Token loop S_t = (I - beta_t k_t k_t^T) Diag(e^{g_t}) S_{t-1} + beta_t k_t v_t^T,
  o_t = scale S_t^T q_t, in float64; returns (o, final, grads) with grads the vjp of
  (do, dht) for q, k, v, g, beta and h0 (when given). ``dht`` None: zero."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, g, beta, do = map(f, (q, k, v, g, beta, do))
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  S = np.zeros((B, H, K, V)) if h0 is None else f(h0).copy()
  states, o = [S], np.zeros((B, T, H, V))
  for t in range(T):
    Sd = np.exp(g[:, t])[..., :, None] * S                    # rows decayed per channel
    kt = k[:, t]
    u = beta[:, t][..., None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", kt, Sd))
    S = Sd + kt[..., :, None] * u[..., None, :]
    o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
    states.append(S)
  final = S
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
  dS = np.zeros((B, H, K, V)) if dht is None else f(dht).copy()
  for t in reversed(range(T)):
    S_prev, S_t = states[t], states[t + 1]
    a = np.exp(g[:, t])[..., :, None]                        # [B, H, K, 1]
    Sd = a * S_prev
    kt, bt = k[:, t], beta[:, t][..., None]
    # o_t = scale S_t^T q_t
    dS = dS + scale * q[:, t][..., :, None] * do[:, t][..., None, :]
    dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", S_t, do[:, t])
    # S_t = Sd + k_t u^T, u = beta (v - Sd^T k_t)
    r = v[:, t] - np.einsum("bhk,bhkv->bhv", kt, Sd)
    u = bt * r
    du = np.einsum("bhkv,bhk->bhv", dS, kt)
    dk[:, t] += np.einsum("bhkv,bhv->bhk", dS, u)
    dbeta[:, t] = np.sum(du * r, -1)
    dv[:, t] = bt * du
    dr_read = -bt * du                                       # cotangent of Sd^T k_t
    dSd = dS + kt[..., :, None] * dr_read[..., None, :]
    dk[:, t] += np.einsum("bhkv,bhv->bhk", Sd, dr_read)
    # Sd = Diag(e^{g_t}) S_{t-1}
    dg[:, t] = np.sum(dSd * Sd, axis=-1)
    dS = a * dSd
  grads = dict(q=dq, k=dk, v=dv, g=dg, beta=dbeta)
  if h0 is not None:
    grads["h0"] = dS
  return o, final, grads


def kda_float64_documents(q, k, v, g, beta, h0, do, dht, segment_ids, scale=None):
  """:func:`kda_float64` run document by document
  (:func:`zeco_jax.segments.delta_float64_documents`): every document from zero except the
  one holding token 0 (from h0); padding gets zero outputs and gradients."""
  return segments.delta_float64_documents(kda_float64, q, k, v, g, beta, h0, do, dht,
                                          segment_ids, scale)
