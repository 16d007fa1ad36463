"""Kimi Delta Attention's sequence-parallel op at the shapes users run (``shape_sweep``):
zeco_kda per shard on a data=2 x seq=4 mesh (tokens per shard below, at and just past a
chunk; K = V = 64, and 128 once), forward and gradients against the float64 token loop
(``kda_float64``): the local pass's backward runs the plain pass from the received state
(docs/design.md §9). The cases run side by side in the test's programs
(``shape_sweep.check_cases``)."""
import jax
import jax.numpy as jnp

import zeco_jax
from shape_sweep import CHUNK, SHARD_CASES, check_cases, delta_inputs, inputs, kda_truth


def test_zeco_kda_shard_shapes(devices):
  """Every (tokens per shard, K) of SHARD_CASES."""
  cases = []
  for L, K in SHARD_CASES:
    seed = L * 1000 + K
    q, k, v, _, beta, w = delta_inputs(seed, 2, 4 * L, 2, K, K)
    g = inputs(seed + 1, 2, 4 * L, 2, K, K, "dim")[3]            # a decay per key channel
    assert g.shape == q.shape and float(jnp.min(g)) < 0.0
    cases.append(((q, k, v, g, beta), w, (L, K)))
  check_cases(lambda *a: zeco_jax.zeco_kda(*a)[0], kda_truth, cases,
              eager=[(L, K) for L, K in SHARD_CASES if L == CHUNK],
              mesh=jax.make_mesh((2, 4), ("data", "seq")))
