"""Sequence-parallel Kimi Delta Attention compiled by the real TPU compiler (libtpu), without
a TPU.

``zeco_kda(..., backend="pallas", method="all_scan")`` forward + backward (jit(grad) of
sum(o) over q, k, v, g, beta; bf16 q, k, v, float32 per-channel g and beta; with and
without packed documents) over every chip of v5p:2x2x2 (seq axis 8), lowered with
ShapeDtypeStruct arguments and compiled (``benchmarks/tpu_aot_kernels.py``'s
:func:`compile_sp`, at its small test shape). The compiled HLO must hold the Mosaic KDA
kernels (the forward that keeps the chunk states, the backward), and the
collective-permute bytes the busiest chip sends must be the All-Scan's: one float32 K x V
state per rank forward and one in the reverse chain (as test_kda_parallel.py checks on
simulated CPU devices), plus the previous rank's last document id with ``segment_ids``;
no other collective. ``backend="auto"`` must pick the kernels on the TPU mesh. Needs
libtpu (``pip install -e '.[tpu]'``); skipped without it. Numerics are checked in the
interpreter (tests/kernels/test_kda_tpu.py); the P = 8 to 32 table at B1 T8192 H16 is the
benchmark's (benchmarks/results/tpu_aot_kernels.md).
"""
import os

import pytest

pytest.importorskip("libtpu", reason="TPU compiler not installed: pip install -e '.[tpu]'")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # beside another test worker's libtpu

import jax.numpy as jnp  # noqa: E402

from benchmarks import tpu_aot_kernels as aot  # noqa: E402

SHAPE = aot.SP_TEST_SHAPE            # B, tokens per chip, H, K, V
# pallas_kernels/kda/tpu.py's pallas_call names: fwd_res (forward, chunk states kept for
# the backward) and bwd_res.
KERNELS = {"kda_tpu_fwd", "kda_tpu_bwd"}
@pytest.mark.parametrize("segment_ids", [False, True], ids=["P8", "P8-segment_ids"])
def test_all_scan_with_mosaic_kernels_compiles_for_v5p(segment_ids):
  chips = 8
  compiled, _, mesh = aot.compile_sp("kda", chips, SHAPE, jnp.bfloat16,
                                     segment_ids=segment_ids)
  assert mesh.shape == {"seq": chips}
  text = compiled.as_text()
  names = aot.kernel_names(text)
  # One forward and one backward kernel per head group of the local pass.
  calls = aot.CALLS["kda"]["fwd+bwd"] * aot.delta_pieces(chips, SHAPE)
  assert len(names) == calls and set(names) == KERNELS, names
  sent = aot.sp_collectives(text, chips)
  B, L, H, K, V = SHAPE
  # One float32 K x V state per (b, h) forward and one back; with packed documents also
  # the previous rank's last id (B int32).
  expected = aot.SP_ALL_SCAN_STATES * aot.state_bytes(SHAPE) + (4 * B if segment_ids else 0)
  assert sent == {"collective-permute": expected}, sent
  # Every argument split over the chips: q, k, v (bf16), g [.., K] and beta (float32).
  m = compiled.memory_analysis()
  assert m.argument_size_in_bytes == B * L * (H * ((2 * K + V) * 2 + (K + 1) * 4)
                                              + (4 if segment_ids else 0))


def test_auto_backend_picks_the_kernels_on_a_v5p_mesh():
  compiled, _, _ = aot.compile_sp("kda", 8, SHAPE, jnp.bfloat16, backend="auto")
  text = compiled.as_text()
  assert set(aot.kernel_names(text)) == KERNELS
  assert aot.sp_collectives(text, 8) == {
      "collective-permute": aot.SP_ALL_SCAN_STATES * aot.state_bytes(SHAPE)}
