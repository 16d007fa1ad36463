"""The Kimi Delta Attention family's model config and token mixer (FLA's ``kda``).

The mixer is :class:`zeco_jax.nn.KimiDeltaAttention` (short convolutions, l2-normalised q
and k, ``beta = sigmoid(x W_b)``, the per-channel decay ``kda_gate`` of a low-rank
projection, a sigmoid output gate and norm), which runs ``zeco_kda`` over the mesh's
sequence axis (or the chunked op on one shard). The LM around it is :class:`models.lm.LM`.

Dimensions from the shared fields: key dim ``hidden_size * expand_k`` split over
``num_heads`` (FLA's ``head_dim``), value dim ``hidden_size * expand_v`` (FLA's
``num_heads * head_dim * expand_v``). FLA's KDA defaults (hidden 2048, 16 heads of 128,
expand_v 1) are expand_k = expand_v = 1.0 here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from flax import nnx

from models.config import LMConfig
from models.lm import residual_out_std
from zeco_jax.nn import KimiDeltaAttention
from zeco_jax.ops._dispatch import BACKENDS


@dataclasses.dataclass(frozen=True)
class KDAConfig(LMConfig):
  """The KDA model: :class:`~models.config.LMConfig`'s fields and the decay's bound."""
  kda_lower_bound: Optional[float] = None   # FLA's lower_bound of the log-decay (e.g. -5)
  backend: str = "auto"                     # chunk_kda / zeco_kda backend

  @property
  def head_dim(self) -> int:
    return self.key_dim // self.num_heads

  @property
  def expand_v_per_head(self) -> float:
    return self.value_dim / self.key_dim

  def validate(self) -> None:
    self.validate_lm()
    self.validate_heads()
    if self.kda_lower_bound is not None and not self.kda_lower_bound < 0:
      raise ValueError(f"model.kda_lower_bound must be None or negative (e.g. -5), got "
                       f"{self.kda_lower_bound!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"model: backend must be one of {BACKENDS}, got {self.backend!r}")


def kda_layer(cfg: KDAConfig, *, rngs: nnx.Rngs) -> KimiDeltaAttention:
  return KimiDeltaAttention(
      cfg.hidden_size, cfg.num_heads, head_dim=cfg.head_dim, expand_v=cfg.expand_v_per_head,
      lower_bound=cfg.kda_lower_bound, use_short_conv=cfg.use_short_conv,
      conv_size=cfg.conv_size, norm_eps=cfg.norm_eps, init_std=cfg.init_std,
      output_init_std=residual_out_std(cfg), chunk_size=cfg.chunk_size, seq_axis=cfg.seq_axis,
      seq_method=cfg.seq_method, num_blocks=cfg.num_blocks, group_size=cfg.seq_group_size,
      backend=cfg.backend, rngs=rngs)
