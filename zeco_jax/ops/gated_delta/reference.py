"""Gated DeltaNet's references: the float32 token loop (the spec) and the float64 truth.

Per token and head (``docs/design.md`` §9; FLA's ``gated_delta_rule`` conventions)::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t

* :func:`recurrent_gated_delta_rule` walks the tokens with ``lax.scan`` in float32: the
  definition, slow, and it keeps a state per token for autodiff (short sequences only).
* :func:`gdn_float64` / :func:`gdn_float64_documents`: the same loop and its hand-written
  reverse pass in numpy float64 (no jax x64 mode), the truth tests and benchmarks measure
  every path against.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from zeco_jax import segments
from zeco_jax._linalg import HI as _HI
from zeco_jax.ops.gated_delta.op import check_inputs, l2norm


def token_step(S_BxHxKxV, q_t, k_t, v_t, g_t, beta_t, scale):
  """One token of the recurrence (float32): ``(S_t, o_t)`` from ``S_{t-1}``.

  ``S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, written as the delta
  rule: decay, read ``k_t^T S``, write ``beta_t (v_t - k_t^T S)`` along ``k_t``."""
  S_BxHxKxV = jnp.exp(g_t)[..., None, None] * S_BxHxKxV
  kS = jnp.einsum("bhk,bhkv->bhv", k_t, S_BxHxKxV, precision=_HI)
  u = beta_t[..., None] * (v_t - kS)
  S_BxHxKxV = S_BxHxKxV + k_t[..., :, None] * u[..., None, :]
  return S_BxHxKxV, scale * jnp.einsum("bhk,bhkv->bhv", q_t, S_BxHxKxV, precision=_HI)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm=False,
                               segment_ids=None):
  """Token-by-token Gated DeltaNet in float32 (the spec; FLA's ``fused_recurrent`` form).

  ``segment_ids``: None or integer ``[B, T]`` packed documents, as for GLA
  (docs/design.md §10): the state is zero before every document start at t > 0; a
  negative id is padding (no write, zero output).

  Returns ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; the float32 state after
  the last token ``[B, H, K, V]`` if ``output_final_state``, else None.
  """
  args = check_inputs(q, k, v, g, beta, initial_state, scale,
                      name="recurrent_gated_delta_rule")
  B, H, K, V, scale = args.B, args.H, args.K, args.V, args.scale
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, B, args.T, name="recurrent_gated_delta_rule")
    q, k, g = segments.apply(q, k, g, segment_ids)
  f32 = jnp.float32
  h0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)

  xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v, g, beta))
  S, o_TxBxHxV = lax.scan(lambda S, x: token_step(S, *x, scale), h0, xs)
  return jnp.moveaxis(o_TxBxHxV, 0, 1).astype(v.dtype), (S if output_final_state else None)


def gdn_float64(q, k, v, g, beta, h0, do, dht, scale=None):
  """Token loop S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
  o_t = scale S_t^T q_t, in float64; returns (o, final, grads) with grads the vjp of
  (do, dht) for q, k, v, g, beta, h0."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, g, beta, do, dht = map(f, (q, k, v, g, beta, do, dht))
  B, T, H, K = q.shape
  V = v.shape[-1]
  scale = K ** -0.5 if scale is None else scale
  S = np.zeros((B, H, K, V)) if h0 is None else f(h0).copy()
  states, o = [S], np.zeros((B, T, H, V))
  for t in range(T):
    a = np.exp(g[:, t])[..., None, None]
    Sd = a * S
    kt = k[:, t]
    u = beta[:, t][..., None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", kt, Sd))
    S = Sd + kt[..., :, None] * u[..., None, :]
    o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
    states.append(S)
  final = S
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  dg, dbeta = np.zeros_like(g), np.zeros_like(beta)
  dS = dht.copy()
  for t in reversed(range(T)):
    S_prev, S_t = states[t], states[t + 1]
    a = np.exp(g[:, t])[..., None, None]
    Sd = a * S_prev
    kt, bt = k[:, t], beta[:, t][..., None]
    dS = dS + scale * q[:, t][..., :, None] * do[:, t][..., None, :]
    dq[:, t] = scale * np.einsum("bhkv,bhv->bhk", S_t, do[:, t])
    r = v[:, t] - np.einsum("bhk,bhkv->bhv", kt, Sd)
    u = bt * r
    dSd = dS.copy()
    dk[:, t] += np.einsum("bhkv,bhv->bhk", dS, u)
    du = np.einsum("bhkv,bhk->bhv", dS, kt)
    dbeta[:, t] = np.sum(du * r, -1)
    dv[:, t] = bt * du
    dw = -bt * du
    dSd += kt[..., :, None] * dw[..., None, :]
    dk[:, t] += np.einsum("bhkv,bhv->bhk", Sd, dw)
    dg[:, t] = np.sum(dSd * Sd, axis=(-2, -1))
    dS = a * dSd
  grads = dict(q=dq, k=dk, v=dv, g=dg, beta=dbeta)
  if h0 is not None:
    grads["h0"] = dS
  return o, final, grads


def gdn_float64_documents(q, k, v, g, beta, h0, do, dht, segment_ids, scale=None):
  """:func:`gdn_float64` run document by document
  (:func:`zeco_jax.segments.delta_float64_documents`): every document from zero except the
  one holding token 0 (from h0); padding gets zero outputs and gradients."""
  return segments.delta_float64_documents(gdn_float64, q, k, v, g, beta, h0, do, dht,
                                          segment_ids, scale)
