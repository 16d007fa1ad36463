"""``fused_recurrent_gla``: GLA token by token, FLA's name and argument order, for decoding.

A decode step is ``T = 1``: the state ``[B, H, K, V]`` (float32) is the whole context of a
layer, so each new token costs O(1) in the context length. For a prompt use the chunked op
(:func:`zeco_jax.chunk_gla`, ``output_final_state=True``) and continue from its state here:
both compute the same recurrence.

    S_t = diag(exp(gk_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T,   o_t = scale * S_t^T q_t

with the key-side log-decay ``gk`` ``[B, T, H, K]`` (GLA's g) and FLA's optional value-side
log-decay ``gv`` ``[B, T, H, V]`` (both <= 0, None for no decay). One ``lax.scan`` over T;
jit-friendly; differentiable (it keeps a state per token for autodiff: short T only).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from zeco_jax import _checks
from zeco_jax._linalg import HI


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                        output_final_state=False):
  """GLA over ``T`` tokens from ``initial_state``, one token at a time.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``, one floating dtype.
    gk: ``[B, T, H, K]`` key-side log-decay (GLA's g, <= 0) or None.
    gv: ``[B, T, H, V]`` value-side log-decay (<= 0) or None.
    scale: default ``K ** -0.5``.
    initial_state: ``[B, H, K, V]`` or None (zeros).
    output_final_state: also return the float32 state after the last token.

  Returns:
    ``(o [B, T, H, V] in v's dtype, final_state float32 [B, H, K, V] or None)``.
  """
  name = "fused_recurrent_gla"
  args = _checks.check_gla_inputs(q, k, v, gk, initial_state, scale, name=name)
  if gk is not None and gk.ndim != 4:
    raise ValueError(f"{name}: `gk` must be [B, T, H, K] = {q.shape} (per-key log-decay), "
                     f"got {gk.shape}; for one decay per head pass gk=g[..., None] broadcast "
                     "over K.")
  if gv is not None and tuple(gv.shape) != tuple(v.shape):
    raise ValueError(f"{name}: `gv` must be [B, T, H, V] = {v.shape} (per-value log-decay), "
                     f"got {getattr(gv, 'shape', gv)}.")
  B, T, H, K, V = args.B, args.T, args.H, args.K, args.V
  f32 = jnp.float32
  S0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
  zeros = lambda d: jnp.zeros((T, B, H, d), f32)
  time_major = lambda x: jnp.moveaxis(x.astype(f32), 1, 0)

  def step(S, xs):
    q_t, k_t, v_t, gk_t, gv_t = xs
    S = jnp.exp(gk_t)[..., :, None] * S * jnp.exp(gv_t)[..., None, :]
    S = S + k_t[..., :, None] * v_t[..., None, :]
    return S, args.scale * jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=HI)

  xs = (time_major(q), time_major(k), time_major(v),
        zeros(K) if gk is None else time_major(gk), zeros(V) if gv is None else time_major(gv))
  S, o = lax.scan(step, S0, xs)
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), (S if output_final_state else None)
