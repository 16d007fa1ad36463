"""Compile the Mosaic TPU kernels (pallas_kernels.gla.tpu, pallas_kernels.gated_delta.tpu)
for real TPU generations, no TPU.

With libtpu installed (``pip install -e '.[tpu]'``), JAX compiles for a TPU topology on a
CPU-only host (a few minutes for the whole table on 2 cores). Per family the op with its
Pallas backend and the TPU kernels, ``chunk_gla(backend="pallas", kernel_config=
KernelConfig(platform="tpu", interpret=False))`` and ``chunk_gated_delta_rule`` likewise
(``gated_delta.KernelConfig``), forward and forward + backward (``value_and_grad`` over
every input but the state), are lowered with ShapeDtypeStruct arguments on one device of
the topology and compiled by libtpu (Mosaic for the kernels), under ``use_abstract_mesh``
(else Pallas stops with "Unsupported TPU device kind: cpu"). Per (family, generation,
shape, dtype, pass): compile seconds, the number of ``tpu_custom_call``s in the compiled
HLO (:data:`CALLS`), memory_analysis (HBM arguments / outputs / temporaries; Mosaic checks
VMEM itself and fails the compile when a kernel's blocks do not fit) and cost_analysis's
FLOPs (the Gated DeltaNet kernels declare their matmul FLOPs through ``pl.CostEstimate``;
the GLA kernels declare none, so GLA's count is only the XLA ops around its kernels).

  python -m benchmarks.tpu_aot_kernels          # all shapes -> results/tpu_aot_kernels.md
  python -m benchmarks.tpu_aot_kernels --quick  # the test's small shape only, no file
  python -m benchmarks.tpu_aot_kernels --shape "bench B1 T8K H16"   # a selection, no file

The environment record goes beside the table (``tpu_aot_kernels.env.json``).
"""
import argparse
import os
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
from pallas_kernels import gated_delta
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
FAMILIES = ("gla", "gated_delta")
# The shapes each family compiles at: Gated DeltaNet skips GLA's model configs.
FAMILY_SHAPES = {"gla": tuple(SHAPES),
                 "gated_delta": tuple(n for n in SHAPES if not n.startswith("gla_"))}
CUSTOM_CALL = 'custom_call_target="tpu_custom_call"'
# Mosaic kernels per compiled pass. GLA fwd+bwd: the forward, the backward's forward
# recompute that emits the chunk states, the backward kernel. Gated DeltaNet fwd+bwd: the
# forward emitting the chunk states (kept as the residual), the backward kernel.
CALLS = {"gla": {"fwd": 1, "fwd+bwd": 3}, "gated_delta": {"fwd": 1, "fwd+bwd": 2}}
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


PASSES = {"fwd": _fwd, "fwd+bwd": _fwd_bwd}
FAMILY_PASSES = {"gla": PASSES, "gated_delta": {"fwd": _gdn_fwd, "fwd+bwd": _gdn_fwd_bwd}}


def _arguments(family, mesh, shape, dtype):
  """ShapeDtypeStructs on mesh: GLA q, k, v, per-dim g (float32); Gated DeltaNet q, k,
  v, g and beta ([B, T, H], float32)."""
  B, T, H, K, V = shape
  s = NamedSharding(mesh, P())
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  qkv = (sds((B, T, H, K), dtype), sds((B, T, H, K), dtype), sds((B, T, H, V), dtype))
  if family == "gla":
    return (*qkv, sds((B, T, H, K), jnp.float32))
  return (*qkv, sds((B, T, H), jnp.float32), sds((B, T, H), jnp.float32))


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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="small shape only, no results file")
  ap.add_argument("--shape", action="append", choices=sorted(SHAPES),
                  help="only these shapes (repeatable); prints, writes no file")
  ap.add_argument("--family", action="append", choices=FAMILIES,
                  help="only these families (repeatable); prints, writes no file")
  ap.add_argument("--out", default=os.path.join(harness.RESULTS, "tpu_aot_kernels.md"))
  a = ap.parse_args()
  selected = a.shape or (["small (test)"] if a.quick else list(SHAPES))
  families = a.family or list(FAMILIES)
  write = not (a.quick or a.shape or a.family)
  header = ("| family | generation | shape (B, T, H, K, V) | dtype | pass | compiled | "
            "compile s | tpu_custom_calls | args MiB | outputs MiB | temp MiB | code MiB | "
            "GFLOP |")
  rows = [header, "|" + "---|" * 13]
  print(header, flush=True)
  failures, hbm = [], []
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
  total = time.perf_counter() - t_all
  print(f"total {total:.0f} s; {len(failures)} failures; {len(hbm)} over one chip's HBM",
        flush=True)
  if write:
    env = harness.environment()
    harness.write_environment(os.path.dirname(os.path.abspath(a.out)), "tpu_aot_kernels")
    lines = [
        "# Mosaic TPU kernels compiled for v5e, v5p, v6e without a TPU",
        "",
        "Question: do the GLA and Gated DeltaNet Mosaic TPU kernels compile for each TPU "
        "generation, at the benchmark and model shapes, bf16 and float32, and what HBM do "
        "they need?",
        "",
        f"`python -m benchmarks.tpu_aot_kernels` ({harness.env_line(env)}, CPU host, total "
        f"{total:.0f} s). Each row: `chunk_gla(backend=\"pallas\", "
        "kernel_config=KernelConfig(platform=\"tpu\", interpret=False))` jitted and "
        "compiled by libtpu for one device of the topology (Gated DeltaNet: "
        "`chunk_gated_delta_rule` likewise, its own KernelConfig); "
        "`fwd` the output, `fwd+bwd` value_and_grad over every input but the state (GLA "
        "q, k, v, g per-dim; Gated DeltaNet q, k, v, g, beta per head; g and beta float32; "
        "chunk 64). `tpu_custom_calls`: Mosaic "
        "kernels in the compiled HLO (expected GLA fwd 1, fwd+bwd 3; Gated DeltaNet fwd 1, "
        "fwd+bwd 2). `GFLOP`: cost_analysis (Gated DeltaNet's kernels declare their matmul "
        "FLOPs; GLA's declare none, so its count omits the kernels). Memory columns: "
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
    with open(a.out, "w") as fh:
      fh.write("\n".join(lines) + "\n")
    print("wrote", a.out)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
