"""``fused_recurrent_kda``: Kimi Delta Attention token by token, FLA's name and argument
order, for decoding.

A decode step is ``T = 1``: the state ``[B, H, K, V]`` (float32) is the layer's whole
context. For a prompt use :func:`zeco_jax.chunk_kda` with ``output_final_state=True`` and
continue from its state here. The recurrence is the spec's
(:func:`zeco_jax.ops.kda.reference.token_step`), one ``lax.scan`` over T; jit-friendly.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from zeco_jax._linalg import l2norm
from zeco_jax.ops.kda.op import check_inputs
from zeco_jax.ops.kda.reference import token_step


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm=False):
  """Kimi Delta Attention over ``T`` tokens from ``initial_state``, one token at a time.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g ``[B, T, H, K]`` log-decay per key
      channel (<= 0); beta ``[B, T, H]`` in [0, 1]. k unit-norm over K unless
      ``use_qk_l2norm``.
    scale: default ``K ** -0.5``. initial_state: ``[B, H, K, V]`` or None (zeros).
    output_final_state: also return the float32 state after the last token.
    use_qk_l2norm: l2-normalise q and k over K first (FLA's ``use_qk_l2norm_in_kernel``).

  Returns:
    ``(o [B, T, H, V] in v's dtype, final_state float32 [B, H, K, V] or None)``.
  """
  args = check_inputs(q, k, v, g, beta, initial_state, scale, name="fused_recurrent_kda")
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  f32 = jnp.float32
  S0 = (jnp.zeros((args.B, args.H, args.K, args.V), f32) if initial_state is None
        else initial_state.astype(f32))
  xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v, g, beta))
  S, o = lax.scan(lambda S, x: token_step(S, *x, args.scale), S0, xs)
  return jnp.moveaxis(o, 0, 1).astype(v.dtype), (S if output_final_state else None)
