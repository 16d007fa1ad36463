"""The Gated DeltaNet language model (FLA's ``gated_deltanet``) in Flax NNX, and the choice
between it and GLA from a config's ``model.family``.

Pre-norm blocks ``x + GatedDeltaNet(RMSNorm(x))``, ``x + SwiGLU(RMSNorm(x))``, a final
RMSNorm and an output head tied to the token embedding, as :mod:`models.gla` (whose
SwiGLU it reuses). The token mixer is :class:`zeco_jax.nn_delta.GatedDeltaNet`, which runs
``zeco_gated_delta_rule`` over the mesh's sequence axis (or the chunked op on one shard).

:class:`GDNConfig` has GLAConfig's fields, so one config schema serves both families. The
Gated DeltaNet dimensions are read from them: key dim ``hidden_size * expand_k`` split over
``num_heads`` (FLA's ``head_dim``), value dim ``hidden_size * expand_v`` (FLA's
``num_heads * head_dim * expand_v``). FLA's gated_deltanet 340M (hidden 1024, 6 heads,
head_dim 256, expand_v 2) is expand_k = 1.5, expand_v = 3.0 here. ``gate_low_rank_dim``,
``gate_logit_normalizer``, ``gate_bias_init`` and ``backend`` are GLA's and unused.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from models.gla import GLAConfig, GLALM, SwiGLU, _residual_out_std
from zeco_jax.nn import RMSNorm, normal_param, remat_call
from zeco_jax.nn_delta import GatedDeltaNet

FAMILIES = ("gla", "gdn")


@dataclasses.dataclass(frozen=True)
class GDNConfig(GLAConfig):
  """GLAConfig's fields, read as Gated DeltaNet dimensions (see the module docstring)."""

  @property
  def head_dim(self) -> int:
    return self.key_dim // self.num_heads

  @property
  def expand_v_per_head(self) -> float:
    return self.value_dim / self.key_dim

  def validate(self) -> None:
    for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "chunk_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    for name, dim in (("key", self.key_dim), ("value", self.value_dim)):
      if dim <= 0 or dim % self.num_heads:
        raise ValueError(f"model: {name} dim {dim} (hidden_size * expand_{name[0]}) must be "
                         f"positive and divisible by num_heads={self.num_heads}")


def gdn_layer(cfg: GDNConfig, *, rngs: nnx.Rngs) -> GatedDeltaNet:
  return GatedDeltaNet(
      cfg.hidden_size, cfg.num_heads, head_dim=cfg.head_dim, expand_v=cfg.expand_v_per_head,
      use_gate=True, use_short_conv=cfg.use_short_conv, conv_size=cfg.conv_size,
      norm_eps=cfg.norm_eps, init_std=cfg.init_std, output_init_std=_residual_out_std(cfg),
      chunk_size=cfg.chunk_size, seq_axis=cfg.seq_axis, seq_method=cfg.seq_method,
      num_blocks=cfg.num_blocks, rngs=rngs)


class GDNBlock(nnx.Module):
  def __init__(self, cfg: GDNConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.attn = gdn_layer(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x, mesh=None, segment_ids=None):
    x = x + self.attn(self.attn_norm(x), mesh, segment_ids=segment_ids)
    return x + self.mlp(self.mlp_norm(x))


class GDNLM(nnx.Module):
  """Token ids ``[B, T]`` -> float32 logits ``[B, T, vocab]``."""

  def __init__(self, cfg: GDNConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.init_std,
                              ("vocab", "embed"))
    for i in range(cfg.num_layers):
      setattr(self, f"block_{i}", GDNBlock(cfg, rngs=rngs))
    self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

  def blocks(self):
    return [getattr(self, f"block_{i}") for i in range(self.cfg.num_layers)]

  def __call__(self, tokens_BxT, mesh=None, segment_ids=None):
    emb = self.embed[...]
    x = jnp.take(emb, tokens_BxT, axis=0)
    for block in self.blocks():
      if self.cfg.remat:
        x = remat_call(lambda blk, h, seg: blk(h, mesh, seg), block, x, segment_ids)
      else:
        x = block(x, mesh, segment_ids)
    x = self.norm(x)
    return jnp.einsum("btd,vd->btv", x, emb.astype(x.dtype),
                      preferred_element_type=jnp.float32)


def model_from_config(model: dict):
  """``(config, model class)`` for a config's ``model`` section: ``family`` "gla"
  (GLAConfig, GLALM) or "gdn" (GDNConfig, GDNLM); no family means GLA."""
  fields = dict(model)
  family = fields.pop("family", "gla")
  if family not in FAMILIES:
    raise ValueError(f"model.family must be one of {FAMILIES}, got {family!r}")
  return (GDNConfig(**fields), GDNLM) if family == "gdn" else (GLAConfig(**fields), GLALM)
