"""``chunk_kda``: Kimi Delta Attention on one device, FLA's name and layout.

q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, the log-decay g ``[B, T, H, K]`` (<= 0, one
per key channel), the write strength beta ``[B, T, H]`` in (0, 1) and float32 states
``[B, H, K, V]``. The argument checks (:func:`check_inputs`) are here; the chunked form is
:mod:`zeco_jax.ops.kda.chunked`; FLA's gate (``g`` from the layer's projections) is
:func:`zeco_jax.ops.kda.gate.kda_gate`.

Two implementations, chosen by ``backend=``: ``"jax"`` the jnp chunked form (any
platform), ``"pallas"`` the family's Pallas kernels (``pallas_kernels.backend("kda",
platform)``: Triton on GPU, Mosaic on TPU, the GPU kernels in the interpreter on CPU),
behind the delta-rule families' custom_vjp (:mod:`zeco_jax.ops._delta_kernels`: the inputs
kept; the chunk states too with ``save_states``). ``"auto"`` picks the kernels on a GPU
(3.6x less time than the jnp path forward, 3.3x forward + backward at B1 T16384 H16
K=V=128 on an H200: ``benchmarks/results/kda_h200.md``) and on a TPU (compiled ahead of
time for v5e / v5p / v6e, not yet run on a chip), the jnp path on CPU.

What it does not do: grouped value heads (FLA's ``HV > H``), the gate or
``sigmoid(beta)`` inside the op (FLA's ``use_gate_in_kernel``,
``use_beta_sigmoid_in_kernel``: call :func:`~zeco_jax.ops.kda.gate.kda_gate` and
``jax.nn.sigmoid`` first).
"""
from __future__ import annotations

import jax.numpy as jnp

from zeco_jax import _checks
from zeco_jax import segments
from zeco_jax._linalg import l2norm
from zeco_jax.ops._delta_kernels import check_kernel_dims, kernel_recurrence, kernel_setup
from zeco_jax.ops.kda.chunked import chunk_recurrence

FAMILY = "kda"


def check_inputs(q, k, v, g, beta, initial_state, scale, *, name, chunk_size=None):
  """Validates the KDA signature; returns the sizes and the resolved scale."""
  args = _checks.check_gla_inputs(q, k, v, None, initial_state, scale, name=name,
                                  chunk_size=chunk_size)
  want = (args.B, args.T, args.H, args.K)
  if g is None or tuple(getattr(g, "shape", ())) != want:
    raise ValueError(f"{name}: `g` (log-decay per key channel, <= 0) must be [B, T, H, K] = "
                     f"{want}, got {getattr(g, 'shape', g)}. KDA decays every key channel "
                     "separately; for one decay per head broadcast it over K "
                     "(g[..., None] * ones(K)) or use Gated DeltaNet.")
  if not jnp.issubdtype(g.dtype, jnp.floating):
    raise ValueError(f"{name}: `g` must be floating point (a log-decay <= 0), got {g.dtype}.")
  if tuple(getattr(beta, "shape", ())) != (args.B, args.T, args.H):
    raise ValueError(f"{name}: `beta` must be [B, T, H] = {(args.B, args.T, args.H)} "
                     f"(write strength in (0, 1)), got {getattr(beta, 'shape', beta)}.")
  if not jnp.issubdtype(beta.dtype, jnp.floating):
    raise ValueError(f"{name}: `beta` must be floating point, got {beta.dtype}.")
  return args


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm=False, chunk_size=64, segment_ids=None, backend="auto",
              kernel_config=None):
  """Chunked Kimi Delta Attention (WY / UT form), FLA's ``chunk_kda`` in jnp.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (one floating dtype, e.g. bfloat16).
    g: ``[B, T, H, K]`` log-decay per key channel (<= 0; exact down to any per-token
      value: every exponent is a sum over the tokens it spans); beta: ``[B, T, H]`` in
      (0, 1). k unit-norm over K unless ``use_qk_l2norm``.
    scale: defaults to ``K ** -0.5``.
    initial_state: ``[B, H, K, V]`` or None (zeros).
    output_final_state: also return the float32 state after the last token.
    use_qk_l2norm: l2-normalise q and k over K first (FLA's ``use_qk_l2norm_in_kernel``).
    chunk_size: tokens per chunk; T need not be a multiple (the tail is padded with
      tokens that change nothing: k = 0, beta = 0, g = 0).
    segment_ids: None or integer ``[B, T]`` packed documents (docs/design.md §10): a
      document start gets the log-decay ``segments.RESET_LOG_DECAY`` on every channel;
      negative ids are padding.
    backend: ``"auto"``, ``"jax"`` or ``"pallas"`` (module docstring). The kernels need K
      and chunk_size powers of two >= 16 and V a multiple of 16.
    kernel_config: a ``pallas_kernels.kda.KernelConfig`` for the kernels, or None (the
      default for the target). A static argument: each configuration compiles its own
      program. Ignored by the jnp path.

  Returns:
    ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state float32 or None.

  Example::

    g = zeco_jax.kda_gate(g_raw, A_log, dt_bias)           # [B, T, H, K], <= 0
    o, state = zeco_jax.chunk_kda(q, k, v, g, jax.nn.sigmoid(b_raw),
                                  use_qk_l2norm=True, output_final_state=True)
  """
  name = "chunk_kda"
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
