"""GLA at the shapes users run (``shape_sweep``): chunk_gla on one device, zeco_gla per
shard on a data=2 x seq=4 mesh, against the float64 truth (``gla_float64``). The cases of
a test run side by side in its programs (``shape_sweep.check_cases``)."""
import jax
import pytest

import zeco_jax
from shape_sweep import CASES, CHUNK, SHARD_CASES, T_VALUES, check_cases, gla_truth, inputs


@pytest.mark.parametrize("T", T_VALUES)
def test_chunk_gla_shapes(T):
  """Every (K, V) at this T, with the decay kind CASES gives it."""
  cases = []
  for _, K, V, decay in (c for c in CASES if c[0] == T):
    q, k, v, g, w = inputs(T * 1000 + K, 1, T, 2, K, V, decay)
    cases.append(((q, k, v, g), w, (T, K, V, decay)))
  check_cases(lambda *a: zeco_jax.chunk_gla(*a, backend="jax")[0], gla_truth, cases,
              eager=[what for _, _, what in cases if what[:2] == (CHUNK, 128)])


def test_zeco_gla_shard_shapes(devices):
  """Every (tokens per shard, K) of SHARD_CASES: T = 4 L over seq = 4, B = 2 over data;
  inputs placed on the mesh (the README's use)."""
  cases = []
  for L, K in SHARD_CASES:
    decay = ("dim", "scalar")[L % 2]
    q, k, v, g, w = inputs(L * 1000 + K, 2, 4 * L, 2, K, K, decay)
    cases.append(((q, k, v, g), w, (L, K, decay)))
  check_cases(lambda *a: zeco_jax.zeco_gla(*a, backend="jax")[0], gla_truth, cases,
              eager=[what for _, _, what in cases if what[0] == CHUNK],
              mesh=jax.make_mesh((2, 4), ("data", "seq")))
