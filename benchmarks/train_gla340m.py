"""One-device training throughput of GLA-340M at long sequence length (tokens/s, peak memory).

    python -m benchmarks.train_gla340m                     # T=16384, batch 1, bf16, 12 steps
    python -m benchmarks.train_gla340m --config.data.seq_len=8192 --steps 20

(Run from the repository root: ``-m`` puts it on ``sys.path`` for ``configs`` and
``trainer``.) Runs ``trainer.train_and_evaluate`` on the ``gla_340m`` config with synthetic
MQAR tokens (data loading is not what is measured), mesh data=1, seq=1, no checkpoints.
Reports steady-state tokens/s (the compile step excluded), compile time and the device's
peak memory; writes JSON to benchmarks/results/train_<config>_<tag or platform>.json and
to $OUT when that is set.
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
from absl import app, flags
from ml_collections import config_flags

import trainer
from zeco_jax.ops import resolve_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(ROOT, "configs", "gla_340m.py"), lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 12, "training steps (the first includes compilation)")
_BACKENDS = flags.DEFINE_string("backends", "auto,jax", "tried in order until one runs")
_TAG = flags.DEFINE_string("tag", None, "results file suffix (default: the platform)")
_BUDGET = flags.DEFINE_float("budget-s", 1e9,
                             "skip the next backend when less than a third of this is left")


def main(argv):
  del argv
  name = os.path.splitext(os.path.basename(config_flags.get_config_filename(
      flags.FLAGS["config"])))[0]
  dev = jax.devices()[0]
  results = []
  t_begin = time.time()
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]

  def write(cfg):
    out = {"config": name, "overrides": overrides, "seq_len": cfg.data.seq_len,
           "batch_size": cfg.data.batch_size, "steps": _STEPS.value,
           "compute_dtype": cfg.train.compute_dtype, "device": dev.device_kind,
           "platform": dev.platform, "jax": jax.__version__, "results": results}
    filename = f"train_{name}_{_TAG.value or dev.platform}.json"
    for folder in (os.path.join(ROOT, "benchmarks", "results"), os.environ.get("OUT")):
      if folder:
        with open(os.path.join(folder, filename), "w") as f:
          json.dump(out, f, indent=1)
    return out

  # Throughput settings; fields given on the command line win.
  cfg = _CONFIG.value
  given = {a.split("=", 1)[0][len("--config."):] for a in overrides}
  settings = {"data.kind": "mqar", "data.seq_len": 16384, "data.batch_size": 1,
              "train.steps": _STEPS.value, "train.warmup_steps": 1, "train.log_every": 1,
              "train.eval_every": 0, "train.eval_batches": 0, "train.checkpoint_every": 0,
              "mesh": "data=1,seq=1"}
  for path, value in settings.items():
    if path not in given:
      section, _, field = path.rpartition(".")
      (cfg[section] if section else cfg)[field] = value
  write(cfg)   # a file exists even if the run is cut short
  for backend in _BACKENDS.value.split(","):
    if results and time.time() - t_begin > _BUDGET.value * 2 / 3:
      results.append({"backend": backend, "error": "skipped: out of time budget"})
      break
    cfg.model.backend = backend
    t0 = time.time()
    try:
      summary = trainer.train_and_evaluate(cfg, os.path.join("/tmp", "bench_" + name),
                                           progress="lines")
    except Exception as e:  # noqa: BLE001  (report and try the next backend)
      results.append({"backend": backend, "error": f"{type(e).__name__}: {str(e)[:500]}"})
      print("FAILED", backend, results[-1]["error"], flush=True)
      write(cfg)
      continue
    stats = dev.memory_stats() or {}
    losses = summary["losses"]
    tokens_per_step = cfg.data.seq_len * cfg.data.batch_size
    results.append({
        "backend": backend, "resolved_backend": resolve_backend(backend),
        "tokens_per_s": summary["tokens_per_s"],
        "step_s": tokens_per_step / summary["tokens_per_s"],
        "compile_s": summary["compile_s"], "wall_s": time.time() - t0,
        "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "memory_limit_gib": stats.get("bytes_limit", 0) / 2**30,
        "first_loss": losses[min(losses)], "last_loss": losses[max(losses)],
        "params_m": summary["num_params"] / 1e6})
    print(json.dumps(results[-1]), flush=True)
    break
  print(json.dumps(write(cfg), indent=1))


if __name__ == "__main__":
  app.run(main)
