"""Decoding with the layers (zeco_jax.nn): ``prefill`` (the chunked op with its final state
and the short convolutions' last inputs) then ``decode`` one token at a time equals the
layer over the whole sequence, for GLA, Gated DeltaNet and KDA, with short convolutions,
K = 64;
packed documents and left or right padding in the prompt continue the row's last document;
the softmax attention layer (its KV cache; also with a sliding window, and with heads of
128) likewise;
``init_cache`` then ``decode`` from the first token equals the layer too; the prefill over
a data=2 x seq=4 mesh gives the cache and outputs of one device (here for the attention
layer's sliding window and heads of 128; the GLA, Gated DeltaNet, KDA and grouped-key
attention layers' prefill over the same mesh is checked through the LM, which calls it,
in tests/models/test_generation.py). Bars (relative norm, float32): 1e-5."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import rel_err
from zeco_jax.nn import GatedAttention, GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention

pytestmark = pytest.mark.usefixtures("compile_cache")

D, T0, T1 = 128, 64, 4


def gla():
  return GatedLinearAttention(D, 2, expand_k=1.0, use_short_conv=True, rngs=nnx.Rngs(0))


def gdn():
  return GatedDeltaNet(D, 2, head_dim=64, expand_v=1.0, rngs=nnx.Rngs(0))


def kda():
  return KimiDeltaAttention(D, 2, head_dim=64, expand_v=1.0, rngs=nnx.Rngs(0))


def attn():
  return GatedAttention(D, 4, num_kv_heads=2, head_dim=32, rngs=nnx.Rngs(0))


def attn_window():
  return GatedAttention(D, 4, num_kv_heads=2, head_dim=32, window=9, rngs=nnx.Rngs(0))


def attn_head128():
  return GatedAttention(D, 4, num_kv_heads=2, head_dim=128, rngs=nnx.Rngs(0))


LAYERS = {"gla": gla, "gdn": gdn, "kda": kda, "attn": attn, "attn_window": attn_window,
          "attn_head128": attn_head128}


@functools.lru_cache(maxsize=None)
def layer_and_steps(name):
  """The layer and its jitted full pass, prefill and decode (one compile per test module)."""
  layer = LAYERS[name]()
  graphdef, state = nnx.split(layer)
  full = jax.jit(lambda x, ids: nnx.merge(graphdef, state)(x, segment_ids=ids))
  prefill = jax.jit(lambda x, ids: nnx.merge(graphdef, state).prefill(x, segment_ids=ids))
  decode = jax.jit(lambda x, c: nnx.merge(graphdef, state).decode(x, c))
  decode_reserved = jax.jit(lambda x, c: nnx.merge(graphdef, state).decode(
      x, nnx.merge(graphdef, state).reserve(c, x.shape[1])))
  return layer, full, prefill, decode if not isinstance(layer, GatedAttention) else decode_reserved


def inputs(seed, B=2, T=T0 + T1):
  return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32)


def decode_after(decode, cache, x):
  outs = []
  for t in range(x.shape[1]):
    y, cache = decode(x[:, t:t + 1], cache)
    outs.append(y)
  return jnp.concatenate(outs, 1), cache


@pytest.mark.parametrize("name", LAYERS)
def test_prefill_then_decode_equals_the_layer(name):
  _, full, prefill, decode = layer_and_steps(name)
  x = inputs(0)
  want = full(x, None)
  y0, cache = prefill(x[:, :T0], None)
  y1, _ = decode_after(decode, cache, x[:, T0:])
  assert rel_err(y0, want[:, :T0]) <= 1e-5
  assert rel_err(y1, want[:, T0:]) <= 1e-5


@pytest.mark.parametrize("name", LAYERS)
def test_decode_from_an_empty_cache_equals_the_layer(name):
  layer, full, _, decode = layer_and_steps(name)
  x = inputs(1, T=6)
  y, cache = decode_after(decode, layer.init_cache(2), x)
  assert rel_err(y, full(x, None)) <= 1e-5
  if isinstance(layer, GatedAttention):
    assert cache.k.shape == (2, 6, layer.num_kv_heads, layer.head_dim)
    assert int(cache.length) == 6
  else:
    assert cache.state.shape == (2, 2, 64, 64) and cache.state.dtype == jnp.float32


@pytest.mark.parametrize("name", LAYERS)
def test_documents_and_padding_continue_the_last_document(name):
  """Row 0: two documents, the second continued; row 1: 20 tokens of left padding; row 2:
  15 tokens of right padding. Each decoded token equals the layer over the last document
  alone, followed by that token: the three sequences in one call of the layer, each
  followed by zeros up to the longest (the layer is causal: what comes after a token does
  not change its output)."""
  _, full, prefill, decode = layer_and_steps(name)
  x = inputs(2, B=3)
  ids = np.zeros((3, T0), np.int32)
  ids[0, 10:] = 1
  ids[1, :20] = -1
  ids[2, -15:] = -1
  _, cache = prefill(x[:, :T0], jnp.asarray(ids))
  y, _ = decode_after(decode, cache, x[:, T0:])
  alone = [jnp.concatenate([doc, x[row, T0:]]) for row, doc in
           enumerate([x[0, 10:T0], x[1, 20:T0], x[2, :T0 - 15]])]
  longest = max(len(a) for a in alone)
  want = full(jnp.stack([jnp.pad(a, ((0, longest - len(a)), (0, 0))) for a in alone]), None)
  for row, a in enumerate(alone):
    assert rel_err(y[row], want[row, len(a) - T1:len(a)]) <= 1e-5, row


# gla, gdn, kda and attn: LM.prefill over the same mesh calls their prefill with it, and
# tests/models/test_generation.py::test_prefill_on_a_mesh_equals_one_device compares every
# layer's cache and the logits with one device's (families gla, gdn, kda; attn in hybrid).
@pytest.mark.parametrize("name", ["attn_window", "attn_head128"])
def test_prefill_on_a_mesh_equals_one_device(name, devices):
  layer, _, prefill, _ = layer_and_steps(name)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), devices=devices)
  x = inputs(3, B=2, T=T0)
  ids = jnp.asarray(np.where(np.arange(T0) < 5, -1, 0)[None].repeat(2, 0).astype(np.int32))
  y, cache = prefill(x, ids)
  graphdef, state = nnx.split(layer)
  y_m, cache_m = jax.jit(
      lambda x, ids: nnx.merge(graphdef, state).prefill(x, mesh=mesh, segment_ids=ids))(x, ids)
  assert rel_err(y_m, y) <= 1e-5
  for got, want in zip(jax.tree.leaves(cache_m), jax.tree.leaves(cache)):
    assert rel_err(jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)) <= 1e-5
