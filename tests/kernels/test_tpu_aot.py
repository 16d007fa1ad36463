"""The Mosaic TPU kernels compiled by the real TPU compiler (libtpu), without a TPU.

Needs libtpu (``pip install -e '.[tpu]'``); skipped without it. For v5e, v5p and v6e (the
smallest topology of each), chunk_gla's Pallas backend with the TPU kernels
(``KernelConfig(platform="tpu", interpret=False)``) is lowered with ShapeDtypeStruct
arguments on one device of the topology and compiled by libtpu (Mosaic), forward and
forward + backward, bf16 and float32, at a small shape (B1 T1024 H2 K128 V128). The compiled
HLO must hold the Mosaic kernels (1 forward; 3 forward + backward: forward, the backward's
forward recompute, backward). The big shapes (kernel benchmark, 340M / 1.3B models) are
benchmarks/tpu_aot_kernels.py's, results in benchmarks/results/tpu_aot_kernels.md.
Numerics are checked in the interpreter (test_gla_kernels.py,
test_gla_kernel_decay_range.py).
"""
import os

import pytest

pytest.importorskip("libtpu", reason="TPU compiler not installed: pip install -e '.[tpu]'")
# Before the first topology call: quiets libtpu's start-up look-up of TPU hosts.
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax.numpy as jnp  # noqa: E402

from benchmarks import tpu_aot_kernels as aot  # noqa: E402

SHAPE = aot.SHAPES["small (test)"]


@pytest.fixture(scope="module", params=sorted(aot.GENERATIONS))
def mesh(request):
  return aot.one_device_mesh(aot.GENERATIONS[request.param])


@pytest.mark.parametrize("which", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_mosaic_kernels_compile_for_tpu(mesh, dtype, which):
  compiled, _ = aot.compile_kernels(mesh, SHAPE, dtype, which)
  assert compiled.as_text().count(aot.CUSTOM_CALL) == aot.EXPECTED_CALLS[which]
  m = compiled.memory_analysis()
  B, T, H, K, V = SHAPE
  item = jnp.dtype(dtype).itemsize
  assert m.argument_size_in_bytes == B * T * H * ((2 * K + V) * item + K * 4)
  assert m.temp_size_in_bytes < 64 * 2**20
