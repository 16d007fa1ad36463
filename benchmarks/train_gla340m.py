"""One-device training throughput of GLA-340M at long sequence length (tokens/s, peak memory).

    python benchmarks/train_gla340m.py                    # T=16384, batch 1, bf16, 12 steps
    python benchmarks/train_gla340m.py --set data.seq_len=8192 --steps 20

Runs train.run on the ``gla_340m`` config with synthetic MQAR tokens (data loading is not
what is measured), mesh data=1, seq=1, no checkpoints. Reports steady-state tokens/s (the
compile step excluded), compile time and the device's peak memory; writes JSON to
benchmarks/results/train_gla340m_<platform>.json and to $OUT when that is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

import configs  # noqa: E402
import train  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="gla_340m")
  p.add_argument("--steps", type=int, default=12)
  p.add_argument("--backends", default="auto,jax", help="tried in order until one runs")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--tag", default=None)
  p.add_argument("--budget-s", type=float, default=1e9,
                 help="skip the next backend when less than a third of this is left")
  args = p.parse_args()
  dev = jax.devices()[0]
  results = []
  t_begin = time.time()

  def write(cfg):
    out = {"config": args.config, "overrides": args.set, "seq_len": cfg["data"]["seq_len"],
           "batch_size": cfg["data"]["batch_size"], "steps": args.steps,
           "compute_dtype": cfg["train"]["compute_dtype"], "device": dev.device_kind,
           "platform": dev.platform, "jax": jax.__version__, "results": results}
    name = f"train_{args.config}_{args.tag or dev.platform}.json"
    for folder in (os.path.join(ROOT, "benchmarks", "results"), os.environ.get("OUT")):
      if folder:
        with open(os.path.join(folder, name), "w") as f:
          json.dump(out, f, indent=1)
    return out

  write(configs.load(args.config))   # a file exists even if the run is cut short
  for backend in args.backends.split(","):
    if results and time.time() - t_begin > args.budget_s * 2 / 3:
      results.append({"backend": backend, "error": "skipped: out of time budget"})
      break
    cfg = configs.load(args.config, [
        "data.kind='mqar'", "data.seq_len=16384", "data.batch_size=1",
        f"train.steps={args.steps}", "train.warmup_steps=1", "train.log_every=1",
        "train.eval_every=0", "train.eval_batches=0", "train.checkpoint_every=0",
        f"model.backend={backend!r}"] + args.set)
    cfg["mesh"] = {"data": 1, "seq": 1}
    cfg["train"]["workdir"] = os.path.join("/tmp", "bench_" + cfg["name"])
    t0 = time.time()
    try:
      summary = train.run(cfg, progress=True, bar=False, verbose=True)
    except Exception as e:  # noqa: BLE001  (report and try the next backend)
      results.append({"backend": backend, "error": f"{type(e).__name__}: {str(e)[:500]}"})
      print("FAILED", backend, results[-1]["error"], flush=True)
      write(cfg)
      continue
    stats = dev.memory_stats() or {}
    losses = summary["losses"]
    results.append({
        "backend": backend,
        "resolved_backend": __import__("zeco_jax.ops", fromlist=["x"]).resolve_backend(backend),
        "tokens_per_s": summary["tokens_per_s"],
        "step_s": cfg["data"]["seq_len"] * cfg["data"]["batch_size"] / summary["tokens_per_s"],
        "compile_s": summary["compile_s"], "wall_s": time.time() - t0,
        "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "memory_limit_gib": stats.get("bytes_limit", 0) / 2**30,
        "first_loss": losses[min(losses)], "last_loss": losses[max(losses)],
        "params_m": sum(x.size for x in jax.tree.leaves(summary["params"])) / 1e6})
    print(json.dumps(results[-1]), flush=True)
    break
  print(json.dumps(write(cfg), indent=1))


if __name__ == "__main__":
  main()
