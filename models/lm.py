"""The language model every family shares, in Flax NNX: embedding, pre-norm blocks, a final
norm and an output head tied to the embedding.

Blocks are ``x + mixer(RMSNorm(x))``, ``x + SwiGLU(RMSNorm(x))``; the token mixer is the
family's layer (:data:`models.FAMILIES`: GLA, Gated DeltaNet), built from the family's
config by its entry. :meth:`LM.hidden` and :meth:`LM.head_weight` give the trainer the
final hidden states and the head without the ``[B, T, vocab]`` logits (the chunked
cross-entropy), for every family. The mesh comes from the call (``model(tokens,
mesh=mesh)``) or from ``jax.set_mesh``; nothing here holds one.

Every parameter carries ``logical_axes`` metadata; :mod:`models.sharding` maps those to
mesh axes. Parameters are float32; cast the parameter tree (e.g. to bfloat16) before
``nnx.merge`` for low-precision compute: norms, gates, the states and the logits stay
float32 inside.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from zeco_jax.losses import embedding_lookup
from zeco_jax.nn import RMSNorm, normal_param, remat_call
from zeco_jax.nn.common import dot


def residual_out_std(cfg) -> float:
  """GPT-2 / FLA scaling of the projections that end a residual branch."""
  return cfg.init_std / math.sqrt(2 * cfg.num_layers)


class SwiGLU(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    D, I = cfg.hidden_size, cfg.mlp_dim
    self.gate_proj = normal_param(rngs, (D, I), cfg.init_std, ("embed", "mlp"))
    self.up_proj = normal_param(rngs, (D, I), cfg.init_std, ("embed", "mlp"))
    self.down_proj = normal_param(rngs, (I, D), residual_out_std(cfg), ("mlp", "embed"))

  def __call__(self, x):
    h = jax.nn.silu(dot(x, self.gate_proj[...])) * dot(x, self.up_proj[...])
    return dot(h, self.down_proj[...])


class Block(nnx.Module):
  """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``; ``attn`` is the family's
  token mixer (called as ``attn(x, mesh, segment_ids=)``)."""

  def __init__(self, cfg, mixer, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.attn = mixer(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x, mesh=None, segment_ids=None):
    x = x + self.attn(self.attn_norm(x), mesh, segment_ids=segment_ids)
    return x + self.mlp(self.mlp_norm(x))


class LM(nnx.Module):
  """Token ids ``[B, T]`` -> float32 logits ``[B, T, vocab]``, for a family's config (one of
  :data:`models.FAMILIES`' config classes)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    from models import family_of          # the registry imports this module
    cfg.validate()
    self.cfg = cfg
    mixer = family_of(cfg).layer
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.init_std,
                              ("vocab", "embed"))
    # Named attributes (not a list) keep checkpoint keys plain strings.
    for i in range(cfg.num_layers):
      setattr(self, f"block_{i}", Block(cfg, mixer, rngs=rngs))
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
