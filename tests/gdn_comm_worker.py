"""Bytes per rank of the compiled jit(grad(zeco_gated_delta_rule)), for
tests/test_parallel_delta.py; run as a script for P beyond conftest's 8 devices.

    python tests/gdn_comm_worker.py METHOD P [P ...]   -> prints one JSON line {P: states}

States are units of M = B H K V 4 bytes (one float32 state).
"""
import json
import os
import sys

B, H, K, V, C = 1, 2, 8, 16, 16


def grad_bytes(method, n):
  """Max bytes any rank sends in jit(grad) of zeco_gated_delta_rule over n devices, in M."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  from zeco_jax.runtime.hlo_stats import collective_bytes
  from zeco_jax.ops.gated_delta.parallel import zeco_gated_delta_rule

  mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
  T = C * n
  shapes = [jax.ShapeDtypeStruct((B, T, H, d), jnp.float32) for d in (K, K, V)]
  shapes += [jax.ShapeDtypeStruct((B, T, H), jnp.float32)] * 2

  def loss(*a):
    return jnp.sum(zeco_gated_delta_rule(*a, mesh=mesh, method=method, num_blocks=4,
                                         chunk_size=C)[0])

  text = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4))).lower(*shapes).compile().as_text()
  return float(sum(collective_bytes(text, n).values()).max() / (B * H * K * V * 4))


if __name__ == "__main__":
  Ps = [int(p) for p in sys.argv[2:]]
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={max(Ps)}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  print(json.dumps({p: grad_bytes(sys.argv[1], p) for p in Ps}))
