"""The GLA family's model config and token mixer (Yang et al. 2024; FLA's GLA-340M / 1.3B).

The mixer is the library's :class:`zeco_jax.nn.GatedLinearAttention` (FLA's
``GatedLinearAttention``: low-rank data-dependent decay, optional short convolution,
swish-gated per-head RMSNorm), which runs ``zeco_gla`` over the mesh's sequence axis, or
``chunk_gla`` when that axis has size 1 or no mesh is given. The LM around it is
:class:`models.lm.LM`.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from models.config import LMConfig
from models.lm import residual_out_std
from zeco_jax.nn import GatedLinearAttention, check_gla_args


@dataclasses.dataclass(frozen=True)
class GLAConfig(LMConfig):
  """The GLA model: :class:`~models.config.LMConfig`'s fields and the GLA gate's."""
  gate_low_rank_dim: int = 16
  gate_logit_normalizer: float = 16.0
  gate_bias_init: float = 0.0               # >0 starts with slower decay (longer memory)
  backend: str = "auto"                     # chunk_gla / zeco_gla backend

  def validate(self) -> None:
    self.validate_lm()
    try:
      check_gla_args(hidden_size=self.hidden_size, num_heads=self.num_heads,
                     expand_k=self.expand_k, expand_v=self.expand_v,
                     gate_low_rank_dim=self.gate_low_rank_dim, chunk_size=self.chunk_size,
                     conv_size=self.conv_size, seq_method=self.seq_method)
    except ValueError as e:
      raise ValueError(f"model: {e}") from None


def gla_layer(cfg: GLAConfig, *, rngs: nnx.Rngs) -> GatedLinearAttention:
  """The library's GLA token mixer with this model's settings."""
  return GatedLinearAttention(
      cfg.hidden_size, cfg.num_heads, expand_k=cfg.expand_k, expand_v=cfg.expand_v,
      gate_low_rank_dim=cfg.gate_low_rank_dim, gate_logit_normalizer=cfg.gate_logit_normalizer,
      gate_bias_init=cfg.gate_bias_init, use_short_conv=cfg.use_short_conv,
      conv_size=cfg.conv_size, norm_eps=cfg.norm_eps, init_std=cfg.init_std,
      output_init_std=residual_out_std(cfg), chunk_size=cfg.chunk_size, backend=cfg.backend,
      seq_axis=cfg.seq_axis, seq_method=cfg.seq_method, num_blocks=cfg.num_blocks,
      group_size=cfg.seq_group_size, batch_axes=cfg.batch_axes, rngs=rngs)
