"""Flax NNX softmax attention layer for hybrid models, as Qwen3-Next's gated attention.

    from zeco_jax.nn import GatedAttention
    attn = GatedAttention(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                          rngs=nnx.Rngs(0))
    y_BxTxD = attn(x_BxTxD, mesh=mesh)        # [B, T, 256] -> [B, T, 256]

q, k, v projections (grouped key heads: ``num_kv_heads`` divides ``num_heads``), per-head
RMSNorm of q and k, rotary position embeddings over each token's position in its document
(``segment_ids``; the row position without them), causal softmax attention, the output
times ``sigmoid(x W_g)`` per channel (Qwen3-Next's output gate) and an output projection.

Sequence parallelism: :func:`zeco_jax.sp_attention` over ``seq_axis`` when that mesh axis
has size > 1 (``seq_method``: ``"ulysses"``, ``"all_gather"`` or ``"ring"``), else the
one-device op; the same contiguous split as the linear layers, so a hybrid stack keeps one
layout. ``backend`` picks the local attention (:data:`zeco_jax.ops.attention.op.BACKENDS`:
cuDNN on GPU and splash on TPU under ``"auto"``, where they take the inputs). Parameters are float32 with ``logical_axes`` metadata, as the other layers'.

What it does not do yet: decoding (a KV cache): ``prefill`` / ``decode`` raise.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from zeco_jax import segments
from zeco_jax.nn.common import RMSNorm, dot, normal_param
from zeco_jax.ops.attention.op import BACKENDS, attention
from zeco_jax.ops.attention.parallel import ATTENTION_METHODS, sp_attention
from zeco_jax.sp import shard


def rotary(x_BxTxHxD, positions_BxT, theta: float):
  """Rotary position embedding (the half-split form) of ``x`` at integer ``positions``."""
  D = x_BxTxHxD.shape[-1]
  half = D // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions_BxT.astype(jnp.float32)[..., None] * freqs            # [B, T, half]
  cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
  x = x_BxTxHxD.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(
      x_BxTxHxD.dtype)


def check_attention_args(*, hidden_size: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, seq_method: str, window,
                         backend: str = "auto") -> None:
  """Raises ValueError naming the argument when a :class:`GatedAttention` setting is bad."""
  for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                      ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
    if not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} "
                     "(grouped-query attention)")
  if head_dim % 2:
    raise ValueError(f"head_dim={head_dim} must be even (rotary embeddings rotate pairs)")
  if seq_method not in ATTENTION_METHODS:
    raise ValueError(f"attention seq_method must be one of {tuple(ATTENTION_METHODS)}, got "
                     f"{seq_method!r}")
  if backend not in BACKENDS:
    raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
  if window is not None and (not isinstance(window, int) or window < 1):
    raise ValueError(f"window must be None or a positive int, got {window!r}")


class GatedAttention(nnx.Module):
  """Softmax attention token mixer: ``[B, T, hidden_size]`` -> ``[B, T, hidden_size]``.

  Args:
    hidden_size, num_heads, num_kv_heads, head_dim: width, query heads, key / value heads
      (dividing num_heads), dim per head.
    rope_theta: the rotary embedding's base.
    window: None (causal over the whole document) or a sliding window of tokens.
    norm_eps, init_std, output_init_std: the q / k norms' epsilon; std of the projections
      and of the output projection (default ``init_std``).
    seq_axis, seq_method, batch_axes: the mesh axis T is split over, the method of
      :data:`zeco_jax.ATTENTION_METHODS`, the mesh axis B is split over.
    backend: the local attention's backend (``"auto"``, ``"xla"``, ``"cudnn"``,
      ``"splash"``).
  """

  def __init__(self, hidden_size: int, num_heads: int, *, num_kv_heads: int, head_dim: int,
               rope_theta: float = 10000.0, window: Optional[int] = None,
               norm_eps: float = 1e-6, init_std: float = 0.02,
               output_init_std: Optional[float] = None, seq_axis: str = "seq",
               seq_method: str = "ulysses", batch_axes=None, backend: str = "auto",
               rngs: nnx.Rngs):
    try:
      check_attention_args(hidden_size=hidden_size, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim,
                           seq_method=seq_method, window=window, backend=backend)
    except ValueError as e:
      raise ValueError(f"GatedAttention: {e}") from None
    D, H, Hkv, hd = hidden_size, num_heads, num_kv_heads, head_dim
    out_std = init_std if output_init_std is None else output_init_std
    self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, hd
    self.rope_theta, self.window = rope_theta, window
    self.seq_axis, self.seq_method, self.batch_axes = seq_axis, seq_method, batch_axes
    self.backend = backend
    self.q_proj = normal_param(rngs, (D, H * hd), init_std, ("embed", "heads"))
    self.k_proj = normal_param(rngs, (D, Hkv * hd), init_std, ("embed", "heads"))
    self.v_proj = normal_param(rngs, (D, Hkv * hd), init_std, ("embed", "heads"))
    self.g_proj = normal_param(rngs, (D, H * hd), init_std, ("embed", "heads"))
    self.q_norm = RMSNorm(hd, norm_eps, logical_axes=("head_dim",))
    self.k_norm = RMSNorm(hd, norm_eps, logical_axes=("head_dim",))
    self.o_proj = normal_param(rngs, (H * hd, D), out_std, ("heads", "embed"))

  def __call__(self, x_BxTxD, mesh=None, segment_ids=None):
    """``[B, T, hidden_size]`` -> same; ``segment_ids``: None or int ``[B, T]`` documents
    (no token attends across a start; padding outputs zero before the output gate)."""
    B, T, _ = x_BxTxD.shape
    hd = self.head_dim
    q = self.q_norm(dot(x_BxTxD, self.q_proj[...]).reshape(B, T, self.num_heads, hd))
    k = self.k_norm(dot(x_BxTxD, self.k_proj[...]).reshape(B, T, self.num_kv_heads, hd))
    v = dot(x_BxTxD, self.v_proj[...]).reshape(B, T, self.num_kv_heads, hd)
    if segment_ids is None:
      positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    else:
      positions = segments.position_in_document(segment_ids)
    q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
    if shard.seq_size(mesh, self.seq_axis) > 1:
      o = sp_attention(q, k, v, mesh=mesh, seq_axis=self.seq_axis, method=self.seq_method,
                       segment_ids=segment_ids, window=self.window, batch_axes=self.batch_axes,
                       backend=self.backend)
    else:
      o = attention(q, k, v, segment_ids=segment_ids, window=self.window, backend=self.backend)
    gate = jax.nn.sigmoid(dot(x_BxTxD, self.g_proj[...]).astype(jnp.float32))
    o = (o.reshape(B, T, -1).astype(jnp.float32) * gate).astype(x_BxTxD.dtype)
    return dot(o, self.o_proj[...])

  def init_cache(self, batch_size: int, dtype=jnp.float32):
    raise NotImplementedError("GatedAttention: decoding (a KV cache) is not implemented yet; "
                              "hybrid models train and score but cannot generate")

  def prefill(self, x_BxTxD, mesh=None, segment_ids=None):
    return self.init_cache(x_BxTxD.shape[0])

  def decode(self, x_BxLxD, cache):
    return self.init_cache(x_BxLxD.shape[0])


__all__ = ["GatedAttention", "check_attention_args", "rotary"]
