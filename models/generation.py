"""Sampling from a trained :class:`models.lm.LM`: prefill the prompt once, then one jitted
decode loop.

    tokens, lengths = generate(model, prompt_BxT, max_new_tokens=64)          # greedy
    tokens, lengths = generate(model, prompt_BxT, prompt_mask=mask, max_new_tokens=64,
                               temperature=0.8, top_p=0.95, eos_id=0, seed=1, mesh=mesh)

The prompt runs through :meth:`LM.prefill` (the chunked ops, sequence-parallel over
``mesh``'s seq axis, each layer ending with its state and its short convolutions' last
inputs); then a ``lax.while_loop`` samples a token per row from the last logits and feeds it
to :meth:`LM.decode` (each layer's ``fused_recurrent`` op: O(1) per token in the context
length), until ``max_new_tokens`` or every row has produced ``eos_id``. Prompts of different
lengths share a batch through ``prompt_mask`` (False on padding, left or right).

Everything that changes the compiled program (the model's graph, ``max_new_tokens``, the
sampling settings of :class:`Sampling`, the mesh) is a static argument; the prompt, the
parameters, ``eos_id`` and ``seed`` are not, so a new prompt of the same shape reuses the
program.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How a token is drawn from the logits (hashable: part of the compiled program).

  ``temperature`` 0: greedy (the argmax, no randomness); else the logits are divided by
  it, cut to the ``top_k`` most likely tokens (0: all) and to the smallest set whose
  probability reaches ``top_p`` (1.0: all), and a token is drawn from what is left."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
    if not (isinstance(self.top_k, int) and self.top_k >= 0):
      raise ValueError(f"top_k must be an int >= 0 (0: no cut), got {self.top_k!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1] (1: no cut), got {self.top_p}")

  def sample(self, logits_BxV, key):
    """int32 ``[B]``: one token per row of float32 logits."""
    if self.temperature == 0:
      return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits = logits_BxV.astype(jnp.float32) / self.temperature
    if self.top_k and self.top_k < logits.shape[-1]:
      kth = lax.top_k(logits, self.top_k)[0][:, -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p < 1:
      sorted_desc = -jnp.sort(-logits, axis=-1)
      probs = jax.nn.softmax(sorted_desc, axis=-1)
      # Keep a token while the probability of the tokens above it is below top_p (the
      # most likely token always stays).
      above = jnp.cumsum(probs, axis=-1) - probs
      cutoff = jnp.min(jnp.where(above < self.top_p, sorted_desc, jnp.inf), axis=-1,
                       keepdims=True)
      logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model, prompt_tokens, *, max_new_tokens: int, prompt_mask=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: Optional[int] = None, seed: int = 0, mesh=None, pad_id: int = 0):
  """New tokens after each row's prompt: ``(tokens int32 [B, max_new_tokens], lengths
  int32 [B])``.

  Args:
    model: a :class:`models.lm.LM` (any family).
    prompt_tokens: int ``[B, T]``; ``prompt_mask``: bool ``[B, T]``, True on the prompt
      (None: every token), so rows of different lengths are padded left or right.
    max_new_tokens: tokens to generate per row (the loop's bound).
    temperature, top_k, top_p: :class:`Sampling`.
    eos_id: a row stops after producing it (it is kept and counted in ``lengths``); the
      loop stops when every row has. None: every row runs ``max_new_tokens``.
    seed: the sampling key (the same seed, prompt and model give the same tokens).
    mesh: prefill the prompt over this mesh's seq axis (and batch axes, as the model was
      built); the decode loop runs on the devices the caches are on.
    pad_id: written after a row's EOS.
  """
  prompt = jnp.asarray(prompt_tokens)
  if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"generate: `prompt_tokens` must be integer [B, T], got {prompt.dtype} "
                     f"{prompt.shape}; for one prompt pass tokens[None].")
  B, T = prompt.shape
  if T == 0:
    raise ValueError("generate: `prompt_tokens` is empty (T = 0); give at least one token.")
  if not (isinstance(max_new_tokens, int) and max_new_tokens > 0):
    raise ValueError(f"generate: `max_new_tokens` must be a positive int, got "
                     f"{max_new_tokens!r}.")
  if prompt_mask is None:
    segment_ids = None
  else:
    mask = jnp.asarray(prompt_mask)
    if mask.shape != prompt.shape or mask.dtype != jnp.bool_:
      raise ValueError(f"generate: `prompt_mask` must be bool [B, T] = {prompt.shape} (True on "
                       f"the prompt, False on padding), got {mask.dtype} {mask.shape}.")
    if not isinstance(mask, jax.core.Tracer) and not bool(jnp.all(jnp.any(mask, axis=1))):
      raise ValueError("generate: a row of `prompt_mask` has no prompt token; every row "
                       "needs at least one.")
    segment_ids = jnp.where(mask, 0, -1).astype(jnp.int32)
  sampling = Sampling(float(temperature), top_k, float(top_p))
  graphdef, state = nnx.split(model)
  eos = jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32)
  return _generate(graphdef, state, prompt.astype(jnp.int32), segment_ids, eos,
                   jax.random.key(seed), max_new_tokens=max_new_tokens, sampling=sampling,
                   mesh=mesh, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "mesh",
                                             "pad_id"))
def _generate(graphdef, state, prompt, segment_ids, eos, key, *, max_new_tokens, sampling,
              mesh, pad_id):
  model = nnx.merge(graphdef, state)
  B = prompt.shape[0]
  logits, caches = model.prefill(prompt, mesh, segment_ids)
  caches = model.reserve(caches, max_new_tokens)        # the attention blocks' KV slots

  def cond(carry):
    i, _, _, done, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, logits, caches, done, out = carry
    token = sampling.sample(logits, jax.random.fold_in(key, i))
    token = jnp.where(done, pad_id, token)
    out = lax.dynamic_update_slice(out, token[:, None], (0, i))
    done = done | (token == eos)
    logits, caches = model.decode(token[:, None], caches)
    return i + 1, logits[:, 0], caches, done, out

  out = jnp.full((B, max_new_tokens), pad_id, jnp.int32)
  init = (jnp.int32(0), logits, caches, jnp.zeros((B,), bool), out)
  _, _, _, done, out = lax.while_loop(cond, body, init)
  # A row's length: up to and including its EOS, else all of max_new_tokens.
  is_eos = (out == eos) & (eos >= 0)
  first_eos = jnp.argmax(is_eos, axis=1)
  lengths = jnp.where(jnp.any(is_eos, axis=1), first_eos + 1, max_new_tokens)
  return out, lengths.astype(jnp.int32)


__all__ = ["Sampling", "generate"]
