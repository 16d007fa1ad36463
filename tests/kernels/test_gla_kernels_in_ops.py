"""The GLA kernels (Pallas interpreter on CPU) as the ops run them: zeco_gla's local pass
through the kernels against the token-by-token reference, and chunk_gla and zeco_gla
with the kernels on packed documents (``helpers.DOC_IDS``) against the float64 truth run
document by document. Bars (relative norm, float32): forward 1e-5, gradients 1e-4."""
import functools

import pytest

from helpers import check_documents, check_gla_against_recurrence, seq_mesh
from zeco_jax import chunk_gla, zeco_gla

pallas_kernels = pytest.importorskip("pallas_kernels")
C = 16


def test_zeco_gla_with_pallas_local_pass():
  # The local pass through the Pallas kernels (interpret mode on CPU) inside zeco_gla.
  op = functools.partial(zeco_gla, mesh=seq_mesh(2), num_blocks=2, chunk_size=16,
                         backend="pallas")
  check_gla_against_recurrence(op, 13, 1, 64, 2, 16, 16)


def test_chunk_gla_pallas_gpu_and_tpu_kernels():
  # The Triton-lowered GPU kernels and the Mosaic TPU kernels, both in the interpreter.
  check_documents(chunk_gla, chunk_size=C, backend="pallas")
  tpu = pallas_kernels.KernelConfig(platform="tpu", interpret=True)
  check_documents(chunk_gla, chunk_size=C, backend="pallas", kernel_config=tpu)


@pytest.mark.parametrize("n,method", [(2, "all_scan"), (8, "ring")])
def test_zeco_gla_pallas(n, method):
  check_documents(zeco_gla, mesh=seq_mesh(n), method=method, chunk_size=C, backend="pallas")
