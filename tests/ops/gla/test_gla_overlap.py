"""zeco_gla's All-Scan overlap (docs/design.md §4): the local pass split into head groups,
each tied to one send of the chain; batch_axes and the all-manual shard_map the kernels
need.

On 8 simulated CPU devices: overlap_pieces > 1 gives the same outputs, final state and
gradients as the unsplit pass (and the token-by-token reference); bad settings raise. With
libtpu: zeco_gla forward + backward compiled for a v5p topology with backend="auto" holds
the Mosaic kernels, and the TPU schedule has a kernel between the start and done of at
least 3 of 4 All-Scan collective-permutes, forward and backward (without the split: none).
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import check_gla_against_recurrence, gla_inputs, rel_err, seq_mesh
from zeco_jax import recurrent_gla, zeco_gla
from zeco_jax.ops.gla.parallel import default_overlap_pieces

B, T, H, K, V = 1, 256, 4, 8, 16


@pytest.mark.parametrize("pieces", [2, 4])
def test_split_local_pass_matches_reference(pieces):
  """Forward <= 1e-5, gradients <= 1e-4 relative to the float64 recurrence (P = 4)."""
  op = functools.partial(zeco_gla, mesh=seq_mesh(4), method="all_scan", num_blocks=2,
                         overlap_pieces=pieces, chunk_size=16, backend="jax")
  check_gla_against_recurrence(op, 3, B, T, H, K, V)


def test_default_pieces_and_errors():
  assert default_overlap_pieces("tpu", "all_scan", 8, 2, 16) == 8
  assert default_overlap_pieces("tpu", "all_scan", 64, 2, 16) == 16
  assert default_overlap_pieces("tpu", "all_gather", 8, 1, 16) == 1
  assert default_overlap_pieces("gpu", "all_scan", 8, 2, 16) == 1
  q, k, v, g, _ = gla_inputs(0, B, T, H, K, V)
  with pytest.raises(ValueError, match="overlap_pieces"):
    zeco_gla(q, k, v, g, mesh=seq_mesh(4), overlap_pieces=3, backend="jax")
  with pytest.raises(ValueError, match="overlap_pieces"):
    zeco_gla(q, k, v, g, mesh=seq_mesh(4), method="all_gather", overlap_pieces=2, backend="jax")
  mesh2 = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "seq"))
  q2, k2, v2, g2, _ = gla_inputs(0, 2, T, H, K, V)
  with pytest.raises(ValueError, match="batch_axes"):
    zeco_gla(q2, k2, v2, g2, mesh=mesh2, batch_axes="model", backend="jax")
  with pytest.raises(ValueError, match="batch_axes"):   # kernels need every axis manual
    zeco_gla(q2, k2, v2, g2, mesh=mesh2, backend="pallas")
  # Named, the data axis splits B and the kernels (interpreted here) run per shard.
  o, _ = zeco_gla(q2, k2, v2, g2, mesh=mesh2, batch_axes="data", backend="jax")
  o_r, _ = recurrent_gla(q2, k2, v2, g2)
  assert rel_err(o, o_r) <= 1e-5


def test_tpu_schedule_overlaps_every_send():
  pytest.importorskip("libtpu", reason="TPU compiler not installed: pip install -e '.[tpu]'")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  from zeco_jax.runtime import hlo_stats
  topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
  mesh = Mesh(np.array(topo.devices).reshape(1, 8), ("data", "seq"))
  Bt, L, Ht, Kt, Vt = 1, 512, 8, 128, 128
  s = NamedSharding(mesh, P("data", "seq"))
  sd = lambda d, dt: jax.ShapeDtypeStruct((Bt, 8 * L, Ht, d), dt, sharding=s)
  args = (sd(Kt, jnp.bfloat16), sd(Kt, jnp.bfloat16), sd(Vt, jnp.bfloat16), sd(Kt, jnp.float32))

  def report(pieces):
    def loss(*a):
      o = zeco_gla(*a, mesh=mesh, batch_axes="data", num_blocks=2, overlap_pieces=pieces)[0]
      return o.astype(jnp.float32).sum()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
      text = jax.jit(grads).lower(*args).compile().as_text()
    return text, hlo_stats.async_overlap(text)

  text, split = report(None)            # default on TPU: 8 pieces for the 8 sends
  assert 'custom_call_target="tpu_custom_call"' in text
  assert len(split) == 16               # 8 sends forward, 8 in the reverse chain
  for half in (split[:8], split[8:]):
    assert sum(kernels > 0 for _, kernels in half) >= 6, split
  _, whole = report(1)
  assert sum(kernels > 0 for _, kernels in whole) == 0, whole
