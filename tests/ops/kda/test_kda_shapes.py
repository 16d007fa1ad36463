"""Kimi Delta Attention's sequence-parallel op at the shapes users run (``shape_sweep``):
zeco_kda per shard on a data=2 x seq=4 mesh (tokens per shard below, at and just past a
chunk; K = V = 64, and 128 once), forward and gradients against the float64 token loop
(``kda_float64``): the local pass's backward runs the plain pass from the received state
(docs/design.md §9)."""
import jax
import jax.numpy as jnp
import pytest

import zeco_jax
from shape_sweep import CHUNK, SHARD_CASES, check, delta_inputs, inputs, kda_truth


@pytest.mark.parametrize("L,K", SHARD_CASES)
def test_zeco_kda_shard_shapes(L, K, devices):
  seed = L * 1000 + K
  q, k, v, _, beta, w = delta_inputs(seed, 2, 4 * L, 2, K, K)
  g = inputs(seed + 1, 2, 4 * L, 2, K, K, "dim")[3]            # a decay per key channel
  assert g.shape == q.shape and float(jnp.min(g)) < 0.0
  check(lambda *a: zeco_jax.zeco_kda(*a)[0], kda_truth, (q, k, v, g, beta), w, (L, K),
        eager=L == CHUNK, mesh=jax.make_mesh((2, 4), ("data", "seq")))
