"""ShortConvolution (zeco_jax.nn.common): on packed rows it does not read across a
document start or padding (each document equals the convolution of it alone), and on a
sequence mesh it refuses shards shorter than its halo."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeco_jax.nn import ShortConvolution


def test_short_convolution_does_not_read_across_a_start():
  conv = ShortConvolution(3, 4, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 20, 3)), jnp.float32)
  ids = jnp.asarray([[0] * 5 + [1] * 2 + [-1] * 2 + [2] * 11, [3] * 20], jnp.int32)
  y = conv(x, ids)
  for b, spans in ((0, [(0, 5), (5, 7), (7, 9), (9, 20)]), (1, [(0, 20)])):
    for s, e in spans:   # each document alone, as if it began the row
      np.testing.assert_allclose(y[b:b + 1, s:e], conv(x[b:b + 1, s:e]), atol=1e-6)
  assert not np.allclose(y[0], conv(x)[0])


def test_short_convolution_halo_needs_enough_tokens_per_shard(devices):
  conv = ShortConvolution(8, 4, rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((2, 4), ("data", "seq"))
  with pytest.raises(ValueError, match=r"ShortConvolution: a sequence shard holds T / 4 = 2 "
                     r"tokens, fewer than the convolution's halo of size - 1 = 3"):
    conv(jnp.ones((2, 8, 8)), mesh=mesh)
