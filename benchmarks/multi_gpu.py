"""Multi-GPU measurements: All-Scan against its peers, the operator, and the overlap.

    python -m benchmarks.multi_gpu [--quick] [--out DIR]

Needs a host with 2+ GPUs (never run yet: no multi-GPU machine has been lent). Uses every
local GPU (P = jax.device_count(); P >= 2). Prints markdown tables and writes
multi_gpu_P{P}.md, the compiled schedule of the operator and multi_gpu_P{P}.env.json to
--out (default $OUT, else runs/benchmarks/multi_gpu):

1. The collective alone (the paper's setting): exclusive scan of a 1 MiB state per rank
   (H = 16 heads of 128 x 128 float32: the bytes of the paper's H = 32 bf16 state):
   all_scan (ZeCO) for num_blocks in {1, 2, 4, 8, 16}, then every other method of
   zeco_jax.sp.scan.SCAN_METHODS (all_gather: LASP-2, ring: LASP-1, tree); median ms per call.
2. The operator: zeco_gla forward+backward at 16K tokens per GPU, H = 16, K = V = 128,
   bf16, per-dim decay, for every scan method and the no-communication baseline
   (every GPU runs chunk_gla on its own 16K tokens).
3. The compiled schedule of (2) for all_scan: how many compute ops (and kernels) XLA placed
   between each collective-permute-start and its done (zeco_jax.runtime.hlo_stats.
   async_overlap; > 0 means the send overlaps compute).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import zeco_jax
from benchmarks import _harness as harness
from zeco_jax.runtime import hlo_stats


def bench(fn, *args, iters=50, repeats=7):
  """Median over repeats of the mean time of `iters` back-to-back calls, in ms."""
  return harness.time_loop(lambda: fn(*args), iters=iters, reps=repeats)


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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  n = jax.device_count()
  if n < 2:
    sys.exit("benchmarks.multi_gpu needs at least 2 devices")
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  iters = 10 if args.quick else 50
  dev = jax.devices()[0]
  head = [f"# Multi-GPU: P = {n} x {dev.device_kind}", "",
          f"Command: `python -m benchmarks.multi_gpu{' --quick' if args.quick else ''}` "
          f"({harness.env_line(harness.environment())}); medians of 7 repeats of {iters} "
          "back-to-back calls.", ""]
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
  rep = hlo_stats.async_overlap(compiled["all_scan"])
  op += ["", "## 3. Compiled schedule (all_scan, forward+backward)", "",
         f"{len(rep)} async collective-permutes; (compute ops, kernels) scheduled between "
         f"start and done: {rep}"]
  print("\n".join(op), flush=True)
  out += op
  args.out = harness.out_dir(args.out, "multi_gpu")
  harness.write_environment(args.out, f"multi_gpu_P{n}")
  with open(os.path.join(args.out, f"multi_gpu_P{n}.md"), "w") as fh:
    fh.write("\n".join(out) + "\n")
  with open(os.path.join(args.out, f"multi_gpu_P{n}_all_scan.hlo.txt"), "w") as fh:
    fh.write(compiled["all_scan"])


if __name__ == "__main__":
  main()
