"""Where one GLA-340M training step's GPU time goes: a jax.profiler trace, summarised by kernel.

``profile_steps`` traces a few calls of a jitted step (``jax.profiler.trace`` with a
Perfetto trace) and ``summarize`` reads the GPU kernel events back: total kernel time per
step, the kernels by time, and the time by category (:func:`category`: GLA Pallas
kernels, softmax attention's cuDNN kernels, bf16 / float32 matmuls, scatters,
cross-entropy, copies and transposes, other XLA fusions). ``python -m
benchmarks.train_gla340m --profile`` calls it after its timed steps; results and the
command are in benchmarks/results/profile_gla340m_h200.md. Not a measurement of its own (no
environment record: the run that traced writes one).

Alone, on a trace folder written earlier:

    python -m benchmarks.profile_step TRACE_DIR --steps 3
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

CATEGORIES = (   # (category, regex on "kernel name | op name"), first match wins
    ("attention (cuDNN)", r"cudnn|fmha|sdpa|flash"),
    ("delta-rule kernels (Pallas)", r"gdn_|kda_"),
    ("gla kernels (Pallas)", r"gla_|chunk_cumsum|pallas"),
    ("scatter", r"scatter"),
    ("cross-entropy", r"cross_entropy|log_softmax|logsumexp"),
    ("matmul float32 (TF32)", r"f32f32_tf32|tf32f32|sgemm|_f32f32"),
    ("matmul bf16", r"gemm|nvjet|xmma|cutlass|cublas|wgmma|sm90_|triton_gemm|dot"),
    ("optimizer", r"adam|optax|clip_by_global_norm"),
    ("copies / transposes", r"transpose|copy|memcpy|memset"),
    ("reductions", r"reduce"),
    ("elementwise fusions", r"fusion|loop_|input_"),
)


def category(name: str, op: str = "") -> str:
  text = f"{name} | {op}".lower()
  for cat, pattern in CATEGORIES:
    if re.search(pattern, text):
      return cat
  return "other"


def profile_steps(step_fn, args_fn, steps: int, trace_dir: str) -> str:
  """Runs ``step_fn(*args_fn(i))`` for ``steps`` calls under the profiler; returns the
  trace folder. ``args_fn`` may thread state (it is called before each step)."""
  import jax
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    out = None
    for i in range(steps):
      out = step_fn(*args_fn(i, out))
    jax.block_until_ready(out)
  return trace_dir


def _load(trace_dir: str) -> dict:
  found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
                 + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f"no *.trace.json.gz or perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(found[-1], "rt") as f:
    return json.load(f)


def summarize(trace_dir: str, steps: int, top: int = 60) -> dict:
  """GPU kernel time per step: total, by category, and the ``top`` kernels."""
  trace = _load(trace_dir)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  pnames = {e["pid"]: e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu_pids = {p for p, n in pnames.items() if re.search(r"gpu|device:gpu|stream", n.lower())}
  kernels = collections.defaultdict(lambda: [0.0, 0, "", ""])
  span = [float("inf"), 0.0]
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
      continue
    args = e.get("args", {}) or {}
    name = e.get("name", "")
    op = str(args.get("tf_op") or args.get("long_name") or args.get("hlo_op") or "")
    key = (name, op[:160])
    k = kernels[key]
    k[0] += float(e.get("dur", 0.0))
    k[1] += 1
    k[2] = str(args.get("hlo_op", ""))
    k[3] = category(name, op + " " + k[2])
    span[0] = min(span[0], float(e["ts"]))
    span[1] = max(span[1], float(e["ts"]) + float(e.get("dur", 0.0)))
  total = sum(v[0] for v in kernels.values())
  by_cat = collections.Counter()
  for v in kernels.values():
    by_cat[v[3]] += v[0]
  rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
  return {
      "steps": steps, "gpu_pids": sorted(pnames[p] for p in gpu_pids),
      "all_pids": sorted(set(pnames.values()))[:40],
      "kernel_ms_per_step": total / 1e3 / steps,
      "gpu_span_ms_per_step": (span[1] - span[0]) / 1e3 / steps if total else 0.0,
      "by_category_ms": {c: t / 1e3 / steps for c, t in by_cat.most_common()},
      "top": [{"name": n[:120], "op": op, "hlo_op": v[2], "category": v[3],
               "ms_per_step": v[0] / 1e3 / steps, "calls_per_step": v[1] / steps}
              for (n, op), v in rows[:top]],
  }


def format_summary(s: dict) -> str:
  lines = [f"kernel time {s['kernel_ms_per_step']:.3f} ms/step over a GPU span of "
           f"{s['gpu_span_ms_per_step']:.3f} ms/step ({s['steps']} steps)", "",
           "| category | ms/step |", "|---|---|"]
  lines += [f"| {c} | {t:.2f} |" for c, t in s["by_category_ms"].items()]
  lines += ["", "| kernel | category | ms/step | calls | op |", "|---|---|---|---|---|"]
  lines += [f"| {r['name'][:70]} | {r['category']} | {r['ms_per_step']:.3f} | "
            f"{r['calls_per_step']:.0f} | {r['op'][:90]} |" for r in s["top"]]
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("trace_dir")
  ap.add_argument("--steps", type=int, default=1)
  args = ap.parse_args()
  print(format_summary(summarize(args.trace_dir, args.steps)))


if __name__ == "__main__":
  main()
