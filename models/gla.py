"""The GLA language model (Yang et al. 2024; flash-linear-attention's GLA-340M/1.3B) in Flax NNX.

Pre-norm blocks ``x + GLA(RMSNorm(x))``, ``x + SwiGLU(RMSNorm(x))``, a final RMSNorm and
an output head tied to the token embedding. The token mixer follows fla's
``GatedLinearAttention``: q/k/v projections (key dim = hidden * expand_k, value dim =
hidden * expand_v), a low-rank data-dependent log-decay ``g = logsigmoid(x W1 W2 + b) / 16``,
per-head RMSNorm of the output times a swish gate, and an output projection.

Sequence parallelism: the mixer calls :func:`zeco_jax.zeco_gla` over the mesh's sequence
axis (ZeCO All-Scan), or plain :func:`zeco_jax.chunk_gla` when that axis has size 1 or no
mesh is given. The mesh comes from the call (``model(tokens, mesh=mesh)``) or from
``jax.set_mesh``; nothing here holds one. So the model is also a plain layer inside
someone else's jitted program: without a mesh it is single-device GLA.

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

import zeco_jax


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
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "gate_low_rank_dim",
                 "chunk_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    for name, dim in (("key", self.key_dim), ("value", self.value_dim)):
      if dim % self.num_heads:
        raise ValueError(f"model: {name} dim {dim} (hidden_size * expand_{name[0]}) is not "
                         f"divisible by num_heads={self.num_heads}")
    if self.chunk_size % 16:
      raise ValueError(f"model.chunk_size must be a multiple of 16, got {self.chunk_size}")


def _param(rngs, shape, std, axes):
  init = jax.random.normal(rngs.params(), shape, jnp.float32) * std
  return nnx.Param(init, logical_axes=axes)


def _const(shape, value, axes):
  return nnx.Param(jnp.full(shape, value, jnp.float32), logical_axes=axes)


def _dot(x, w):
  return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


class RMSNorm(nnx.Module):
  """x / rms(x) * weight, computed in float32, returned in x's dtype."""

  def __init__(self, dim: int, eps: float, axes=("embed",)):
    self.weight = _const((dim,), 1.0, axes)
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def _seq_size(mesh, axis: str) -> int:
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or getattr(mesh, "empty", False):
    return 1
  return int(dict(mesh.shape).get(axis, 1))


def gla_op(q, k, v, g, *, cfg: GLAConfig, mesh=None):
  """``zeco_gla`` over ``cfg.seq_axis`` when that axis has size > 1, else ``chunk_gla``."""
  if _seq_size(mesh, cfg.seq_axis) > 1 and hasattr(zeco_jax, "zeco_gla"):
    kwargs = {} if cfg.num_blocks is None else {"num_blocks": cfg.num_blocks}
    o, _ = zeco_jax.zeco_gla(q, k, v, g, mesh=mesh, seq_axis=cfg.seq_axis,
                             method=cfg.seq_method, chunk_size=cfg.chunk_size,
                             backend=cfg.backend, **kwargs)
  else:
    # Without zeco_gla (or on one seq shard) XLA gathers T where needed: correct, not ZeCO.
    o, _ = zeco_jax.chunk_gla(q, k, v, g, chunk_size=cfg.chunk_size, backend=cfg.backend)
  return o


class ShortConv(nnx.Module):
  """Causal depthwise convolution over time followed by SiLU (fla ``ShortConvolution``).

  Written as shifted slices of a left-padded input, so under jit with T sharded XLA adds
  the (conv_size - 1)-token halo exchange between sequence shards itself.
  """

  def __init__(self, dim: int, size: int, *, rngs: nnx.Rngs):
    self.weight = _param(rngs, (size, dim), size ** -0.5, (None, "heads"))
    self.size = size

  def __call__(self, x_BxTxC):
    T = x_BxTxC.shape[1]
    w = self.weight[...].astype(x_BxTxC.dtype)
    padded = jnp.pad(x_BxTxC, ((0, 0), (self.size - 1, 0), (0, 0)))
    y = sum(padded[:, j:j + T] * w[j] for j in range(self.size))
    return jax.nn.silu(y)


class GLAMixer(nnx.Module):
  """fla ``GatedLinearAttention`` (mode chunk, swish-gated output norm, optional short conv)."""

  def __init__(self, cfg: GLAConfig, *, rngs: nnx.Rngs):
    D, Kd, Vd, R = cfg.hidden_size, cfg.key_dim, cfg.value_dim, cfg.gate_low_rank_dim
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.cfg = cfg
    self.q_proj = _param(rngs, (D, Kd), std, ("embed", "heads"))
    self.k_proj = _param(rngs, (D, Kd), std, ("embed", "heads"))
    self.v_proj = _param(rngs, (D, Vd), std, ("embed", "heads"))
    self.g_proj = _param(rngs, (D, Vd), std, ("embed", "heads"))      # swish output gate
    self.gk_down = _param(rngs, (D, R), std, ("embed", "gate_rank"))
    self.gk_up = _param(rngs, (R, Kd), std, ("gate_rank", "heads"))
    self.gk_bias = _const((Kd,), cfg.gate_bias_init, ("heads",))
    self.g_norm = RMSNorm(Vd // cfg.num_heads, cfg.norm_eps, axes=("head_dim",))
    self.o_proj = _param(rngs, (Vd, D), out_std, ("heads", "embed"))
    if cfg.use_short_conv:
      self.q_conv = ShortConv(Kd, cfg.conv_size, rngs=rngs)
      self.k_conv = ShortConv(Kd, cfg.conv_size, rngs=rngs)
      self.v_conv = ShortConv(Vd, cfg.conv_size, rngs=rngs)

  def __call__(self, x_BxTxD, mesh=None):
    cfg = self.cfg
    B, T, _ = x_BxTxD.shape
    H = cfg.num_heads
    q = _dot(x_BxTxD, self.q_proj[...])
    k = _dot(x_BxTxD, self.k_proj[...])
    v = _dot(x_BxTxD, self.v_proj[...])
    if cfg.use_short_conv:
      q, k, v = self.q_conv(q), self.k_conv(k), self.v_conv(v)
    q, k, v = (x.reshape(B, T, H, -1) for x in (q, k, v))
    gate_logits = _dot(_dot(x_BxTxD, self.gk_down[...]), self.gk_up[...]).astype(jnp.float32)
    g = jax.nn.log_sigmoid(gate_logits + self.gk_bias[...]) / cfg.gate_logit_normalizer
    o_BxTxHxV = gla_op(q, k, v, g.reshape(B, T, H, -1), cfg=cfg, mesh=mesh)
    gate = _dot(x_BxTxD, self.g_proj[...]).reshape(B, T, H, -1)
    o = self.g_norm(o_BxTxHxV).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return _dot(o.reshape(B, T, -1).astype(x_BxTxD.dtype), self.o_proj[...])


class SwiGLU(nnx.Module):
  def __init__(self, cfg: GLAConfig, *, rngs: nnx.Rngs):
    D, I = cfg.hidden_size, cfg.mlp_dim
    self.gate_proj = _param(rngs, (D, I), cfg.init_std, ("embed", "mlp"))
    self.up_proj = _param(rngs, (D, I), cfg.init_std, ("embed", "mlp"))
    self.down_proj = _param(rngs, (I, D), cfg.init_std / math.sqrt(2 * cfg.num_layers),
                            ("mlp", "embed"))

  def __call__(self, x):
    h = jax.nn.silu(_dot(x, self.gate_proj[...])) * _dot(x, self.up_proj[...])
    return _dot(h, self.down_proj[...])


class GLABlock(nnx.Module):
  def __init__(self, cfg: GLAConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.attn = GLAMixer(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x, mesh=None):
    x = x + self.attn(self.attn_norm(x), mesh)
    return x + self.mlp(self.mlp_norm(x))


class GLALM(nnx.Module):
  """Token ids ``[B, T]`` -> float32 logits ``[B, T, vocab]``."""

  def __init__(self, cfg: GLAConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.init_std,
                        ("vocab", "embed"))
    # Named attributes (not a list) keep checkpoint keys plain strings.
    for i in range(cfg.num_layers):
      setattr(self, f"block_{i}", GLABlock(cfg, rngs=rngs))
    self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

  def blocks(self):
    return [getattr(self, f"block_{i}") for i in range(self.cfg.num_layers)]

  def __call__(self, tokens_BxT, mesh=None):
    emb = self.embed[...]
    x = jnp.take(emb, tokens_BxT, axis=0)
    for block in self.blocks():
      if self.cfg.remat:
        x = nnx.remat(lambda blk, h: blk(h, mesh))(block, x)
      else:
        x = block(x, mesh)
    x = self.norm(x)
    return jnp.einsum("btd,vd->btv", x, emb.astype(x.dtype),
                      preferred_element_type=jnp.float32)


def num_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
