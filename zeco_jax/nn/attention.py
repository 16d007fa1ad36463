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
cuDNN on GPU and splash on TPU under ``"auto"``, where they take the inputs). Parameters
are float32 with ``logical_axes`` metadata, as the other layers'.

Decoding: :meth:`GatedAttention.prefill` keeps the prompt's keys and values (a
:class:`KVCache`), :meth:`GatedAttention.reserve` adds free slots, and
:meth:`GatedAttention.decode` writes the next tokens' and attends over the visible slots
(O(context) per token, unlike the linear layers' O(1)).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from zeco_jax import segments
from zeco_jax.nn.common import RMSNorm, dot, last_positions, normal_param
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


class KVCache(NamedTuple):
  """A :class:`GatedAttention` layer's decoding cache (a pytree): ``k``, ``v`` ``[B, S,
  Hkv, head_dim]`` (rotated keys, values) in S slots; ``pos`` int32 ``[B, S]``: each
  slot's position in its document, -1 where no later token may see it (padding, earlier
  documents, free slots); ``length`` int32: slots written (the next token's slot, the
  same for every row)."""
  k: jax.Array
  v: jax.Array
  pos: jax.Array
  length: jax.Array


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

  def _qkv(self, x_BxTxD, positions_BxT):
    """q ``[B, T, H, hd]``, k and v ``[B, T, Hkv, hd]``: projected, q and k normed and
    rotated to ``positions``."""
    B, T, _ = x_BxTxD.shape
    hd = self.head_dim
    q = self.q_norm(dot(x_BxTxD, self.q_proj[...]).reshape(B, T, self.num_heads, hd))
    k = self.k_norm(dot(x_BxTxD, self.k_proj[...]).reshape(B, T, self.num_kv_heads, hd))
    v = dot(x_BxTxD, self.v_proj[...]).reshape(B, T, self.num_kv_heads, hd)
    return (rotary(q, positions_BxT, self.rope_theta), rotary(k, positions_BxT, self.rope_theta),
            v)

  def _out(self, o_BxTxHxD, x_BxTxD):
    """The output gate ``sigmoid(x W_g)`` and the output projection."""
    B, T, _ = x_BxTxD.shape
    gate = jax.nn.sigmoid(dot(x_BxTxD, self.g_proj[...]).astype(jnp.float32))
    o = (o_BxTxHxD.reshape(B, T, -1).astype(jnp.float32) * gate).astype(x_BxTxD.dtype)
    return dot(o, self.o_proj[...])

  @staticmethod
  def _positions(segment_ids, B, T):
    if segment_ids is None:
      return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return segments.position_in_document(segment_ids)

  def _attend(self, q, k, v, mesh, segment_ids):
    if shard.seq_size(mesh, self.seq_axis) > 1:
      return sp_attention(q, k, v, mesh=mesh, seq_axis=self.seq_axis, method=self.seq_method,
                          segment_ids=segment_ids, window=self.window,
                          batch_axes=self.batch_axes, backend=self.backend)
    return attention(q, k, v, segment_ids=segment_ids, window=self.window,
                     backend=self.backend)

  def __call__(self, x_BxTxD, mesh=None, segment_ids=None):
    """``[B, T, hidden_size]`` -> same; ``segment_ids``: None or int ``[B, T]`` documents
    (no token attends across a start; padding outputs zero before the output gate)."""
    B, T, _ = x_BxTxD.shape
    q, k, v = self._qkv(x_BxTxD, self._positions(segment_ids, B, T))
    return self._out(self._attend(q, k, v, mesh, segment_ids), x_BxTxD)

  # -- decoding: a KV cache -------------------------------------------------------------

  def init_cache(self, batch_size: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with no room: :meth:`reserve` slots before :meth:`decode`."""
    hd, Hkv = self.head_dim, self.num_kv_heads
    empty = jnp.zeros((batch_size, 0, Hkv, hd), dtype)
    return KVCache(empty, empty, jnp.zeros((batch_size, 0), jnp.int32), jnp.int32(0))

  def prefill(self, x_BxTxD, mesh=None, segment_ids=None):
    """``(y, cache)``: the layer over a prompt (as ``__call__``) and its keys and values,
    of which only the last document's non-padding tokens stay visible (left or right
    padding, packed documents). The cache has no free slot: :meth:`reserve` some."""
    B, T, _ = x_BxTxD.shape
    positions = self._positions(segment_ids, B, T)
    q, k, v = self._qkv(x_BxTxD, positions)
    y = self._out(self._attend(q, k, v, mesh, segment_ids), x_BxTxD)
    last, first = last_positions(segment_ids, B, T)     # the linear layers' last document
    t = jnp.arange(T, dtype=jnp.int32)
    visible = (t >= first[:, None]) & (t <= last[:, None])
    return y, KVCache(k, v, jnp.where(visible, positions, -1), jnp.int32(T))

  def reserve(self, cache: KVCache, n: int) -> KVCache:
    """``cache`` with ``n`` more free slots (a decode step fills one per token)."""
    pad = lambda x, value: jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2),
                                   constant_values=value)
    return cache._replace(k=pad(cache.k, 0), v=pad(cache.v, 0), pos=pad(cache.pos, -1))

  def decode(self, x_BxLxD, cache: KVCache):
    """``(y, cache)`` for the next ``L`` tokens after ``cache`` (written to its next ``L``
    free slots; a token sees the visible slots of its document, itself included, within
    the window). Needs ``L`` free slots (:meth:`reserve`): a ValueError says so where
    the cache's length is known (outside jit); under jit a full cache would overwrite its
    last slots, which is why :func:`models.generation.generate` reserves first."""
    B, L, _ = x_BxLxD.shape
    S = cache.k.shape[1]
    if not isinstance(cache.length, jax.core.Tracer) and int(cache.length) + L > S:
      raise ValueError(f"GatedAttention.decode: the KV cache has {S - int(cache.length)} free "
                       f"slots for {L} tokens; call reserve(cache, n) first.")
    first = jnp.max(cache.pos, axis=1) + 1                      # [B]: the next position
    positions = first[:, None] + jnp.arange(L, dtype=jnp.int32)
    q, k, v = self._qkv(x_BxLxD, positions)
    at = (0, cache.length, 0, 0)
    k_all = lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), at)
    v_all = lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), at)
    pos = lax.dynamic_update_slice(cache.pos, positions, (0, cache.length))
    sees = (pos[:, None, :] >= 0) & (pos[:, None, :] <= positions[:, :, None])   # [B, L, S]
    if self.window is not None:
      sees &= positions[:, :, None] - pos[:, None, :] < self.window
    G = self.num_heads // self.num_kv_heads
    qg = q.astype(jnp.float32).reshape(B, L, self.num_kv_heads, G, self.head_dim)
    s = jnp.einsum("blhgd,bshd->bhgls", qg, k_all.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * self.head_dim ** -0.5
    s = jnp.where(sees[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)                  # a token always sees itself: no NaN
    o = jnp.einsum("bhgls,bshd->blhgd", p, v_all.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    o = o.reshape(B, L, self.num_heads, self.head_dim).astype(x_BxLxD.dtype)
    return self._out(o, x_BxLxD), KVCache(k_all, v_all, pos, cache.length + L)


__all__ = ["GatedAttention", "KVCache", "check_attention_args", "rotary"]
