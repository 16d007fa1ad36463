"""Static facts about the delta-rule families' Triton kernels for an H200 (sm_90), from a
CPU-only host: per kernel, registers, spilled bytes, shared memory, PTX instructions,
barriers, MMAs and exps. What a kernel change does to the compiled code while no GPU is
lent; no timing (a kernel's static instruction count is not its run time: loops count
once).

Two steps, two processes (jaxlib's MLIR and Triton's must not share one):

1. this module lowers the op's forward + backward for an abstract H200 (as
   ``tests/kernels/test_*_kernels.py`` do) and writes each ``pallas_call``'s Triton IR
   with its warps and stages (read through private JAX lowering hooks: a JAX upgrade may
   move them);
2. ``--compile DIR`` compiles each with the pip ``triton`` package (not a dependency of
   this project: ``pip install triton==3.6.0``, the H200 machine's version; its wheel
   carries ptxas) for ``GPUTarget("cuda", 90, 32)`` and reads ``ptxas -v``.

XLA compiles the same IR with its own Triton, so the figures are a close proxy.

    python -m benchmarks.ptx_stats --family kda --set dqk_kd=64 --out /tmp/kda
    PYTHONPATH=<site with triton> python -m benchmarks.ptx_stats --compile /tmp/kda \
        [--against /tmp/kda_default]

``--compile`` prints one JSON line per kernel, then a markdown table of each kernel once
(the backward's recomputed forward kernels are the same programs); with ``--against``,
each figure as ``against -> this`` where they differ (the tables of
``benchmarks/results/ptx_sm90.md``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from benchmarks import _harness as harness


def dump(family: str, shape, changes: dict, out: str) -> list:
  """Write each kernel's Triton IR of ``family``'s op, forward + backward, to ``out``."""
  import jax
  import jax.numpy as jnp
  from jax._src.pallas import core as pallas_core
  from jax._src.pallas.triton import lowering

  found = []
  lower_module = lowering.lower_jaxpr_to_triton_module
  get_rule = pallas_core.get_lowering_rule

  def capture(*args, **kwargs):
    res = lower_module(*args, **kwargs)
    found[-1]["asm"] = res.module.operation.get_asm(enable_debug_info=False)
    return res

  def rule(params_type, platform):
    inner = get_rule(params_type, platform)
    if platform != "gpu" or inner is None:
      return inner

    def wrapped(ctx, *args, compiler_params=None, **kw):
      found.append(dict(name=kw.get("name"), warps=compiler_params.num_warps or 4,
                        stages=compiler_params.num_stages or 3))
      return inner(ctx, *args, compiler_params=compiler_params, **kw)
    return wrapped

  B, T, H, K, V = shape
  if family == "kda":
    from pallas_kernels import kda as pkg
    from zeco_jax import chunk_kda as op
    gshape = (B, T, H, K)
  else:
    from pallas_kernels import gated_delta as pkg
    from zeco_jax import chunk_gated_delta_rule as op
    gshape = (B, T, H)
  config = pkg.default_config("gpu", B, T, H, K, V, jnp.bfloat16).replace(**changes)

  def fwd_bwd(q, k, v, g, beta, do):
    o, vjp = jax.vjp(lambda *a: op(*a, backend="pallas", kernel_config=config)[0],
                     q, k, v, g, beta)
    return vjp(do)

  sd, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  args = (sd((B, T, H, K), bf), sd((B, T, H, K), bf), sd((B, T, H, V), bf), sd(gshape, f32),
          sd((B, T, H), f32), sd((B, T, H, V), bf))
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                       platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  lowering.lower_jaxpr_to_triton_module = capture
  pallas_core.get_lowering_rule = rule
  try:
    with jax.sharding.use_abstract_mesh(mesh):
      jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    lowering.lower_jaxpr_to_triton_module = lower_module
    pallas_core.get_lowering_rule = get_rule
  os.makedirs(out, exist_ok=True)
  kernels = []
  for i, k in enumerate(found):
    path = os.path.join(out, f"{i:02d}.{k['name']}.ttir")
    with open(path, "w") as f:
      f.write(k.pop("asm"))
    kernels.append(dict(k, path=path))
  with open(os.path.join(out, "kernels.json"), "w") as f:
    json.dump(dict(family=family, shape=shape, changes=changes, kernels=kernels), f, indent=1)
  return kernels


def compile_all(folder: str) -> list:
  """Compile ``dump``'s files with pip Triton for sm_90; one row per kernel."""
  import triton
  from triton.backends.compiler import GPUTarget
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  rows = []
  with open(os.path.join(folder, "kernels.json")) as f:
    meta = json.load(f)
  for k in meta["kernels"]:
    cc = triton.compile(k["path"], target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=k["warps"], num_stages=k["stages"]))
    ptx = cc.asm["ptx"]
    with open(k["path"] + ".ptx", "w") as f:
      f.write(ptx)
    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", k["path"] + ".ptx", "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    body = [l.strip() for l in ptx.splitlines()]
    rows.append(dict(kernel=k["name"], warps=k["warps"], stages=k["stages"], registers=regs,
                     spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                     shared_bytes=cc.metadata.shared,
                     instructions=sum(1 for l in body if l and not l.startswith(
                         ("//", ".", "{", "}", "$"))),
                     barriers=ptx.count("bar.sync"),
                     mmas=ptx.count("mma.sync") + ptx.count("wgmma.mma_async"),
                     exps=ptx.count("ex2.approx")))
  return rows


FIELDS = ("warps", "registers", "spills", "instructions", "barriers", "mmas", "exps")


def table(rows, against=None) -> str:
  """Markdown: each kernel once; ``against`` (rows of another build) as ``a -> this``."""
  def once(rs):
    out = {}
    for r in rs:
      r = dict(r, spills=f"{r['spill_stores']} / {r['spill_loads']}")
      out.setdefault(r["kernel"], r)
    return out
  mine, theirs = once(rows), once(against or [])
  lines = ["| kernel | " + " | ".join(FIELDS) + " |", "|---" * (len(FIELDS) + 1) + "|"]
  for name in list(theirs) + [n for n in mine if n not in theirs]:
    a, b = theirs.get(name), mine.get(name)
    cells = []
    for f in FIELDS:
      x, y = (None if a is None else a[f]), (None if b is None else b[f])
      if x == y or against is None:
        cells.append(str(y))
      else:
        cells.append(f"{'-' if x is None else x} -> {'-' if y is None else y}")
    lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--family", choices=("gdn", "kda"), default="kda")
  ap.add_argument("--shape", default="1,16384,16,128,128", help="B,T,H,K,V")
  ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                  help="KernelConfig.replace arguments, e.g. dqk_kd=64 intra_kd=32")
  ap.add_argument("--out", default=None, help="folder for step 1's IR")
  ap.add_argument("--compile", default=None, metavar="DIR", help="step 2 on DIR")
  ap.add_argument("--against", default=None, metavar="DIR",
                  help="with --compile: another step-1 folder, shown as 'DIR -> --compile'")
  args = ap.parse_args(argv)
  if args.compile:
    rows = compile_all(args.compile)
    for row in rows:
      print(json.dumps(row), flush=True)
    print(table(rows, compile_all(args.against) if args.against else None))
    return
  changes = harness.config_changes(args.set)
  out = args.out or f"/tmp/ptx_{args.family}"
  kernels = dump(args.family, tuple(int(x) for x in args.shape.split(",")), changes, out)
  print(f"{len(kernels)} kernels in {out}; next: python -m benchmarks.ptx_stats --compile {out}",
        file=sys.stderr)


if __name__ == "__main__":
  main()
