"""GatedLinearAttention (zeco_jax.nn.gla): errors that name the argument, and the layer
(short convolution + zeco_gla over 4 sequence shards of a data x seq mesh) on packed rows
(``helpers.DOC_IDS``) equal to the layer run on one device and on a document alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from helpers import DOC_IDS, DOC_SHAPE, rel_err64
from zeco_jax.nn import GatedLinearAttention

B, T = DOC_SHAPE[:2]
FWD_TOL = 1e-5


def test_gla_layer_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"GatedLinearAttention: key dim 15 \(hidden_size \* "
                     r"expand_k\) must be positive and divisible by num_heads=4"):
    GatedLinearAttention(30, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="chunk_size must be a multiple of 16, got 24"):
    GatedLinearAttention(32, 2, chunk_size=24, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="seq_method must be one of"):
    GatedLinearAttention(32, 2, seq_method="pipeline", rngs=nnx.Rngs(0))


def test_layer_on_a_seq_mesh_equals_each_document_alone():
  # GatedLinearAttention (short convolution + zeco_gla over 4 shards) on a packed row equals
  # the layer run on each document by itself; the data x seq mesh keeps B split.
  layer = GatedLinearAttention(32, 2, use_short_conv=True, chunk_size=16, backend="jax",
                               rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, 32)), jnp.float32)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
  y = jax.jit(lambda x, ids: layer(x, mesh=mesh, segment_ids=ids))(x, jnp.asarray(DOC_IDS))
  one_device = jax.jit(lambda x, ids: layer(x, segment_ids=ids))(x, jnp.asarray(DOC_IDS))
  assert rel_err64(y, one_device) <= FWD_TOL
  # a document after leading padding, over the shard boundaries 64, 128 and 192 (each
  # length alone compiles once: one is enough here, the op itself is checked above)
  alone = jax.jit(layer)(x[1:2, 3:200])
  assert rel_err64(y[1:2, 3:200], alone) <= FWD_TOL
