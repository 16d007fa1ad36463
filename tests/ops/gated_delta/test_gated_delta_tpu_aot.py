"""Sequence-parallel Gated DeltaNet compiled by the real TPU compiler (libtpu), without a TPU.

``zeco_gated_delta_rule(..., backend="pallas", method="all_scan")`` forward + backward
(jit(grad) of sum(o) over q, k, v, g, beta; bf16 q, k, v, float32 g, beta; with and
without packed documents) over every chip of v5p:2x2x2 (seq axis 8) and v5p:2x4x4 (32),
lowered with ShapeDtypeStruct arguments and compiled (``benchmarks/tpu_aot_kernels.py``'s
:func:`compile_sp`, at its small test shape). The compiled HLO must hold the Mosaic Gated
DeltaNet kernels (the forward that keeps the chunk states, the backward), and the
collective-permute bytes the busiest chip sends must be the All-Scan's: one float32 K x V
state per rank forward and one in the reverse chain, the same at P = 8 and 32 (as
test_gated_delta_parallel.py checks on simulated CPU devices), plus the previous rank's
last document id with ``segment_ids``; no other collective. ``backend="auto"`` must pick
the kernels on the TPU mesh. Needs libtpu (``pip install -e '.[tpu]'``); skipped without
it. Numerics are checked in the interpreter (tests/kernels/test_gdn_tpu.py); the P = 8 to
32 table at B1 T8192 H16 is the benchmark's (benchmarks/results/tpu_aot_kernels.md).
"""
import os

import pytest

pytest.importorskip("libtpu", reason="TPU compiler not installed: pip install -e '.[tpu]'")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # beside another test worker's libtpu

import jax.numpy as jnp  # noqa: E402

from benchmarks import tpu_aot_kernels as aot  # noqa: E402

SHAPE = aot.SP_TEST_SHAPE            # B, tokens per chip, H, K, V
# pallas_kernels/gated_delta/tpu.py's pallas_call names: fwd_res (forward, chunk states
# kept for the backward) and bwd_res.
KERNELS = {"gdn_tpu_fwd", "gdn_tpu_bwd"}
@pytest.mark.parametrize("chips,segment_ids", [(8, False), (8, True), (32, False)],
                         ids=["P8", "P8-segment_ids", "P32"])
def test_all_scan_with_mosaic_kernels_compiles_for_v5p(chips, segment_ids):
  compiled, _, mesh = aot.compile_sp("gated_delta", chips, SHAPE, jnp.bfloat16,
                                     segment_ids=segment_ids)
  assert mesh.shape == {"seq": chips}
  text = compiled.as_text()
  names = aot.kernel_names(text)
  # One forward and one backward kernel per head group of the local pass.
  calls = aot.CALLS["gated_delta"]["fwd+bwd"] * aot.delta_pieces(chips, SHAPE)
  assert len(names) == calls and set(names) == KERNELS, names
  sent = aot.sp_collectives(text, chips)
  B, L, H, K, V = SHAPE
  # One float32 K x V state per (b, h) forward and one back, whatever P; with packed
  # documents also the previous rank's last id (B int32).
  expected = aot.SP_ALL_SCAN_STATES * aot.state_bytes(SHAPE) + (4 * B if segment_ids else 0)
  assert sent == {"collective-permute": expected}, sent
  # Every argument split over the chips: q, k, v (bf16) and g, beta (float32) of L tokens.
  m = compiled.memory_analysis()
  assert m.argument_size_in_bytes == B * L * (H * ((2 * K + V) * 2 + 2 * 4)
                                              + (4 if segment_ids else 0))


def test_auto_backend_picks_the_kernels_on_a_v5p_mesh():
  compiled, _, _ = aot.compile_sp("gated_delta", 8, SHAPE, jnp.bfloat16, backend="auto")
  text = compiled.as_text()
  assert set(aot.kernel_names(text)) == KERNELS
  assert aot.sp_collectives(text, 8) == {
      "collective-permute": aot.SP_ALL_SCAN_STATES * aot.state_bytes(SHAPE)}


def test_head_groups_put_a_kernel_beside_the_forward_sends():
  """The local pass in head groups (the TPU default: 8 at P = 8, H = 8): the All-Scan's
  blocks are the groups, G + P - 2 = 14 forward sends, and G - 1 = 7 of them have the next
  group's kernel scheduled beside them (none without the groups); the bytes stay one
  state per rank."""
  import jax
  from zeco_jax.runtime.hlo_stats import async_overlap
  shape = (1, 256, 8, 128, 128)
  mesh, _ = aot.sp_mesh(8)
  args = aot.sp_arguments("gated_delta", mesh, shape, jnp.bfloat16)
  counts = {}
  for pieces in (None, 1):
    fwd = lambda *a, pieces=pieces: aot.SP_OPS["gated_delta"](
        *a, mesh=mesh, method="all_scan", backend="pallas", overlap_pieces=pieces)[0]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      text = jax.jit(fwd).lower(*args).compile().as_text()
    overlap = async_overlap(text)
    counts[pieces] = (len(overlap), sum(1 for _, kernel in overlap if kernel))
    assert aot.sp_collectives(text, 8) == {"collective-permute": aot.state_bytes(shape)}
  assert aot.delta_pieces(8, shape) == 8
  assert counts == {None: (14, 7), 1: (8, 0)}, counts
