"""``kda_gate``: KDA's per-channel log-decay from the layer's gate projection (FLA's
``fused_kda_gate`` / ``naive_kda_gate``), a separate function the layer calls before the op.

Two forms, both in float32 and both <= 0, as the ops require:

* the default, Mamba2's parametrisation per key channel:
  ``g = -exp(A_log) * softplus(x + dt_bias)``;
* with ``lower_bound`` (FLA's ``safe_gate`` form, recommended -5):
  ``g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))`` (``A_log`` may be None:
  ``lower_bound * sigmoid(x + dt_bias)``), which keeps every g in ``(lower_bound, 0)``.

Shapes: x ``[..., H, K]`` (``[B, T, H, K]`` from the projection), ``A_log`` with H
elements (one per head), ``dt_bias`` with ``H * K`` elements (one per head and channel,
FLA's flat ``[H * K]``). Plain jnp: JAX differentiates it (FLA's hand-written backward is
the same derivative). What it does not do: the chunk cumsum FLA fuses into its kernel
(the ops here form their own exact segment sums), or ``sigmoid(beta)``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _size(x):
  return math.prod(getattr(x, "shape", ()))


def kda_gate(g, A_log, dt_bias=None, lower_bound=None):
  """KDA's log-decay ``[..., H, K]`` float32 from the gate projection ``g``.

  Args:
    g: ``[..., H, K]`` the gate projection's output (any floating dtype).
    A_log: ``H`` elements (e.g. ``[H]``): the log of each head's decay rate. May be None
      only with ``lower_bound``.
    dt_bias: None or ``H * K`` elements (e.g. ``[H * K]``, FLA's layout), added to ``g``
      first.
    lower_bound: None for ``-exp(A_log) * softplus(g + dt_bias)``; a negative number for
      ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (FLA recommends -5).

  Returns:
    float32 ``[..., H, K]``, every entry <= 0: the ``g`` of :func:`zeco_jax.chunk_kda`.
  """
  name = "kda_gate"
  if getattr(g, "ndim", 0) < 2 or not jnp.issubdtype(g.dtype, jnp.floating):
    raise ValueError(f"{name}: `g` must be a floating array [..., H, K] (the gate "
                     f"projection per head and key channel), got "
                     f"{getattr(g, 'shape', g)} {getattr(g, 'dtype', '')}.")
  H, K = g.shape[-2:]
  if lower_bound is not None and (not isinstance(lower_bound, (int, float))
                                  or isinstance(lower_bound, bool) or not lower_bound < 0):
    raise ValueError(f"{name}: `lower_bound` must be a negative number (the smallest "
                     f"log-decay per token, e.g. -5.0) or None, got {lower_bound!r}.")
  if A_log is None:
    if lower_bound is None:
      raise ValueError(f"{name}: `A_log` is None, which needs `lower_bound` (the gate is "
                       "then lower_bound * sigmoid(g + dt_bias)). Pass A_log [H] or a "
                       "lower_bound such as -5.0.")
  elif _size(A_log) != H:
    raise ValueError(f"{name}: `A_log` must have H = {H} elements (one per head; g is "
                     f"[..., H, K] = {tuple(g.shape)}), got shape "
                     f"{getattr(A_log, 'shape', A_log)}.")
  if dt_bias is not None and _size(dt_bias) != H * K:
    raise ValueError(f"{name}: `dt_bias` must have H * K = {H * K} elements (FLA's [H * K], "
                     f"one per head and key channel), got shape "
                     f"{getattr(dt_bias, 'shape', dt_bias)}.")
  # Under jax.checkpoint: the backward recomputes the gate from g instead of keeping its
  # float32 intermediates per token and channel (the op keeps the gate's output).
  @jax.checkpoint
  def gate(g, A_log, dt_bias):
    x = g.astype(jnp.float32)
    if dt_bias is not None:
      x = x + jnp.reshape(dt_bias, (H, K)).astype(jnp.float32)
    rate = None if A_log is None else jnp.exp(jnp.reshape(A_log, (H, 1)).astype(jnp.float32))
    if lower_bound is None:
      return -rate * jax.nn.softplus(x)
    return lower_bound * jax.nn.sigmoid(x if rate is None else rate * x)

  return gate(g, A_log, dt_bias)
