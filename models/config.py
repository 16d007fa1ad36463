"""The fields every family's model config shares (the LM around the token mixer, and the
mixer's shape and sequence parallelism), and their checks.

A family's config (:class:`models.gla.GLAConfig`, :class:`models.gdn.GDNConfig`) is a frozen
dataclass built on :class:`LMConfig` with its own fields and its own ``validate``; families
never inherit from each other. ``configs/`` writes every family's fields into one
``model`` section; :func:`models.model_from_config` takes the chosen family's.
"""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class LMConfig:
  vocab_size: int = 256
  hidden_size: int = 128
  num_layers: int = 2
  num_heads: int = 2
  expand_k: float = 0.5                      # key dim = hidden_size * expand_k (all heads)
  expand_v: float = 1.0                      # value dim = hidden_size * expand_v
  hidden_ratio: float = 4.0
  intermediate_size: Optional[int] = None    # default: FLA's rule from hidden_ratio
  norm_eps: float = 1e-6
  init_std: float = 0.02
  chunk_size: int = 64
  seq_method: str = "all_scan"               # the scan method over the seq axis
  num_blocks: Optional[int] = None           # All-Scan pipeline blocks (None: the op's)
  seq_group_size: Optional[int] = None       # all_scan_2level's group (None: the op's)
  seq_axis: str = "seq"
  batch_axes: Optional[str] = None           # mesh axis B is split over (the trainer's)
  remat: bool = False                        # recompute each block in the backward
  use_short_conv: bool = False               # FLA's ShortConvolution on q, k, v (+ SiLU)
  conv_size: int = 4
  # Hybrid models: "" (every block the family's mixer) or a pattern of L (the family's
  # linear mixer) and A (softmax attention, zeco_jax.nn.GatedAttention) tiled over the
  # blocks: "LLLA" is Qwen3-Next's 3 : 1.
  layer_pattern: str = ""
  attn_num_heads: int = 0                    # 0: num_heads
  attn_num_kv_heads: int = 0                 # 0: attn_num_heads (no grouping)
  attn_head_dim: int = 0                     # 0: hidden_size // attn_num_heads
  attn_seq_method: str = "ulysses"           # zeco_jax.ATTENTION_METHODS
  attn_window: Optional[int] = None          # None: causal over the whole document
  attn_backend: str = "auto"                 # local attention: auto, xla, cudnn, splash
  rope_theta: float = 10000.0

  @property
  def key_dim(self) -> int:
    return int(self.hidden_size * self.expand_k)

  @property
  def value_dim(self) -> int:
    return int(self.hidden_size * self.expand_v)

  @property
  def mlp_dim(self) -> int:
    if self.intermediate_size:
      return self.intermediate_size
    size = int(self.hidden_size * self.hidden_ratio * 2 / 3)
    return 256 * ((size + 255) // 256)      # FLA's GLAMLP rounds up to a multiple of 256

  @property
  def attention_shape(self) -> tuple:
    """``(heads, kv_heads, head_dim)`` of the attention blocks, the zeros resolved."""
    heads = self.attn_num_heads or self.num_heads
    return (heads, self.attn_num_kv_heads or heads,
            self.attn_head_dim or self.hidden_size // heads)

  def block_kinds(self) -> str:
    """One letter per block: L (the family's linear mixer) or A (softmax attention)."""
    pattern = self.layer_pattern or "L"
    return (pattern * (self.num_layers // len(pattern) + 1))[:self.num_layers]

  def validate_heads(self) -> None:
    """The delta-rule families' checks (a key and a value dim split evenly over the heads)."""
    for name in ("hidden_size", "num_heads", "chunk_size", "conv_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    for name, dim in (("key", self.key_dim), ("value", self.value_dim)):
      if dim <= 0 or dim % self.num_heads:
        raise ValueError(f"model: {name} dim {dim} (hidden_size * expand_{name[0]}) must be "
                         f"positive and divisible by num_heads={self.num_heads}")

  def validate_lm(self) -> None:
    """The LM's own checks (the mixer's are the family's ``validate``)."""
    for name in ("vocab_size", "num_layers"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    from zeco_jax.sp.scan import check_group_size, get_method
    get_method(self.seq_method, name="model", arg="seq_method")
    check_group_size(self.seq_group_size, self.seq_method, name="model (seq_group_size)")
    if set(self.layer_pattern) - set("LA"):
      raise ValueError(f"model.layer_pattern={self.layer_pattern!r}: use the letters L (the "
                       "family's linear mixer) and A (softmax attention), e.g. 'LLLA'")
    if self.layer_pattern and self.num_layers % len(self.layer_pattern):
      raise ValueError(f"model.layer_pattern={self.layer_pattern!r} ({len(self.layer_pattern)} "
                       f"blocks) must tile model.num_layers={self.num_layers}")
    if "A" in self.layer_pattern:
      from zeco_jax.nn.attention import check_attention_args
      heads, kv_heads, head_dim = self.attention_shape
      try:
        check_attention_args(hidden_size=self.hidden_size, num_heads=heads,
                             num_kv_heads=kv_heads, head_dim=head_dim,
                             seq_method=self.attn_seq_method, window=self.attn_window,
                             backend=self.attn_backend)
      except ValueError as e:
        raise ValueError(f"model (attention blocks): {e}") from None
