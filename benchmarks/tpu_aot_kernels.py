"""Compile the Mosaic TPU kernels (pallas_kernels.gla.tpu, pallas_kernels.gated_delta.tpu,
pallas_kernels.kda.tpu) for real TPU generations, no TPU.

With libtpu installed (``pip install -e '.[tpu]'``), JAX compiles for a TPU topology on a
CPU-only host (a few minutes for the whole table on 2 cores). Per family the op with its
Pallas backend and the TPU kernels, ``chunk_gla(backend="pallas", kernel_config=
KernelConfig(platform="tpu", interpret=False))``, ``chunk_gated_delta_rule`` and
``chunk_kda`` likewise (``gated_delta.KernelConfig``, ``kda.KernelConfig``), forward and
forward + backward (``value_and_grad`` over every input but the state), are lowered with
ShapeDtypeStruct arguments on one device of the topology and compiled by libtpu (Mosaic
for the kernels), under ``use_abstract_mesh`` (else Pallas stops with "Unsupported TPU
device kind: cpu"). Per (family, generation, shape, dtype, pass): compile seconds, the
number of ``tpu_custom_call``s in the compiled HLO (:data:`CALLS`), memory_analysis (HBM
arguments / outputs / temporaries; Mosaic checks VMEM itself and fails the compile when a
kernel's blocks do not fit) and cost_analysis's FLOPs (the Gated DeltaNet and KDA kernels
declare their matmul FLOPs through ``pl.CostEstimate``; the GLA kernels declare none, so
GLA's count is only the XLA ops around its kernels); then the three families side by side
at one shape (:func:`compare_families`).

Then the sequence-parallel ops on those kernels (:func:`compile_sp`): ``zeco_gla``,
``zeco_gated_delta_rule`` and ``zeco_kda`` (``backend="pallas"``, ``method="all_scan"``),
jit(grad), over every chip of a v5p slice of P = 8, 16, 32 chips on one seq axis
(scale_aot's topologies), 8192 tokens per chip, H16, K = V = 128, bf16: per P and family
the Mosaic kernels in the HLO, the All-Scan's collective-permute bytes per chip (in
float32 K x V states: 2 expected at every P), per-chip memory and FLOPs
(:data:`SP_HEADER`).

  python -m benchmarks.tpu_aot_kernels          # all shapes -> results/tpu_aot_kernels.md
  python -m benchmarks.tpu_aot_kernels --quick  # the test's small shapes only, no file
  python -m benchmarks.tpu_aot_kernels --shape "bench B1 T8K H16"   # a selection, no file
  python -m benchmarks.tpu_aot_kernels --part sp   # the sequence-parallel table, no file

The environment record goes beside the table (``tpu_aot_kernels.env.json``).
"""
import argparse
import os
import re
import sys
import time
import traceback

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pallas_kernels
import zeco_jax
from pallas_kernels import gated_delta, kda
from benchmarks import _harness as harness

# Topology names accepted by libtpu 0.0.48.1 (the smallest of each generation).
GENERATIONS = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
# name -> (B, T, H, K, V). Kernel benchmark shapes (benchmarks/kernels.py) and the models'
# attention shapes: configs/gla_340m.py (hidden 1024, 4 heads, expand_k 0.5, expand_v 1,
# seq 16384, batch 8), configs/gla_1b3.py (hidden 2048, 4 heads, seq 32768, batch 8): the
# config's whole batch on one chip, and the 1.3B's one sequence per chip (B1), since its B8
# forward + backward needs more than v5e's 16 GiB of HBM.
SHAPES = {
    "small (test)": (1, 1024, 2, 128, 128),
    "bench B1 T8K H16": (1, 8192, 16, 128, 128),
    "bench B1 T16K H16": (1, 16384, 16, 128, 128),
    "bench B8 T4K H4 V256": (8, 4096, 4, 128, 256),
    "gla_340m B8 T16K H4 K128 V256": (8, 16384, 4, 128, 256),
    "gla_1b3 B8 T32K H4 K256 V512": (8, 32768, 4, 256, 512),
    "gla_1b3 B1 T32K H4 K256 V512": (1, 32768, 4, 256, 512),
}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
FAMILIES = ("gla", "gated_delta", "kda")
# The shapes each family compiles at: Gated DeltaNet and KDA skip GLA's model configs.
_DELTA_SHAPES = tuple(n for n in SHAPES if not n.startswith("gla_"))
FAMILY_SHAPES = {"gla": tuple(SHAPES), "gated_delta": _DELTA_SHAPES, "kda": _DELTA_SHAPES}
CUSTOM_CALL = 'custom_call_target="tpu_custom_call"'
# Mosaic kernels per compiled pass. GLA fwd+bwd: the forward, the backward's forward
# recompute that emits the chunk states, the backward kernel. Gated DeltaNet fwd+bwd: the
# forward emitting the chunk states (kept as the residual), the backward kernel; KDA the same.
CALLS = {"gla": {"fwd": 1, "fwd+bwd": 3}, "gated_delta": {"fwd": 1, "fwd+bwd": 2},
         "kda": {"fwd": 1, "fwd+bwd": 2}}
EXPECTED_CALLS = CALLS["gla"]
NOTES = (
    "What it means: every kernel compiled for every generation, shape and dtype, with "
    "whole-chunk blocks (`[C, D]` tiles of q, k, v, g, o and one float32 `[K, V]` state, "
    "C = 64): no tile change was needed for VMEM (memory_analysis does not report VMEM; a "
    "kernel over the scoped VMEM limit would fail the compile). The HBM rows put the 1.3B "
    "config's whole batch (B8, meant to be split over data-parallel chips) on one chip: its "
    "backward keeps every chunk state h[n] in float32 between the recompute and the backward "
    "kernel, B*H*(T/64)*K*V*4 bytes = 8 GiB at B8 T32K H4 K256 V512, which with the rest "
    "exceeds v5e's 16 GiB (it fits v5p and v6e; one sequence per chip, B1, fits all three). "
    "Compiled is not run: numerics on a chip and speed are unverified.")
CONFIG = pallas_kernels.KernelConfig(platform="tpu", interpret=False)
GDN_CONFIG = gated_delta.KernelConfig(platform="tpu", interpret=False)
KDA_CONFIG = kda.KernelConfig(platform="tpu", interpret=False)


def one_device_mesh(topology_name):
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
  return Mesh(np.array(topo.devices[:1]), ("x",))


def _fwd(q, k, v, g):
  return zeco_jax.chunk_gla(q, k, v, g, backend="pallas", kernel_config=CONFIG)[0]


def _fwd_bwd(q, k, v, g):
  loss = lambda *a: _fwd(*a).astype(jnp.float32).sum()
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, g)


def _gdn_fwd(q, k, v, g, beta):
  return zeco_jax.chunk_gated_delta_rule(q, k, v, g, beta, backend="pallas",
                                         kernel_config=GDN_CONFIG)[0]


def _gdn_fwd_bwd(q, k, v, g, beta):
  loss = lambda *a: _gdn_fwd(*a).astype(jnp.float32).sum()
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)


def _kda_fwd(q, k, v, g, beta):
  return zeco_jax.chunk_kda(q, k, v, g, beta, backend="pallas", kernel_config=KDA_CONFIG)[0]


def _kda_fwd_bwd(q, k, v, g, beta):
  loss = lambda *a: _kda_fwd(*a).astype(jnp.float32).sum()
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)


PASSES = {"fwd": _fwd, "fwd+bwd": _fwd_bwd}
FAMILY_PASSES = {"gla": PASSES, "gated_delta": {"fwd": _gdn_fwd, "fwd+bwd": _gdn_fwd_bwd},
                 "kda": {"fwd": _kda_fwd, "fwd+bwd": _kda_fwd_bwd}}


def _arguments(family, mesh, shape, dtype):
  """ShapeDtypeStructs on mesh: GLA q, k, v, per-dim g (float32); Gated DeltaNet q, k,
  v, g and beta ([B, T, H], float32); KDA q, k, v, per-channel g ([B, T, H, K]) and beta
  (float32)."""
  B, T, H, K, V = shape
  s = NamedSharding(mesh, P())
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  qkv = (sds((B, T, H, K), dtype), sds((B, T, H, K), dtype), sds((B, T, H, V), dtype))
  if family == "gla":
    return (*qkv, sds((B, T, H, K), jnp.float32))
  g = sds((B, T, H, K) if family == "kda" else (B, T, H), jnp.float32)
  return (*qkv, g, sds((B, T, H), jnp.float32))


def compile_kernels(mesh, shape, dtype, which, family="gla"):
  """Compile one pass of ``family`` for mesh's TPU; returns (compiled, seconds)."""
  args = _arguments(family, mesh, shape, dtype)
  t0 = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(FAMILY_PASSES[family][which]).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def flops(compiled):
  """cost_analysis's FLOPs (None where it reports none)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return (cost or {}).get("flops")


def mib(n):
  return f"{n / 2**20:.1f}"


# --- the sequence-parallel ops over the chips of a v5p slice ------------------------------
# zeco_gla and zeco_gated_delta_rule (backend="pallas": the Mosaic kernels in the local pass;
# method="all_scan"), forward + backward, over every chip of a v5p slice on one seq axis
# (benchmarks/scale_aot.py's topologies and trainer.aot's mesh), SP_SHAPE's tokens per chip.
SP_CHIPS = (8, 16, 32)
SP_SHAPE = (1, 8192, 16, 128, 128)       # B, tokens per chip, H, K, V (bench B1 T8K H16)
SP_TEST_SHAPE = (1, 256, 2, 128, 128)    # tests/ops/gated_delta/test_gated_delta_tpu_aot.py
SP_METHOD = "all_scan"
SP_ALL_SCAN_STATES = 2     # per chip: one float32 K x V state forward, one in the reverse


SP_OPS = {"gla": zeco_jax.zeco_gla, "gated_delta": zeco_jax.zeco_gated_delta_rule,
          "kda": zeco_jax.zeco_kda}


def sp_mesh(chips):
  """``(mesh, topology name)``: a seq axis over every chip of the v5p slice of ``chips``
  (scale_aot.TOPOLOGY), built as trainer.aot builds a data = 1 mesh."""
  from benchmarks.scale_aot import TOPOLOGY
  from trainer import aot
  name = TOPOLOGY[chips]
  devices = aot.topology_devices(name)
  assert len(devices) == chips, (name, len(devices))
  return aot.build_mesh({"data": 1, "seq": chips}, devices), name


def sp_arguments(family, mesh, shape, dtype, segment_ids=False):
  """ShapeDtypeStructs split over the seq axis (``shape`` = B, tokens per chip, H, K, V):
  as :func:`_arguments` for the whole sequence, then the [B, T] int32 segment ids."""
  B, L, H, K, V = shape
  T = L * mesh.shape["seq"]
  s = NamedSharding(mesh, P(None, "seq"))
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  qkv = (sds((B, T, H, K), dtype), sds((B, T, H, K), dtype), sds((B, T, H, V), dtype))
  gates = ((sds((B, T, H, K), jnp.float32),) if family == "gla" else
           (sds((B, T, H, K) if family == "kda" else (B, T, H), jnp.float32),
            sds((B, T, H), jnp.float32)))
  return (*qkv, *gates) + ((sds((B, T), jnp.int32),) if segment_ids else ())


def compile_sp(family, chips, shape=SP_SHAPE, dtype=jnp.bfloat16, *, backend="pallas",
               method=SP_METHOD, segment_ids=False, overlap_pieces=None):
  """Compile jit(grad) of sum(o) of the sequence-parallel op of ``family`` (grads of every
  array input but the ids) over the v5p slice of ``chips``; ``(compiled, seconds, mesh)``.
  ``overlap_pieces``: passed on to the op (None: its default)."""
  mesh, _ = sp_mesh(chips)
  op = SP_OPS[family]
  args = sp_arguments(family, mesh, shape, dtype, segment_ids)
  n = len(args) - bool(segment_ids)

  def loss(*a):
    ids = a[n] if segment_ids else None
    o = op(*a[:n], mesh=mesh, method=method, backend=backend, segment_ids=ids,
           overlap_pieces=overlap_pieces)[0]
    return o.astype(jnp.float32).sum()

  t0 = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(jax.grad(loss, argnums=tuple(range(n)))).lower(*args).compile()
  return compiled, time.perf_counter() - t0, mesh


_KERNEL_NAME = re.compile(r'op_name="(?:[^"]*/)?(\w+)/pallas_call"')


def kernel_names(text):
  """The pallas_call names of the Mosaic custom calls of a compiled HLO text."""
  return [m.group(1) if m else None for m in
          (_KERNEL_NAME.search(line) for line in text.splitlines() if CUSTOM_CALL in line)]


def delta_pieces(chips, shape):
  """The head groups a delta-rule family's local pass takes by default on a v5p slice of
  ``chips`` (each group launches its own forward and backward kernel)."""
  from zeco_jax._chunks import default_overlap_pieces
  return default_overlap_pieces("tpu", SP_METHOD, chips, shape[2])


def state_bytes(shape):
  """Bytes of one float32 K x V state of every (b, h): B H K V 4."""
  B, _, H, K, V = shape
  return B * H * K * V * 4


def sp_collectives(text, chips):
  """``{kind: bytes the busiest chip sends}`` in a compiled program's HLO
  (zeco_jax.runtime.hlo_stats.collective_bytes)."""
  from zeco_jax.runtime.hlo_stats import collective_bytes
  return {kind: float(np.max(sent)) for kind, sent in collective_bytes(text, chips).items()}


SP_HEADER = ("| family | P | topology | context | compiled | compile s | tpu_custom_calls | "
             "permutes (with a kernel beside) | permute MiB per chip | states per chip | "
             "other collectives MiB | args MiB | outputs MiB | temp MiB | code MiB | "
             "GFLOP per chip |")


def sp_row(family, chips, shape=SP_SHAPE, dtype=jnp.bfloat16):
  """``(row, failure, figures)``: one row of the sequence-parallel table, its failure (None
  when it compiled with 2 states per chip, and Gated DeltaNet's / KDA's 2 kernels) and its
  figures
  (None when it did not compile)."""
  from zeco_jax.runtime.hlo_stats import async_overlap
  B, L, H, K, V = shape
  where = f"| {family} | {chips} | {sp_mesh(chips)[1]} | {chips * L // 1024}K"
  try:
    compiled, secs, _ = compile_sp(family, chips, shape, dtype)
  except Exception as e:  # noqa: BLE001 - recorded in the table
    msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    traceback.print_exc()
    return f"{where} | NO: {msg} |" + " |" * 11, (family, chips, str(e)), None
  text = compiled.as_text()
  calls = text.count(CUSTOM_CALL)
  sent = sp_collectives(text, chips)
  permute = sent.pop("collective-permute", 0.0)
  states = permute / state_bytes(shape)
  overlap = async_overlap(text)
  m = compiled.memory_analysis()
  f = flops(compiled)
  bad = []
  if states != SP_ALL_SCAN_STATES:
    bad.append(f"{states:g} states")
  if family in ("gated_delta", "kda") and calls != CALLS[family]["fwd+bwd"] * delta_pieces(
      chips, shape):
    bad.append(f"{calls} custom calls")
  if not calls:
    bad.append("no kernel")
  row = (f"{where} | {'yes' if not bad else 'NO: ' + ', '.join(bad)} | {secs:.1f} | {calls} | "
         f"{len(overlap)} ({sum(1 for _, k in overlap if k)}) | {mib(permute)} | "
         f"{states:.2f} | {mib(sum(sent.values()))} | {mib(m.argument_size_in_bytes)} | "
         f"{mib(m.output_size_in_bytes)} | {mib(m.temp_size_in_bytes)} | "
         f"{mib(m.generated_code_size_in_bytes)} | "
         f"{'' if f is None else f'{f / 1e9:.1f}'} |")
  figures = dict(states=states, permutes=len(overlap),
                 with_kernel=sum(1 for _, k in overlap if k), temp=m.temp_size_in_bytes,
                 flops=f)
  return row, ((family, chips, ", ".join(bad)) if bad else None), figures


def sp_summary(figures):
  """Lines on the sequence-parallel table: ``figures`` is ``{(family, chips): figures}``."""
  lines = []
  for family in FAMILIES:
    have = sorted((c, f) for (fam, c), f in figures.items() if fam == family and f)
    if not have:
      continue
    each = lambda fmt: ", ".join(fmt(f) for _, f in have)
    lines.append(
        f"- {family}: states per chip {each(lambda f: format(f['states'], '.2f'))} at P = "
        f"{', '.join(str(c) for c, _ in have)}; temporaries {each(lambda f: mib(f['temp']))} "
        f"MiB; permutes with a kernel beside "
        f"{each(lambda f: str(f['with_kernel']) + ' of ' + str(f['permutes']))}.")
  return lines + [
      "- Overlap: GLA computes S_p with one GEMM before its local pass and splits the pass "
      "into head groups tied to the sends (`overlap_pieces`). Gated DeltaNet's and KDA's "
      "S_p come only from the whole widened walk, so their local pass runs in head groups "
      "that are the All-Scan's blocks (the largest divisor of H not above P: 8 groups at "
      "P = 8, 16 from P = 16): group j + 1's kernels run while block j is sent, so G - 1 "
      "forward sends of the G + P - 2 have a kernel beside them and the pipeline drains "
      "bare; one forward and one backward kernel per group (tpu_schedule.md).",
      "- Against one chip (the `bench B1 T8K H16` bf16 fwd+bwd rows above): Gated "
      "DeltaNet's and KDA's kernels run on the widened state (V + K = 256 value columns), "
      "so their declared FLOPs and their kept chunk states (float32 K x (V + K) per chunk "
      "and head) grow over the one-chip op's; GLA's local pass keeps the one-chip width. "
      "FLOPs: Gated DeltaNet's and KDA's counts are their kernels' declared matmul work "
      "plus the XLA ops; GLA's omits its kernels (they declare none): do not compare GLA's "
      "column with the others."]


SP_TEXT = (
    "## The sequence-parallel ops over v5p chips (All-Scan, forward + backward)",
    "",
    "`zeco_gla`, `zeco_gated_delta_rule` and `zeco_kda` with `backend=\"pallas\"` (the "
    "Mosaic kernels above in the local pass; Gated DeltaNet's and KDA's on the widened "
    "state, V + K value columns) "
    "and `method=\"all_scan\"`, `jit(grad)` of sum(o) over q, k, v and the gates, bf16 "
    "(g, beta float32), compiled by libtpu for every chip of a v5p slice on one seq axis "
    "(`benchmarks/scale_aot.py`'s topologies, `trainer.aot`'s data = 1 mesh), B1, 8192 "
    "tokens per chip (context 8192 P), H16, K = V = 128: per chip the one-chip "
    "`bench B1 T8K H16` shape of the table above. `permutes`: collective-permutes in the "
    "compiled HLO (in brackets: with a Mosaic kernel scheduled between start and done, "
    "`hlo_stats.async_overlap`). `permute MiB per chip`: the bytes the busiest chip sends "
    "(`zeco_jax.runtime.hlo_stats.collective_bytes`); `states per chip`: those bytes over "
    "one float32 K x V state of every head (B H K V 4 = 1 MiB), expected 2 (one state "
    "forward, one in the reverse chain) at every P. `other collectives`: every other kind "
    "(none expected: the op has no parameters to reduce). Memory: `memory_analysis()` per "
    "chip. `GFLOP per chip`: cost_analysis; Gated DeltaNet's and KDA's kernels declare "
    "their matmul FLOPs (on V + K columns), GLA's declare none, so GLA's figure counts "
    "only the XLA ops around its kernels (the fix-up GEMM and the scan's combines) and "
    "does not compare with the others. Compiled, not run.",
    "")


COMPARE_SHAPE = "bench B1 T8K H16"


def compare_families(figures):
  """Lines of the families side by side at :data:`COMPARE_SHAPE`: ``figures`` is
  ``{(family, generation, shape, dtype, pass): (temp bytes, flops)}``."""
  have = [f for f in FAMILIES if any(key[0] == f and key[2] == COMPARE_SHAPE
                                     for key in figures)]
  if len(have) < 2:
    return []
  head = ("| generation | dtype | pass | "
          + " | ".join(f"{f} temp MiB" for f in have) + " | "
          + " | ".join(f"{f} GFLOP" for f in have) + " |")
  lines = ["## KDA beside GLA and Gated DeltaNet (one chip, `" + COMPARE_SHAPE + "`)", "",
           "The rows above at " + COMPARE_SHAPE + " (B1 T8192 H16 K = V = 128, chunk 64) side "
           "by side: HBM temporaries (`memory_analysis()`; the arguments are q, k, v plus "
           "the gates, the outputs the same shapes) and cost_analysis FLOPs. KDA's kernels "
           "declare their matmul FLOPs as Gated DeltaNet's do (`pl.CostEstimate`), with the "
           "float32 HIGHEST products (the per-sub-chunk decay sums, the UT inverse, the "
           "decay gradient's cumsums) counted once; GLA's kernels declare none, so its "
           "column counts only the XLA ops around them (not comparable).", "",
           head, "|" + "---|" * (3 + 2 * len(have))]
  for gen in GENERATIONS:
    for dname in DTYPES:
      for which in PASSES:
        cells = [figures.get((f, gen, COMPARE_SHAPE, dname, which)) for f in have]
        temp = [("" if c is None else mib(c[0])) for c in cells]
        fl = [("" if c is None or c[1] is None else f"{c[1] / 1e9:.1f}") for c in cells]
        lines.append(f"| {gen} | {dname} | {which} | " + " | ".join(temp + fl) + " |")
  return lines


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="small shape only, no results file")
  ap.add_argument("--shape", action="append", choices=sorted(SHAPES),
                  help="only these shapes (repeatable); prints, writes no file")
  ap.add_argument("--family", action="append", choices=FAMILIES,
                  help="only these families (repeatable); prints, writes no file")
  ap.add_argument("--part", action="append", choices=("kernels", "sp"),
                  help="only the one-chip kernel table or the sequence-parallel one "
                       "(repeatable); prints, writes no file")
  ap.add_argument("--out", default=os.path.join(harness.RESULTS, "tpu_aot_kernels.md"))
  a = ap.parse_args()
  selected = a.shape or (["small (test)"] if a.quick else list(SHAPES))
  parts = a.part or ["kernels", "sp"]
  families = (a.family or list(FAMILIES)) if "kernels" in parts else []
  write = not (a.quick or a.shape or a.family or a.part)
  header = ("| family | generation | shape (B, T, H, K, V) | dtype | pass | compiled | "
            "compile s | tpu_custom_calls | args MiB | outputs MiB | temp MiB | code MiB | "
            "GFLOP |")
  rows = [header, "|" + "---|" * 13]
  if families:
    print(header, flush=True)
  failures, hbm, compared = [], [], {}
  t_all = time.perf_counter()
  for family in families:
    expected = CALLS[family]
    shapes = {n: SHAPES[n] for n in selected if n in FAMILY_SHAPES[family]}
    for gen, topo_name in GENERATIONS.items():
      mesh = one_device_mesh(topo_name)
      kind = mesh.devices.flat[0].device_kind
      for sname, shape in shapes.items():
        for dname, dtype in DTYPES.items():
          for which in PASSES:
            where = f"| {family} | {gen} ({topo_name}"
            try:
              compiled, secs = compile_kernels(mesh, shape, dtype, which, family)
              n = compiled.as_text().count(CUSTOM_CALL)
              m = compiled.memory_analysis()
              f = flops(compiled)
              ok = "yes" if n == expected[which] else f"calls != {expected[which]}"
              row = (f"{where}, {kind}) | {sname}: {shape} | {dname} | {which} | "
                     f"{ok} | {secs:.1f} | {n} | {mib(m.argument_size_in_bytes)} | "
                     f"{mib(m.output_size_in_bytes)} | {mib(m.temp_size_in_bytes)} | "
                     f"{mib(m.generated_code_size_in_bytes)} | "
                     f"{'' if f is None else f'{f / 1e9:.1f}'} |")
              compared[family, gen, sname, dname, which] = (m.temp_size_in_bytes, f)
              if n != expected[which]:
                failures.append((family, gen, sname, dname, which, f"{n} custom calls"))
            except Exception as e:  # noqa: BLE001 - recorded in the table
              msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
              if "Ran out of memory on HBM" in msg:
                # The program needs more HBM than one chip has: the kernels compiled, the
                # whole program does not fit (a sizing fact, not a kernel failure).
                row = (f"{where}) | {sname}: {shape} | {dname} | {which} | "
                       f"HBM: {msg} | | | | | | | |")
                hbm.append((family, gen, sname, dname, which, msg))
              else:
                row = (f"{where}) | {sname}: {shape} | {dname} | {which} | "
                       f"NO: {msg} | | | | | | | |")
                failures.append((family, gen, sname, dname, which, str(e)))
                traceback.print_exc()
            rows.append(row)
            print(row, flush=True)
  # The sequence-parallel ops, GLA beside Gated DeltaNet and KDA at each P (--quick: the test's
  # shape at P = 8).
  sp_rows, sp_failures, sp_figures = [SP_HEADER, "|" + "---|" * 16], [], {}
  if "sp" in parts and not a.shape:
    print(SP_HEADER, flush=True)
    for chips in ((8,) if a.quick else SP_CHIPS):
      for family in (a.family or list(FAMILIES)):
        row, bad, sp_figures[family, chips] = sp_row(
            family, chips, SP_TEST_SHAPE if a.quick else SP_SHAPE)
        sp_rows.append(row)
        print(row, flush=True)
        if bad:
          sp_failures.append(bad)
  total = time.perf_counter() - t_all
  print(f"total {total:.0f} s; {len(failures)} failures; {len(hbm)} over one chip's HBM; "
        f"{len(sp_failures)} sequence-parallel failures", flush=True)
  if write:
    env = harness.environment()
    harness.write_environment(os.path.dirname(os.path.abspath(a.out)), "tpu_aot_kernels")
    lines = [
        "# Mosaic TPU kernels compiled for v5e, v5p, v6e without a TPU",
        "",
        "Question: do the GLA, Gated DeltaNet and Kimi Delta Attention (KDA) Mosaic TPU "
        "kernels compile for each TPU generation, at the benchmark and model shapes, bf16 "
        "and float32, and what HBM do they need? And do the sequence-parallel ops on them "
        "(`zeco_gla`, `zeco_gated_delta_rule`, `zeco_kda`, All-Scan) compile for v5p "
        "slices of 8 to 32 chips, with what bytes per chip, memory and FLOPs?",
        "",
        f"`python -m benchmarks.tpu_aot_kernels` ({harness.env_line(env)}, CPU host, total "
        f"{total:.0f} s). Each row: `chunk_gla(backend=\"pallas\", "
        "kernel_config=KernelConfig(platform=\"tpu\", interpret=False))` jitted and "
        "compiled by libtpu for one device of the topology (Gated DeltaNet: "
        "`chunk_gated_delta_rule` likewise, KDA: `chunk_kda`, each with its own "
        "KernelConfig); "
        "`fwd` the output, `fwd+bwd` value_and_grad over every input but the state (GLA "
        "q, k, v, g per-dim; Gated DeltaNet q, k, v, g, beta per head; KDA q, k, v, g per "
        "key channel, beta per head; g and beta float32; "
        "chunk 64). `tpu_custom_calls`: Mosaic "
        "kernels in the compiled HLO (expected GLA fwd 1, fwd+bwd 3; Gated DeltaNet and "
        "KDA fwd 1, fwd+bwd 2). `GFLOP`: cost_analysis (Gated DeltaNet's and KDA's kernels "
        "declare their matmul FLOPs; GLA's declare none, so its count omits the kernels). "
        "Memory columns: "
        "`memory_analysis()` (HBM; Mosaic checks each kernel's "
        "VMEM itself, a kernel that does not fit fails the compile). Compiled is not run: "
        "numerics on the chip and speed are unverified (interpret-mode parity is the "
        "numerical check).",
        "",
        *rows, "",
        f"Kernel compile failures (Mosaic errors, VMEM over the limit, wrong custom-call "
        f"count): {len(failures)}. Programs over one chip's HBM: {len(hbm)}.", "", NOTES, ""]
    for f in failures:
      lines.append(f"- {' '.join(f[:5])}: {f[5][:500]}")
    for f in hbm:
      lines.append(f"- HBM: {' '.join(f[:5])}: {f[5]}")
    lines += ["", *compare_families(compared)]
    lines += ["", *SP_TEXT, *sp_rows, "", *sp_summary(sp_figures), "",
              f"Sequence-parallel failures (no compile, states per chip != "
              f"{SP_ALL_SCAN_STATES}, Gated DeltaNet's or KDA's kernels != "
              f"{CALLS['gated_delta']['fwd+bwd']} per head group): {len(sp_failures)}.", ""]
    for family, chips, why in sp_failures:
      lines.append(f"- {family} P = {chips}: {why[:500]}")
    with open(a.out, "w") as fh:
      fh.write("\n".join(lines) + "\n")
    print("wrote", a.out)
  return 1 if failures or sp_failures else 0


if __name__ == "__main__":
  sys.exit(main())
