"""The GLA language model (Yang et al. 2024; flash-linear-attention's GLA-340M/1.3B) in Flax NNX.

Pre-norm blocks ``x + GLA(RMSNorm(x))``, ``x + SwiGLU(RMSNorm(x))``, a final RMSNorm and
an output head tied to the token embedding. The token mixer is the library's
:class:`zeco_jax.nn.GatedLinearAttention` (fla's ``GatedLinearAttention``: low-rank
data-dependent decay, optional short convolution, swish-gated per-head RMSNorm), which
runs ``zeco_gla`` over the mesh's sequence axis, or ``chunk_gla`` when that axis has
size 1 or no mesh is given. The mesh comes from the call (``model(tokens, mesh=mesh)``)
or from ``jax.set_mesh``; nothing here holds one.

Every parameter carries ``logical_axes`` metadata; :mod:`models.sharding` maps those to
mesh axes. Parameters are float32; cast the parameter tree (e.g. to bfloat16) before
``nnx.merge`` for low-precision compute: norms, gates, the GLA state and the logits stay
float32 inside.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from zeco_jax.nn import (GatedLinearAttention, RMSNorm, check_gla_args, normal_param,
                         remat_call)
from zeco_jax.losses import embedding_lookup


@dataclasses.dataclass(frozen=True)
class GLAConfig:
  vocab_size: int = 256
  hidden_size: int = 128
  num_layers: int = 2
  num_heads: int = 2
  expand_k: float = 0.5
  expand_v: float = 1.0
  hidden_ratio: float = 4.0
  intermediate_size: Optional[int] = None   # default: fla's rule from hidden_ratio
  gate_low_rank_dim: int = 16
  gate_logit_normalizer: float = 16.0
  gate_bias_init: float = 0.0               # >0 starts with slower decay (longer memory)
  norm_eps: float = 1e-6
  init_std: float = 0.02
  chunk_size: int = 64
  backend: str = "auto"                      # chunk_gla / zeco_gla backend
  seq_method: str = "all_scan"               # zeco_gla method over the seq axis
  num_blocks: Optional[int] = None           # All-Scan pipeline blocks (None: zeco_gla's)
  seq_axis: str = "seq"
  batch_axes: Optional[str] = None           # mesh axis B is split over (the trainer's)
  remat: bool = False                        # recompute each block in the backward
  use_short_conv: bool = False               # fla's ShortConvolution on q, k, v (+ SiLU)
  conv_size: int = 4

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
    return 256 * ((size + 255) // 256)      # fla GLAMLP rounds up to a multiple of 256

  def validate(self) -> None:
    for name in ("vocab_size", "num_layers"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    try:
      check_gla_args(hidden_size=self.hidden_size, num_heads=self.num_heads,
                     expand_k=self.expand_k, expand_v=self.expand_v,
                     gate_low_rank_dim=self.gate_low_rank_dim, chunk_size=self.chunk_size,
                     conv_size=self.conv_size, seq_method=self.seq_method)
    except ValueError as e:
      raise ValueError(f"model: {e}") from None


def _dot(x, w):
  return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


def _residual_out_std(cfg: GLAConfig) -> float:
  """GPT-2 / fla scaling of the projections that end a residual branch."""
  return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def gla_layer(cfg: GLAConfig, *, rngs: nnx.Rngs) -> GatedLinearAttention:
  """The library's GLA token mixer with this model's settings."""
  return GatedLinearAttention(
      cfg.hidden_size, cfg.num_heads, expand_k=cfg.expand_k, expand_v=cfg.expand_v,
      gate_low_rank_dim=cfg.gate_low_rank_dim, gate_logit_normalizer=cfg.gate_logit_normalizer,
      gate_bias_init=cfg.gate_bias_init, use_short_conv=cfg.use_short_conv,
      conv_size=cfg.conv_size, norm_eps=cfg.norm_eps, init_std=cfg.init_std,
      output_init_std=_residual_out_std(cfg), chunk_size=cfg.chunk_size, backend=cfg.backend,
      seq_axis=cfg.seq_axis, seq_method=cfg.seq_method, num_blocks=cfg.num_blocks,
      batch_axes=cfg.batch_axes, rngs=rngs)


class SwiGLU(nnx.Module):
  def __init__(self, cfg: GLAConfig, *, rngs: nnx.Rngs):
    D, I = cfg.hidden_size, cfg.mlp_dim
    self.gate_proj = normal_param(rngs, (D, I), cfg.init_std, ("embed", "mlp"))
    self.up_proj = normal_param(rngs, (D, I), cfg.init_std, ("embed", "mlp"))
    self.down_proj = normal_param(rngs, (I, D), _residual_out_std(cfg), ("mlp", "embed"))

  def __call__(self, x):
    h = jax.nn.silu(_dot(x, self.gate_proj[...])) * _dot(x, self.up_proj[...])
    return _dot(h, self.down_proj[...])


class GLABlock(nnx.Module):
  def __init__(self, cfg: GLAConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.attn = gla_layer(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x, mesh=None, segment_ids=None):
    x = x + self.attn(self.attn_norm(x), mesh, segment_ids=segment_ids)
    return x + self.mlp(self.mlp_norm(x))


class GLALM(nnx.Module):
  """Token ids ``[B, T]`` -> float32 logits ``[B, T, vocab]``."""

  def __init__(self, cfg: GLAConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.init_std,
                              ("vocab", "embed"))
    # Named attributes (not a list) keep checkpoint keys plain strings.
    for i in range(cfg.num_layers):
      setattr(self, f"block_{i}", GLABlock(cfg, rngs=rngs))
    self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

  def blocks(self):
    return [getattr(self, f"block_{i}") for i in range(self.cfg.num_layers)]

  def hidden(self, tokens_BxT, mesh=None, segment_ids=None):
    """The final-norm hidden states ``[B, T, hidden]`` that the tied head multiplies.

    ``segment_ids``: None (a row is one sequence) or int ``[B, T]`` document ids of
    packed rows (:mod:`zeco_jax.segments`): every layer's state and short convolution
    start afresh at each document. The embedding gradient is a float32 scatter-add
    (:func:`zeco_jax.losses.embedding_lookup`), not one in the compute dtype.
    """
    x = embedding_lookup(self.embed[...], tokens_BxT)
    for block in self.blocks():
      if self.cfg.remat:
        x = remat_call(lambda blk, h, seg: blk(h, mesh, seg), block, x, segment_ids)
      else:
        x = block(x, mesh, segment_ids)
    return self.norm(x)

  def head_weight(self):
    """The output head's ``[vocab, hidden]`` matrix (the tied embedding)."""
    return self.embed[...]

  def __call__(self, tokens_BxT, mesh=None, segment_ids=None):
    """Float32 logits ``[B, T, vocab]`` (see :meth:`hidden`; training uses
    :func:`zeco_jax.losses.linear_cross_entropy` on the hidden states instead)."""
    x = self.hidden(tokens_BxT, mesh, segment_ids)
    return jnp.einsum("btd,vd->btv", x, self.embed[...].astype(x.dtype),
                      preferred_element_type=jnp.float32)


def num_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
