"""Bytes per rank of the compiled jit(grad(zeco_gated_delta_rule)), for
test_gated_delta_parallel.py next to it; run as a script for P beyond conftest's 8 devices.

    python tests/ops/gated_delta/gdn_comm_worker.py METHOD P [P ...]
        -> prints one JSON line {P: states}

States are units of M = B H K V 4 bytes (one float32 state).
"""
import json
import os
import sys

B, H, K, V, C = 1, 2, 8, 16, 16
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))


def grad_bytes(method, n):
  """Max states any rank sends in jit(grad) of zeco_gated_delta_rule over n devices."""
  import jax
  import jax.numpy as jnp

  from helpers import gla_shapes, output_sum_grad, seq_mesh, states_sent_per_rank
  from zeco_jax.ops.gated_delta.parallel import zeco_gated_delta_rule

  # q, k, v and the per-head g and beta [B, T, H].
  shapes = gla_shapes(B, C * n, H, K, V)[:3] + [jax.ShapeDtypeStruct((B, C * n, H),
                                                                     jnp.float32)] * 2
  op = lambda *a: zeco_gated_delta_rule(*a, mesh=seq_mesh(n), method=method, num_blocks=4,
                                        chunk_size=C)
  sent = states_sent_per_rank(output_sum_grad(op, 5), shapes, n, B * H * K * V * 4)
  return float(sent.max())


if __name__ == "__main__":
  Ps = [int(p) for p in sys.argv[2:]]
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={max(Ps)}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path[:0] = [TESTS, os.path.dirname(TESTS)]     # helpers; the repository
  print(json.dumps({p: grad_bytes(sys.argv[1], p) for p in Ps}))
