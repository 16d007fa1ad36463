"""``chunk_gated_delta_rule``: Gated DeltaNet on one device, FLA's name and layout.

q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, the log-decay g ``[B, T, H]`` (<= 0), the write
strength beta ``[B, T, H]`` in (0, 1) and float32 states ``[B, H, K, V]``. The argument
checks (:func:`check_inputs`) are here; FLA's ``l2norm`` is :func:`zeco_jax._linalg.l2norm`
(imported here for the family's other modules); the chunked form is
:mod:`zeco_jax.ops.gated_delta.chunked`. What it does not do: Pallas kernels.
"""
from __future__ import annotations

import jax.numpy as jnp

from zeco_jax import _checks
from zeco_jax import segments
from zeco_jax._linalg import l2norm
from zeco_jax.ops.gated_delta.chunked import chunk_recurrence


def check_inputs(q, k, v, g, beta, initial_state, scale, *, name, chunk_size=None):
  """Validates the Gated DeltaNet signature; returns the sizes and the resolved scale."""
  if g is None or getattr(g, "ndim", None) != 3:
    raise ValueError(f"{name}: `g` (log-decay per head, <= 0) must be [B, T, H], got "
                     f"{getattr(g, 'shape', g)}. Gated DeltaNet has one decay per head.")
  args = _checks.check_gla_inputs(q, k, v, g, initial_state, scale, name=name,
                                  chunk_size=chunk_size)
  if tuple(getattr(beta, "shape", ())) != (args.B, args.T, args.H):
    raise ValueError(f"{name}: `beta` must be [B, T, H] = {(args.B, args.T, args.H)} "
                     f"(write strength in (0, 1)), got {getattr(beta, 'shape', beta)}.")
  if not jnp.issubdtype(beta.dtype, jnp.floating):
    raise ValueError(f"{name}: `beta` must be floating point, got {beta.dtype}.")
  return args


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm=False, chunk_size=64,
                           segment_ids=None):
  """Chunked Gated DeltaNet (WY / UT form), FLA's ``chunk_gated_delta_rule`` in jnp.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (one floating dtype, e.g. bfloat16).
    g: ``[B, T, H]`` log-decay per head (<= 0); beta: ``[B, T, H]`` in (0, 1).
    scale: defaults to ``K ** -0.5``.
    initial_state: ``[B, H, K, V]`` or None (zeros).
    output_final_state: also return the float32 state after the last token.
    use_qk_l2norm: l2-normalise q and k over K first (FLA's ``use_qk_l2norm_in_kernel``).
    chunk_size: tokens per chunk; T need not be a multiple (the tail is padded with
      tokens that change nothing: k = 0, beta = 0, g = 0).
    segment_ids: None or integer ``[B, T]`` packed documents (docs/design.md §10): a
      document start gets the log-decay ``segments.RESET_LOG_DECAY``, exact here because
      every exponent is a sum over the tokens it spans; negative ids are padding.

  Returns:
    ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state float32 or None.
  """
  name = "chunk_gated_delta_rule"
  args = check_inputs(q, k, v, g, beta, initial_state, scale, name=name,
                      chunk_size=chunk_size)
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, args.B, args.T, name=name)
    q, k, g = segments.apply(q, k, g, segment_ids)
  h0 = None if initial_state is None else initial_state.astype(jnp.float32)
  o, final = chunk_recurrence(q, k, v, g, beta, h0, args.scale, chunk_size, False)
  return o.astype(v.dtype), (final if output_final_state else None)
