"""The Gated DeltaNet family's model config and token mixer (FLA's ``gated_deltanet``).

The mixer is :class:`zeco_jax.nn.GatedDeltaNet` (short convolutions, l2-normalised q and k,
``beta = sigmoid(x W_b)``, Mamba2's decay ``-exp(A_log) softplus(x W_a + dt_bias)``, output
gate and norm), which runs ``zeco_gated_delta_rule`` over the mesh's sequence axis (or the
chunked op on one shard). The LM around it is :class:`models.lm.LM`.

Dimensions from the shared fields: key dim ``hidden_size * expand_k`` split over
``num_heads`` (FLA's ``head_dim``), value dim ``hidden_size * expand_v`` (FLA's
``num_heads * head_dim * expand_v``). FLA's gated_deltanet 340M (hidden 1024, 6 heads,
head_dim 256, expand_v 2) is expand_k = 1.5, expand_v = 3.0 here.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from models.config import LMConfig
from models.lm import residual_out_std
from zeco_jax.nn import GatedDeltaNet
from zeco_jax.ops._dispatch import BACKENDS
from zeco_jax.sp.scan import SCAN_METHODS


@dataclasses.dataclass(frozen=True)
class GDNConfig(LMConfig):
  """The Gated DeltaNet model: :class:`~models.config.LMConfig`'s fields and the op's
  backend."""
  backend: str = "auto"                     # chunk_gated_delta_rule / zeco_gated_delta_rule

  @property
  def head_dim(self) -> int:
    return self.key_dim // self.num_heads

  @property
  def expand_v_per_head(self) -> float:
    return self.value_dim / self.key_dim

  def validate(self) -> None:
    self.validate_lm()
    self.validate_heads()
    if self.backend not in BACKENDS:
      raise ValueError(f"model: backend must be one of {BACKENDS}, got {self.backend!r}")
    if self.seq_method not in SCAN_METHODS:
      raise ValueError(f"model: seq_method must be one of {tuple(SCAN_METHODS)}, got "
                       f"{self.seq_method!r}")


def gdn_layer(cfg: GDNConfig, *, rngs: nnx.Rngs) -> GatedDeltaNet:
  return GatedDeltaNet(
      cfg.hidden_size, cfg.num_heads, head_dim=cfg.head_dim, expand_v=cfg.expand_v_per_head,
      use_gate=True, use_short_conv=cfg.use_short_conv, conv_size=cfg.conv_size,
      norm_eps=cfg.norm_eps, init_std=cfg.init_std, output_init_std=residual_out_std(cfg),
      chunk_size=cfg.chunk_size, seq_axis=cfg.seq_axis, seq_method=cfg.seq_method,
      num_blocks=cfg.num_blocks, group_size=cfg.seq_group_size, backend=cfg.backend, rngs=rngs)
