"""Splash attention compiled by the real TPU compiler (libtpu), without a TPU: the one-device
op and Ulysses over the 4 chips of v5p:2x2x1 with ``backend="auto"`` (which must pick
splash on TPU), forward + backward in bf16, lowered with ShapeDtypeStruct arguments and
compiled; the compiled HLO must hold the Mosaic kernels (splash's forward and its fused
backward). Needs libtpu (``pip install -e '.[tpu]'``); skipped without it. Numerics are
checked in the interpreter (test_attention_backends.py)."""
import os

import pytest

pytest.importorskip("libtpu", reason="TPU compiler not installed: pip install -e '.[tpu]'")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # beside another test worker's libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from zeco_jax.ops.attention.op import attention  # noqa: E402
from zeco_jax.ops.attention.parallel import sp_attention  # noqa: E402

CUSTOM_CALL = 'custom_call_target="tpu_custom_call"'
B, T, H, HKV, D = 1, 2048, 8, 2, 128


def v5p_mesh(n):
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
  return Mesh(np.array(topo.devices[:n]), ("seq",))


@pytest.mark.parametrize("ranks", [1, 4])
def test_splash_compiles_for_v5p(ranks):
  mesh = v5p_mesh(ranks)
  s = NamedSharding(mesh, P(None, "seq"))
  sds = lambda h: jax.ShapeDtypeStruct((B, T, h, D), jnp.bfloat16, sharding=s)
  ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=s)

  def loss(q, k, v, ids):
    if ranks == 1:
      o = attention(q, k, v, segment_ids=ids)
    else:
      o = sp_attention(q, k, v, mesh=mesh, method="ulysses", segment_ids=ids)
    return o.astype(jnp.float32).sum()

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        sds(H), sds(HKV), sds(HKV), ids).compile()
  assert compiled.as_text().count(CUSTOM_CALL) >= 2       # forward, fused dq / dkv
