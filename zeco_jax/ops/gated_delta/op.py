"""``chunk_gated_delta_rule``: Gated DeltaNet on one device, FLA's name and layout.

q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, the log-decay g ``[B, T, H]`` (<= 0), the write
strength beta ``[B, T, H]`` in (0, 1) and float32 states ``[B, H, K, V]``. The argument
checks (:func:`check_inputs`) are here; FLA's ``l2norm`` is :func:`zeco_jax._linalg.l2norm`
(imported here for the family's other modules).

Two implementations, chosen by ``backend=`` (``zeco_jax.ops._dispatch.resolve_backend``):
``"jax"`` the jnp chunked form (:mod:`zeco_jax.ops.gated_delta.chunked`, any platform),
``"pallas"`` the family's Pallas kernels (``pallas_kernels.backend("gated_delta",
platform)``: Triton on GPU, Mosaic on TPU, the GPU kernels in the interpreter on CPU),
behind one custom_vjp (:mod:`zeco_jax.ops._delta_kernels`) that keeps the inputs and the
kernels' chunk states. ``"auto"``: the kernels on GPU and TPU, the jnp path on CPU.
"""
from __future__ import annotations

import jax.numpy as jnp

from zeco_jax import _checks
from zeco_jax import segments
from zeco_jax._linalg import l2norm
from zeco_jax.ops._delta_kernels import check_kernel_dims, kernel_recurrence, kernel_setup
from zeco_jax.ops.gated_delta.chunked import chunk_recurrence

FAMILY = "gated_delta"


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
                           segment_ids=None, backend="auto", kernel_config=None):
  """Chunked Gated DeltaNet (WY / UT form), FLA's ``chunk_gated_delta_rule``.

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
    backend: ``"auto"``, ``"jax"`` or ``"pallas"`` (module docstring). The kernels need K
      and chunk_size powers of two >= 16 and V a multiple of 16.
    kernel_config: a ``pallas_kernels.gated_delta.KernelConfig`` for the kernels, or None
      (the default for the target and shape). A static argument: each configuration
      compiles its own program. Ignored by the jnp path.

  Returns:
    ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state float32 or None.
  """
  name = "chunk_gated_delta_rule"
  args = check_inputs(q, k, v, g, beta, initial_state, scale, name=name,
                      chunk_size=chunk_size)
  backend, config = kernel_setup(backend, kernel_config, (q, k, v, g, beta, initial_state),
                                 args.B, args.T, args.H, args.K, args.V, q.dtype,
                                 chunk_size=chunk_size, family=FAMILY, name=name)
  if backend == "pallas":
    check_kernel_dims(args.K, args.V, chunk_size, name=name)
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, args.B, args.T, name=name)
    q, k, g = segments.apply(q, k, g, segment_ids)
  h0 = None if initial_state is None else initial_state.astype(jnp.float32)
  if backend == "pallas":
    o, final = kernel_recurrence(q, k, v, g, beta, h0, args.scale, chunk_size, config,
                                 family=FAMILY)
  else:
    o, final = chunk_recurrence(q, k, v, g, beta, h0, args.scale, chunk_size, False)
  return o.astype(v.dtype), (final if output_final_state else None)
