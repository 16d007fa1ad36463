"""Multi-GPU measurements: All-Scan against its peers, the operator, and the overlap.

    python benchmarks/multi_gpu.py [--quick] [--out DIR]

Uses every local GPU (P = jax.device_count(); P >= 2). Prints markdown tables and writes
multi_gpu_P{P}.md (and the compiled schedule of the operator) to --out:

1. The collective alone (the paper's setting): exclusive scan of a 1 MiB state per rank
   (H = 16 heads of 128 x 128 float32: the bytes of the paper's H = 32 bf16 state):
   all_scan (ZeCO) for num_blocks in {1, 2, 4, 8, 16}, then every other method of
   zeco_jax.scan.SCAN_METHODS (all_gather: LASP-2, ring: LASP-1, tree); median ms per call.
2. The operator: zeco_gla forward+backward at 16K tokens per GPU, H = 16, K = V = 128,
   bf16, per-dim decay, for every scan method and the no-communication baseline
   (every GPU runs chunk_gla on its own 16K tokens).
3. The compiled schedule of (2) for all_scan: how many compute ops XLA placed between
   each collective-permute-start and its done (> 0 means the send overlaps compute).
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zeco_jax  # noqa: E402


def bench(fn, *args, iters=50, repeats=7):
  """Median over repeats of the mean time of `iters` back-to-back calls, in ms."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters * 1e3)
  return statistics.median(times)


def collective_table(mesh, n, iters):
  H, K, V = 16, 128, 128
  r = np.random.default_rng(0)
  sh = NamedSharding(mesh, P("seq"))
  S = jax.device_put(jnp.asarray(r.standard_normal((n, 1, H, K, V)), jnp.float32), sh)
  lam = jax.device_put(jnp.asarray(r.uniform(0.5, 1, (n, 1, H, K)), jnp.float32), sh)
  rows = []
  configs = [("all_scan", nb) for nb in (1, 2, 4, 8, 16)] + [
      (m, 1) for m, spec in zeco_jax.SCAN_METHODS.items() if not spec.blocked]
  for method, nb in configs:
    f = jax.jit(jax.shard_map(
        lambda S, lam: all_scan_first(S, lam, nb, method), mesh=mesh,
        in_specs=(P("seq"), P("seq")), out_specs=P("seq")))
    rows.append((method, nb, bench(f, S, lam, iters=iters)))
  return rows


def all_scan_first(S, lam, nb, method):
  return zeco_jax.all_scan(S[0], lam[0], "seq", num_blocks=nb, method=method)[0][None]


def operator_table(mesh, n, tokens, iters):
  H, K, V = 16, 128, 128
  T = tokens * n
  r = np.random.default_rng(1)
  sh = NamedSharding(mesh, P(None, "seq"))
  put = lambda x, dt: jax.device_put(jnp.asarray(x, dt), sh)
  q = put(r.standard_normal((1, T, H, K)), jnp.bfloat16)
  k = put(r.standard_normal((1, T, H, K)), jnp.bfloat16)
  v = put(r.standard_normal((1, T, H, V)), jnp.bfloat16)
  g = put(jax.nn.log_sigmoid(r.standard_normal((1, T, H, K))) / 16, jnp.float32)
  do = put(r.standard_normal((1, T, H, V)), jnp.bfloat16)

  def fwd_bwd(op):
    def f(q, k, v, g, do):
      o, vjp = jax.vjp(lambda *a: op(*a), q, k, v, g)
      return o, vjp(do)
    return jax.jit(f)

  rows, compiled = [], {}
  for method in zeco_jax.SCAN_METHODS:
    op = functools.partial(lambda *a, m: zeco_jax.zeco_gla(*a, mesh=mesh, method=m)[0],
                           m=method)
    f = fwd_bwd(op)
    rows.append((method, bench(f, q, k, v, g, do, iters=iters)))
    if method == "all_scan":
      compiled[method] = f.lower(q, k, v, g, do).compile().as_text()
  local = jax.shard_map(lambda *a: zeco_jax.chunk_gla(*a)[0], mesh=mesh,
                        in_specs=(P(None, "seq"),) * 4, out_specs=P(None, "seq"))
  rows.append(("baseline (no communication)", bench(fwd_bwd(local), q, k, v, g, do,
                                                    iters=iters)))
  return rows, compiled


def overlap_report(hlo_text):
  """For each async collective-permute: compute ops scheduled between its start and done."""
  lines = [l.strip() for l in hlo_text.splitlines()]
  entry = []
  inside = False
  for l in lines:                    # the ENTRY computation holds the schedule
    if l.startswith("ENTRY"):
      inside = True
      continue
    if inside and l == "}":
      break
    if inside:
      entry.append(l)
  starts = {}
  report = []
  for i, l in enumerate(entry):
    m = re.match(r"(\S+) = .*collective-permute-start\(", l)
    if m:
      starts[m.group(1)] = i
      continue
    m = re.search(r"collective-permute-done\((\S+?)\)", l)
    if m and m.group(1) in starts:
      between = entry[starts[m.group(1)] + 1:i]
      compute = [b for b in between if re.search(r"\b(fusion|custom-call|dot|convolution)\(", b)]
      report.append((m.group(1), len(compute)))
  return report


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(
      os.path.dirname(__file__), "results")))
  args = ap.parse_args()
  n = jax.device_count()
  if n < 2:
    sys.exit("multi_gpu.py needs at least 2 devices")
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  iters = 10 if args.quick else 50
  dev = jax.devices()[0]
  head = [f"# Multi-GPU: P = {n} x {dev.device_kind}", "",
          f"Command: `python benchmarks/multi_gpu.py{' --quick' if args.quick else ''}`; "
          f"jax {jax.__version__}; medians of 7 repeats of {iters} back-to-back calls.", ""]
  out = list(head)
  out += ["## 1. The collective alone (1 MiB float32 state per rank)", "",
          "| method | num_blocks | ms |", "|---|---|---|"]
  for method, nb, ms in collective_table(mesh, n, iters):
    out.append(f"| {method} | {nb} | {ms:.3f} |")
  print("\n".join(out), flush=True)
  rows, compiled = operator_table(mesh, n, args.tokens, max(iters // 5, 3))
  base = dict(rows)["baseline (no communication)"]
  op = ["", f"## 2. zeco_gla forward+backward, {args.tokens} tokens per GPU, H=16, K=V=128, "
        "bf16", "", "| method | ms | vs baseline |", "|---|---|---|"]
  for method, ms in rows:
    op.append(f"| {method} | {ms:.3f} | {100 * (ms / base - 1):+.1f}% |")
  rep = overlap_report(compiled["all_scan"])
  op += ["", "## 3. Compiled schedule (all_scan, forward+backward)", "",
         f"{len(rep)} async collective-permutes; compute ops scheduled between start and "
         f"done: {[c for _, c in rep]}"]
  print("\n".join(op), flush=True)
  out += op
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"multi_gpu_P{n}.md"), "w") as fh:
    fh.write("\n".join(out) + "\n")
  with open(os.path.join(args.out, f"multi_gpu_P{n}_all_scan.hlo.txt"), "w") as fh:
    fh.write(compiled["all_scan"])


if __name__ == "__main__":
  main()
