"""GatedAttention (zeco_jax.nn.attention), the softmax mixer of hybrid models: on a
data=2 x seq=4 mesh, with each method, it equals the layer on one device (forward and
gradients, documents crossing shards); a document's outputs do not depend on the documents
before it in the row; rotary embeddings keep norms and make scores depend on offsets only;
bad settings name the argument. Bars (relative norm, float32): 1e-5 forward, 1e-4
gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import rel_err
from zeco_jax.nn import GatedAttention
from zeco_jax.nn.attention import rotary

D, T = 64, 64


def layer(method="ulysses"):
  return GatedAttention(D, 4, num_kv_heads=2, head_dim=16, seq_method=method,
                        rngs=nnx.Rngs(0))


IDS = np.zeros((2, T), np.int32)
IDS[0, 20:] = 1          # crosses the shard boundary at 32
IDS[1, :6] = -1


@pytest.mark.parametrize("method", ["ulysses", "all_gather", "ring"])
def test_mesh_equals_one_device(method, devices):
  attn = layer(method)
  graphdef, state = nnx.split(attn)
  x = jax.random.normal(jax.random.key(1), (2, T, D))
  ids = jnp.asarray(IDS)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def loss(state, x, mesh):
    return jnp.sum(nnx.merge(graphdef, state)(x, mesh, ids) ** 2)

  one = jax.jit(jax.value_and_grad(lambda s, x: loss(s, x, None), argnums=(0, 1)))(state, x)
  many = jax.jit(jax.value_and_grad(lambda s, x: loss(s, x, mesh), argnums=(0, 1)))(state, x)
  assert rel_err(many[0], one[0]) <= 1e-5
  for got, want in zip(jax.tree.leaves(many[1]), jax.tree.leaves(one[1])):
    assert rel_err(got, want) <= 1e-4


def test_documents_do_not_see_each_other():
  attn = layer()
  x = jax.random.normal(jax.random.key(2), (2, T, D))
  y = attn(x, segment_ids=jnp.asarray(IDS))
  alone = attn(x[:1, 20:], segment_ids=None)
  assert rel_err(y[0, 20:], alone[0]) <= 1e-5


def test_rotary_depends_on_offsets_only():
  r = np.random.default_rng(0)
  q, k = (jnp.asarray(r.standard_normal((1, 1, 1, 16)), jnp.float32) for _ in range(2))
  pos = lambda p: jnp.full((1, 1), p, jnp.int32)
  score = lambda a, b: float(jnp.sum(rotary(q, pos(a), 1e4) * rotary(k, pos(b), 1e4)))
  assert abs(score(7, 3) - score(104, 100)) <= 1e-4 * abs(score(7, 3)) + 1e-6
  assert abs(float(jnp.linalg.norm(rotary(q, pos(9), 1e4))) - float(jnp.linalg.norm(q))) < 1e-5


def test_bad_settings_name_the_argument():
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
    GatedAttention(D, 4, num_kv_heads=3, head_dim=16, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="head_dim=15 must be even"):
    GatedAttention(D, 4, num_kv_heads=2, head_dim=15, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="seq_method"):
    GatedAttention(D, 4, num_kv_heads=2, head_dim=16, seq_method="zigzag", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="backend must be one of"):
    GatedAttention(D, 4, num_kv_heads=2, head_dim=16, backend="flash", rngs=nnx.Rngs(0))
  full = layer().init_cache(2)                      # no free slot: reserve() first
  with pytest.raises(ValueError, match=r"0 free slots for 1 tokens; call reserve"):
    layer().decode(jnp.zeros((2, 1, D), jnp.float32), full)
