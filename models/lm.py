"""The language model every family shares, in Flax NNX: embedding, pre-norm blocks, a final
norm and an output head tied to the embedding.

Blocks are ``x + mixer(RMSNorm(x))``, ``x + SwiGLU(RMSNorm(x))``; the token mixer is the
family's layer (:data:`models.FAMILIES`: GLA, Gated DeltaNet), built from the family's
config by its entry, or in a hybrid model (``model.layer_pattern``, e.g. "LLLA") softmax
attention in the A blocks (:class:`zeco_jax.nn.GatedAttention`, over the same sequence
mesh; hybrids train and score, but do not decode yet). :meth:`LM.hidden` and
:meth:`LM.head_weight` give the trainer the final hidden states and the head without the
``[B, T, vocab]`` logits (the chunked cross-entropy), for every family. The mesh comes from the call (``model(tokens,
mesh=mesh)``) or from ``jax.set_mesh``; nothing here holds one.

Decoding (:mod:`models.generation` runs these in one jitted loop): :meth:`LM.prefill` runs
a prompt (sequence-parallel on a mesh) and returns the next-token logits of each row's last
prompt token with every layer's cache; :meth:`LM.decode` continues from the caches one
token (or a few) at a time; :meth:`LM.score` is the log-likelihood of given tokens.

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

from zeco_jax.losses import embedding_lookup, linear_cross_entropy
from zeco_jax.nn import RMSNorm, normal_param, remat_call
from zeco_jax.nn.attention import GatedAttention
from zeco_jax.nn.common import dot, last_tokens


def residual_out_std(cfg) -> float:
  """GPT-2 / FLA scaling of the projections that end a residual branch."""
  return cfg.init_std / math.sqrt(2 * cfg.num_layers)


def attention_layer(cfg, *, rngs: nnx.Rngs) -> GatedAttention:
  """The softmax attention mixer of a hybrid model's A blocks (``model.layer_pattern``)."""
  heads, kv_heads, head_dim = cfg.attention_shape
  return GatedAttention(
      cfg.hidden_size, heads, num_kv_heads=kv_heads, head_dim=head_dim,
      rope_theta=cfg.rope_theta, window=cfg.attn_window, norm_eps=cfg.norm_eps,
      init_std=cfg.init_std, output_init_std=residual_out_std(cfg), seq_axis=cfg.seq_axis,
      seq_method=cfg.attn_seq_method, batch_axes=cfg.batch_axes, backend=cfg.attn_backend,
      rngs=rngs)


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

  def prefill(self, x, mesh=None, segment_ids=None):
    """``(x, cache)``: the block over a prompt and its token mixer's cache."""
    y, cache = self.attn.prefill(self.attn_norm(x), mesh, segment_ids=segment_ids)
    x = x + y
    return x + self.mlp(self.mlp_norm(x)), cache

  def decode(self, x, cache):
    """``(x, cache)`` for the next tokens after ``cache``."""
    y, cache = self.attn.decode(self.attn_norm(x), cache)
    x = x + y
    return x + self.mlp(self.mlp_norm(x)), cache


class LM(nnx.Module):
  """Token ids ``[B, T]`` -> float32 logits ``[B, T, vocab]``, for a family's config (one of
  :data:`models.FAMILIES`' config classes)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    from models import family_of          # the registry imports this module
    cfg.validate()
    self.cfg = cfg
    mixers = {"L": family_of(cfg).layer, "A": attention_layer}
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.init_std,
                              ("vocab", "embed"))
    # Named attributes (not a list) keep checkpoint keys plain strings.
    for i, kind in enumerate(cfg.block_kinds()):
      setattr(self, f"block_{i}", Block(cfg, mixers[kind], rngs=rngs))
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
    return self.logits(self.hidden(tokens_BxT, mesh, segment_ids))

  def logits(self, hidden):
    """Float32 logits ``[..., vocab]`` of final hidden states ``[..., hidden]``."""
    return jnp.einsum("...d,vd->...v", hidden, self.embed[...].astype(hidden.dtype),
                      preferred_element_type=jnp.float32)

  def init_cache(self, batch_size: int, dtype=jnp.float32) -> tuple:
    """Every layer's decoding cache before any token (zeros): a tuple, one per block."""
    return tuple(block.attn.init_cache(batch_size, dtype) for block in self.blocks())

  def prefill(self, tokens_BxT, mesh=None, segment_ids=None):
    """``(logits [B, vocab], caches)``: the prompt through every layer (sequence-parallel
    over ``mesh``'s seq axis), the float32 next-token logits of each row's last
    non-padding token, and every layer's cache after it.

    Rows of different lengths: pad them (left or right) with ``segment_ids`` -1 on the
    padding and one non-negative id on the prompt; packed documents continue the last
    one. The last token is picked by a one-hot contraction over T (no gather of a
    sequence-split T)."""
    x = embedding_lookup(self.embed[...], tokens_BxT)
    caches = []
    for block in self.blocks():
      x, cache = block.prefill(x, mesh, segment_ids)
      caches.append(cache)
    last = last_tokens(x, segment_ids, 1)[:, 0]
    return self.logits(self.norm(last)), tuple(caches)

  def reserve(self, caches, n: int) -> tuple:
    """``caches`` ready for ``n`` more decoded tokens (the attention blocks' KV caches get
    ``n`` free slots; the linear blocks' states are unchanged)."""
    return tuple(block.attn.reserve(cache, n) for block, cache in zip(self.blocks(), caches))

  def decode(self, tokens_BxL, caches):
    """``(logits [B, L, vocab], caches)`` for the next ``L`` tokens (a decode step: L = 1)
    after ``caches`` (:meth:`prefill`'s or :meth:`init_cache`'s, with :meth:`reserve`'d
    room where the model has attention blocks): the linear blocks' token recurrences, O(1)
    per token in the context length; the attention blocks' KV caches, O(context)."""
    x = embedding_lookup(self.embed[...], tokens_BxL)
    new = []
    for block, cache in zip(self.blocks(), caches):
      x, cache = block.decode(x, cache)
      new.append(cache)
    return self.logits(self.norm(x)), tuple(new)

  def generate(self, prompt_tokens, **kwargs):
    """New tokens after a prompt: :func:`models.generation.generate` with this model."""
    from models.generation import generate
    return generate(self, prompt_tokens, **kwargs)

  def score(self, tokens_BxT, mesh=None, segment_ids=None, *, chunk_size: int = 0):
    """Float32 ``[B, T]``: ``log p(tokens[t] | tokens[:t])`` by the chunked forward (one
    pass, sequence-parallel over ``mesh``), 0 where there is nothing to predict from: t = 0,
    a document's first token and padding (``segment_ids``). Sum it over a continuation's
    positions for the continuation's log-likelihood. ``chunk_size`` > 0: the head in
    chunks of that many tokens (:func:`zeco_jax.losses.linear_cross_entropy`, no
    ``[B, T, vocab]`` logits; must divide ``B * (T - 1)``)."""
    B, T = tokens_BxT.shape
    h = self.hidden(tokens_BxT, mesh, segment_ids)[:, :-1]
    targets = tokens_BxT[:, 1:]
    if chunk_size:
      nll, _ = linear_cross_entropy(h.reshape(B * (T - 1), -1), self.embed[...],
                                    targets.reshape(-1), chunk_size=chunk_size)
      logp = -nll.reshape(B, T - 1)
    else:
      logp = jnp.take_along_axis(jax.nn.log_softmax(self.logits(h)), targets[..., None],
                                 axis=-1)[..., 0]
    if segment_ids is not None:
      ids = jnp.asarray(segment_ids)
      same = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)
      logp = jnp.where(same, logp, 0.0)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def num_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
