"""GLA at the shapes users run (``shape_sweep``): chunk_gla on one device, zeco_gla per
shard on a data=2 x seq=4 mesh, against the float64 truth (``gla_float64``)."""
import jax
import pytest

import zeco_jax
from shape_sweep import CASES, CHUNK, SHARD_CASES, check, gla_truth, inputs


@pytest.mark.parametrize("T,K,V,decay", CASES)
def test_chunk_gla_shapes(T, K, V, decay):
  q, k, v, g, w = inputs(T * 1000 + K, 1, T, 2, K, V, decay)
  check(lambda *a: zeco_jax.chunk_gla(*a, backend="jax")[0], gla_truth, (q, k, v, g), w,
        (T, K, V, decay), eager=(T, K) == (CHUNK, 128))


@pytest.mark.parametrize("L,K", SHARD_CASES)
def test_zeco_gla_shard_shapes(L, K, devices):
  """T = 4 L over seq = 4, B = 2 over data; inputs placed on the mesh (the README's use)."""
  q, k, v, g, w = inputs(L * 1000 + K, 2, 4 * L, 2, K, K, ("dim", "scalar")[L % 2])
  check(lambda *a: zeco_jax.zeco_gla(*a, backend="jax")[0], gla_truth, (q, k, v, g), w,
        (L, K), eager=L == CHUNK,
        mesh=jax.make_mesh((2, 4), ("data", "seq")))
