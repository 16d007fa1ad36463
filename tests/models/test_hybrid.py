"""Hybrid LMs (model.layer_pattern): the blocks follow the pattern, the model on a
data=2 x seq=4 mesh equals one device (loss and gradients) for GLA and Gated DeltaNet
hybrids, documents do not see each other, and bad patterns or attention shapes are config
errors (decoding: tests/models/test_generation.py). Bars (relative norm, float32): 1e-5
forward, 1e-4 gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import rel_err
from models import GDNConfig, GLAConfig, LM, model_from_config

HYBRIDS = {
    "gla": GLAConfig(vocab_size=64, hidden_size=64, num_layers=4, num_heads=2,
                     layer_pattern="LLLA", attn_num_heads=4, attn_num_kv_heads=2),
    "gdn": GDNConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, expand_k=1.0,
                     layer_pattern="LA", attn_seq_method="all_gather"),
}
IDS = np.repeat([[0] * 30 + [1] * 34], 2, 0).astype(np.int32)


def test_blocks_follow_the_pattern():
  kinds = [type(b.attn).__name__ for b in LM(HYBRIDS["gla"], rngs=nnx.Rngs(0)).blocks()]
  assert kinds == ["GatedLinearAttention"] * 3 + ["GatedAttention"]


@pytest.mark.parametrize("family", HYBRIDS)
def test_mesh_equals_one_device(family, devices):
  model = LM(HYBRIDS[family], rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(0), (2, 64), 0, 64)
  ids = jnp.asarray(IDS)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def loss(state, mesh):
    logits = nnx.merge(graphdef, state)(tokens, mesh, ids)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, tokens[..., None], -1)[..., 0])

  one = jax.jit(jax.value_and_grad(lambda s: loss(s, None)))(state)
  many = jax.jit(jax.value_and_grad(lambda s: loss(s, mesh)))(state)
  assert rel_err(many[0], one[0]) <= 1e-5
  for got, want in zip(jax.tree.leaves(many[1]), jax.tree.leaves(one[1])):
    assert rel_err(got, want) <= 1e-4


def test_documents_are_independent():
  # One jitted program, run on both token sets (the model's jnp code eagerly: the greedy
  # tests of tests/models/test_generation.py).
  model = LM(HYBRIDS["gla"], rngs=nnx.Rngs(0))
  forward = jax.jit(lambda tokens: model(tokens, segment_ids=jnp.asarray(IDS)))
  tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, 64)
  a = forward(tokens)
  b = forward(tokens.at[:, :30].set(7))
  assert float(jnp.max(jnp.abs(a[:, 30:] - b[:, 30:]))) == 0.0


@pytest.mark.parametrize("fields,words", [
    ({"layer_pattern": "LXA"}, "letters L"),
    ({"layer_pattern": "LLA", "num_layers": 4}, "must tile"),
    ({"layer_pattern": "LA", "attn_num_heads": 4, "attn_num_kv_heads": 3}, "must divide"),
])
def test_bad_hybrid_settings_are_config_errors(fields, words):
  with pytest.raises(ValueError, match=words):
    cfg, cls = model_from_config({"family": "gla", "hidden_size": 64, "num_heads": 2,
                                  "num_layers": 2, **fields})
    cls(cfg, rngs=nnx.Rngs(0))
