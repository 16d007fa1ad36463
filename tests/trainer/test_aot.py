"""trainer/aot.py: the trainer's whole train step compiled by libtpu for a TPU topology.

Needs libtpu (``pip install -e '.[tpu]'``); skipped without it. The tiny config (one GLA
block, no short convolution, so the only collective-permutes are the All-Scan's) is
compiled once for v5p:2x2x1 on a mesh data = 1 x seq = 4 with ``backend="auto"`` (the
Mosaic kernels), and the report of :mod:`trainer.aot` is checked against what the step
must hold: the Mosaic kernels, the optimizer state in the arguments, the All-Scan's bytes
(one state forward and one backward per chip: 2 B H K V x 4 bytes), the gradient all-reduce
over the 4 chips (ring: 2 (G - 1) / G of the float32 gradients), FLOPs and memory.
"""
import os

import pytest

pytest.importorskip("libtpu", reason="TPU compiler not installed: pip install -e '.[tpu]'")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

from configs import tiny_mqar  # noqa: E402
from helpers import run_train_py  # noqa: E402
from trainer import aot as compile_only  # noqa: E402


@pytest.fixture(scope="module")
def report():
  config = tiny_mqar.get_config()
  config.model.use_short_conv = False        # the All-Scan's permutes only
  config.mesh = "data=1,seq=4"
  compiled, info = compile_only.compile_train_step(config, "v5p:2x2x1")
  assert compiled is not None, info["oom"]
  return compile_only.analyse(compiled, info), config


def test_report_memory_flops_kernels(report):
  r, config = report
  n = r["params"]
  mem = r["memory"]
  assert r["chips"] == 4 and r["mesh"] == {"data": 1, "seq": 4}
  # Arguments: float32 params and both AdamW moments at least (replicated), and the batch.
  assert mem["arguments"] >= 3 * 4 * n
  assert mem["temporaries"] > 0 and mem["total"] >= mem["arguments"] + mem["temporaries"]
  assert r["fits"] and r["hbm_bytes"] == 95 * 2**30
  assert r["flops"] > 0
  assert r["tpu_custom_calls"] >= 3          # Mosaic forward, recompute, backward


def test_report_collectives(report):
  r, config = report
  m = config.model
  B, H = config.data.batch_size, m.num_heads
  K, V = int(m.hidden_size * m.expand_k) // H, int(m.hidden_size * m.expand_v) // H
  state = B * H * K * V * 4
  permutes = r["collectives"]["collective-permute"]
  assert permutes["bytes_per_chip"] == 2 * state * m.num_layers    # All-Scan fwd + reverse
  assert permutes["count"] >= 2
  assert r["permute_overlap"]["pairs"] == permutes["count"]
  # Gradients all-reduced over the 4 chips (the combined tuple all-reduces summed): ring
  # 2 (G - 1) / G = 1.5 x the float32 gradients, plus the step's smaller reductions (loss,
  # counts, norms: 16% more here). Reading only one result of a tuple gives far less.
  reduce = r["collectives"]["all-reduce"]["bytes_per_chip"]
  assert 1.5 * 4 * r["params"] <= reduce <= 1.25 * 1.5 * 4 * r["params"]
  text = compile_only.format_report(r)
  assert "collective-permute" in text and "fits" in text and "FLOPs" in text


def test_data_and_seq_mesh_compiles_with_kernels():
  """Mesh data = 2 x seq = 2: the trainer hands the batch axis to the GLA layer
  (``batch_axes``), so the Mosaic kernels run per (data, seq) shard instead of being refused
  ("cannot be automatically partitioned"). At seq = 2 a chip sends one All-Scan state of its
  half of the batch (seq rank 0 forward, rank 1 backward), and nothing is all-gathered: the
  embedding gradient's scatter once flattened [B, T] ids, which made the partitioner gather
  ids and gradients over seq."""
  config = tiny_mqar.get_config()
  config.model.use_short_conv = False
  config.mesh = "data=2,seq=2"
  compiled, info = compile_only.compile_train_step(config, "v5p:2x2x1")
  r = compile_only.analyse(compiled, info)
  assert r["mesh"] == {"data": 2, "seq": 2} and r["fits"]
  assert r["tpu_custom_calls"] >= 3
  m = config.model
  H = m.num_heads
  K, V = int(m.hidden_size * m.expand_k) // H, int(m.hidden_size * m.expand_v) // H
  state = (config.data.batch_size // 2) * H * K * V * 4
  assert r["collectives"]["collective-permute"]["bytes_per_chip"] == state * m.num_layers
  assert "all-gather" not in r["collectives"], r["collectives"]


def test_oom_message_parsed():
  msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (18.52G) exceeds available HBM (15.75G).")
  assert compile_only.oom_required_bytes(msg) == pytest.approx(18.52 * 2**30)


def test_train_py_flag_rejects_unknown_topology():
  out = run_train_py("--compile_only=v9:2x2", timeout=300)
  assert out.returncode == 1
  assert "train.py: compile_only: topology 'v9:2x2'" in out.stderr


def test_mesh_that_splits_a_physical_axis():
  """data = seq = 8 on v5p's 4x4x4 is no product of whole physical axes: the mesh splits
  one between the two axes instead of failing (the 64-chip Ulysses meshes of
  benchmarks/hybrid_reach_aot.py)."""
  devices = compile_only.topology_devices("v5p:4x4x4")
  mesh = compile_only.build_mesh({"data": 8, "seq": 8}, devices)
  assert dict(mesh.shape) == {"data": 8, "seq": 8}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
