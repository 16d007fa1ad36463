"""Gated DeltaNet at the shapes users run (``shape_sweep``): chunk_gated_delta_rule on one
device, zeco_gated_delta_rule per shard on a data=2 x seq=4 mesh, against the float64 token
loop (``gdn_float64``)."""
import jax
import pytest

import zeco_jax
from shape_sweep import CASES, CHUNK, SHARD_CASES, check, delta_inputs, gdn_truth


@pytest.mark.parametrize("T,K,V", [(T, K, V) for T, K, V, _ in CASES])
def test_chunk_gated_delta_rule_shapes(T, K, V):
  q, k, v, g, beta, w = delta_inputs(T * 1000 + K, 1, T, 2, K, V)
  check(lambda *a: zeco_jax.chunk_gated_delta_rule(*a)[0], gdn_truth, (q, k, v, g, beta), w,
        (T, K, V), eager=(T, K) == (CHUNK, 128))


@pytest.mark.parametrize("L,K", SHARD_CASES)
def test_zeco_gated_delta_rule_shard_shapes(L, K, devices):
  q, k, v, g, beta, w = delta_inputs(L * 1000 + K, 2, 4 * L, 2, K, K)
  check(lambda *a: zeco_jax.zeco_gated_delta_rule(*a)[0], gdn_truth, (q, k, v, g, beta), w,
        (L, K), eager=L == CHUNK,
        mesh=jax.make_mesh((2, 4), ("data", "seq")))
