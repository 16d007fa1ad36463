"""Gated DeltaNet at the shapes users run (``shape_sweep``): chunk_gated_delta_rule on one
device, zeco_gated_delta_rule per shard on a data=2 x seq=4 mesh, against the float64 token
loop (``gdn_float64``). The cases of a test run side by side in its programs
(``shape_sweep.check_cases``)."""
import jax
import pytest

import zeco_jax
from shape_sweep import (CASES, CHUNK, SHARD_CASES, T_VALUES, check_cases, delta_inputs,
                         gdn_truth)


@pytest.mark.parametrize("T", T_VALUES)
def test_chunk_gated_delta_rule_shapes(T):
  """Every (K, V) at this T."""
  cases = []
  for _, K, V, _ in (c for c in CASES if c[0] == T):
    q, k, v, g, beta, w = delta_inputs(T * 1000 + K, 1, T, 2, K, V)
    cases.append(((q, k, v, g, beta), w, (T, K, V)))
  check_cases(lambda *a: zeco_jax.chunk_gated_delta_rule(*a)[0], gdn_truth, cases,
              eager=[what for _, _, what in cases if what[:2] == (CHUNK, 128)])


def test_zeco_gated_delta_rule_shard_shapes(devices):
  """Every (tokens per shard, K) of SHARD_CASES."""
  cases = []
  for L, K in SHARD_CASES:
    q, k, v, g, beta, w = delta_inputs(L * 1000 + K, 2, 4 * L, 2, K, K)
    cases.append(((q, k, v, g, beta), w, (L, K)))
  check_cases(lambda *a: zeco_jax.zeco_gated_delta_rule(*a)[0], gdn_truth, cases,
              eager=[(L, K) for L, K in SHARD_CASES if L == CHUNK],
              mesh=jax.make_mesh((2, 4), ("data", "seq")))
