"""Shape, dtype and argument checks at the public boundary, raised at trace time.

Every public op validates here once, so a bad argument fails with a ValueError that names
the argument, the value it got and the fix, instead of a shape error deep inside XLA.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GlaArgs:
  B: int
  T: int
  H: int
  K: int
  V: int
  scale: float
  scalar_decay: bool


def _shape(x):
  return tuple(getattr(x, "shape", ()))


def check_gla_inputs(q, k, v, g, initial_state, scale, *, name: str,
                     chunk_size: Optional[int] = None) -> GlaArgs:
  """Validates the common GLA signature; returns the sizes and the resolved scale."""
  for arg, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name}: `{arg}` must be 4-D [B, T, H, D] (flash-linear-attention "
                       f"layout), got shape {_shape(x)}. Reshape to [batch, time, heads, dim].")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name}: `{arg}` must be floating point, got dtype {x.dtype}.")
  if q.shape != k.shape:
    raise ValueError(f"{name}: `q` and `k` must have the same shape [B, T, H, K], got "
                     f"q {q.shape} and k {k.shape}.")
  B, T, H, K = q.shape
  if v.shape[:3] != (B, T, H):
    raise ValueError(f"{name}: `v` must be [B, T, H, V] = [{B}, {T}, {H}, V] to match q, "
                     f"got {v.shape}.")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"{name}: `q`, `k`, `v` must share one dtype, got {q.dtype}, {k.dtype}, "
                     f"{v.dtype}. Cast them to one (e.g. bfloat16) before the call.")
  V = v.shape[3]
  _check_no_empty_dim(B, T, H, K, V, q.shape, v.shape, name=name)
  scalar_decay = False
  if g is not None:
    if _shape(g) == (B, T, H):
      scalar_decay = True
    elif _shape(g) != (B, T, H, K):
      raise ValueError(f"{name}: `g` (log-decay) must be [B, T, H, K] = {(B, T, H, K)} "
                       f"(per-dim) or [B, T, H] = {(B, T, H)} (scalar per head) or None, "
                       f"got {_shape(g)}.")
    if not jnp.issubdtype(g.dtype, jnp.floating):
      raise ValueError(f"{name}: `g` must be floating point (a log-decay <= 0), got {g.dtype}.")
  if initial_state is not None:
    if _shape(initial_state) != (B, H, K, V):
      raise ValueError(f"{name}: `initial_state` must be [B, H, K, V] = {(B, H, K, V)}, got "
                       f"{_shape(initial_state)}.")
    if not jnp.issubdtype(initial_state.dtype, jnp.floating):
      raise ValueError(f"{name}: `initial_state` must be floating point (float32 "
                       f"recommended), got {initial_state.dtype}.")
  if scale is None:
    scale = K ** -0.5
  elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
    raise ValueError(f"{name}: `scale` must be a Python number or None (default K ** -0.5), "
                     f"got {scale!r}.")
  if chunk_size is not None:
    check_chunk_size(chunk_size, name=name)
  return GlaArgs(B, T, H, K, V, float(scale), scalar_decay)


def _check_no_empty_dim(B, T, H, K, V, q_shape, v_shape, *, name: str) -> None:
  """Every size must be >= 1: K = 0 has no scale K ** -0.5, V = 0 no state blocks, and
  an empty B, T or H is nothing to compute (and a zero-size grid to a kernel)."""
  empty = (
      (B, "B", "q", q_shape, "an empty batch: skip the call"),
      (T, "T", "q", q_shape, "an empty sequence: skip the call (its final state is "
       "`initial_state`)"),
      (H, "H", "q", q_shape, "no heads: pass H >= 1"),
      (K, "K", "q", q_shape, "no key dimension: pass K >= 1 (the scale K ** -0.5 and the "
       "[K, V] state need it)"),
      (V, "V", "v", v_shape, "no value dimension: pass V >= 1 (the [K, V] state needs it)"),
  )
  for size, dim, arg, shape, what_and_fix in empty:
    if size == 0:
      raise ValueError(f"{name}: `{arg}` has {dim} = 0 (shape {shape}); every dimension "
                       f"must be >= 1. {dim} = 0 is {what_and_fix}.")


def check_chunk_size(chunk_size, *, name: str, multiple_of: int = 1) -> None:
  if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0
      or chunk_size % multiple_of):
    raise ValueError(f"{name}: `chunk_size` must be a positive int"
                     + (f" divisible by {multiple_of}" if multiple_of > 1 else "")
                     + f", got {chunk_size!r}. 64 is the usual choice.")


def check_choice(value, choices, *, arg: str, name: str) -> None:
  if value not in choices:
    raise ValueError(f"{name}: unknown `{arg}` {value!r}; choose one of "
                     f"{', '.join(map(repr, choices))}.")


def full_log_decay(g, B, T, H, K):
  """g as float32 ``[B, T, H, K]``: zeros for None, broadcast over K for scalar decay
  (for code that needs the per-dim form; :func:`zeco_jax.chunk_gla`'s backends get g as
  given)."""
  if g is None:
    return jnp.zeros((B, T, H, K), jnp.float32)
  g = g.astype(jnp.float32)
  if g.ndim == 3:
    g = jnp.broadcast_to(g[..., None], (B, T, H, K))
  return g


def pad_time(x, multiple: int):
  """Pads axis 1 (time) with zeros up to a multiple of ``multiple``."""
  T = x.shape[1]
  pad = -T % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths)
