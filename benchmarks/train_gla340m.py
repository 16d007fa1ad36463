"""GLA-340M training step on one GPU, ours (JAX) beside FLA's PyTorch model: tokens/s, ms/step,
peak memory, MFU, and the per-step losses of both on one token stream.

    python -m benchmarks.train_gla340m                              # ours + FLA, B1 x 16384
    python -m benchmarks.train_gla340m --runs ours:16384,ours:65536:remat,fla:65536:remat
    python -m benchmarks.train_gla340m --profile                    # + a jax.profiler summary
    python -m benchmarks.train_gla340m --runs ours:16384,ours:16384:dense  # chunked vs dense CE

(Run from the repository root; one GPU, FLA and torch for its runs; results:
benchmarks/results/train_gla340m_h200.md.) Each run is its own process, one after another
(peak memory is per process; JAX and torch never hold the GPU at once): ``ours[:T][:remat]``
trains ``configs/gla_340m.py`` (with ``--config.*`` overrides) through
``trainer.Experiment``'s jitted ``train_step``; ``fla[:T][:remat]`` runs
``benchmarks.fla_gla340m`` (FLA's ``GLAForCausalLM`` in GLA-340M's configuration;
``remat``: its gradient checkpointing), skipped when FLA is not importable;
``ours:T:dense`` sets ``train.loss_chunk_size=0`` (float32 logits, the old loss). Both train
on the same tokens (``--steps`` batches of MQAR sequences, models/data.py, with
next-token targets on every position) with the same learning-rate schedule (warmup 1,
cosine, lr 3e-4), init std 0.006, the chunked cross-entropy
(``train.loss_chunk_size=4096``; ``:dense`` for float32 logits), AdamW (b2 0.95, weight
decay 0.01 on matrices), clipping at 1.0. tokens/s is over the steps after ``--warmup``
(the first includes compilation / autotuning).

MFU = (6 N + attention FLOPs) x tokens/s / 989e12, the dense bf16 peak of an H100/H200
SXM (NVIDIA's H200 datasheet: 989 TFLOPS bf16 without sparsity). Attention FLOPs of the
chunked form per token, layer and head, forward: 2CK + 2CV (the full C x C intra-chunk
score and output tiles) + 4KV (the state read and update); forward + backward is 3x that.
A hybrid config's softmax blocks (``--config configs/hybrid_340m.py``) count 4 (T / 2) D
per token and head forward (QK^T and PV over the T / 2 keys a causal query sees on
average), 3x for forward + backward.

Writes ``train_gla340m_<tag>.json`` (every run: figures, losses, each run's environment),
``.md`` (the table) and ``.env.json`` to --outdir (default $OUT, else
runs/benchmarks/train_gla340m); with two or more runs that have losses, ``loss_<tag>.png``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

if "--child" not in sys.argv:     # the parent only plans, writes and plots: keep it off the GPU
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from benchmarks import _harness as harness  # noqa: E402

ROOT = harness.ROOT
PEAK_FLOPS = 989e12          # H200 SXM dense bf16 (datasheet)
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(ROOT, "configs", "gla_340m.py"), lock_config=True)
_RUNS = flags.DEFINE_string("runs", "ours:16384,fla:16384", "comma-separated runs")
_STEPS = flags.DEFINE_integer("steps", 50, "training steps per run (the losses of the plot)")
_WARMUP = flags.DEFINE_integer("warmup", 3, "steps not timed (the first includes compilation)")
_TAG = flags.DEFINE_string("tag", "h200", "results file suffix")
_PROFILE = flags.DEFINE_bool("profile", False, "ours: trace 3 more steps, summarise kernels")
_OUTDIR = flags.DEFINE_string("outdir", None,
                              "results folder (default $OUT, else runs/benchmarks/train_gla340m)")
_TIMEOUT = flags.DEFINE_float("run_timeout", 900, "seconds one run may take")
_CHILD = flags.DEFINE_string("child", None, "internal: run one of ours, write JSON here")
_BATCHES = flags.DEFINE_string("batches", None, "internal: the token stream (.npz)")
_REMAT = flags.DEFINE_bool("remat", False, "internal: the child's model.remat")


def settings(cfg, seq_len: int, steps: int, remat: bool):
  """The benchmark's fixed settings on top of the config (command-line overrides win)."""
  given = {a.split("=", 1)[0][len("--config."):] for a in sys.argv[1:]
           if a.startswith("--config.")}
  fixed = {"data.kind": "mqar", "data.seq_len": seq_len, "data.batch_size": 1,
           "train.steps": max(steps, 2), "train.warmup_steps": 1, "train.lr": 3e-4,
           "train.weight_decay": 0.01, "train.loss_chunk_size": 4096,
           "model.init_std": 0.006, "model.remat": remat,
           "mesh": "data=1,seq=1"}
  for path, value in fixed.items():
    if path not in given:
      section, _, field = path.rpartition(".")
      (cfg[section] if section else cfg)[field] = value
  return cfg


def token_stream(cfg, steps: int) -> np.ndarray:
  """``[steps, B, T]`` int32 MQAR inputs of steps 0.. (models/data.py); deterministic."""
  from models.data import Dataset
  data = Dataset(cfg.data.to_dict())
  return np.stack([data.batch(s)["inputs"] for s in range(steps)]).astype(np.int32)


def lm_batch(inputs_BxT: np.ndarray) -> dict:
  """Next-token targets on every position but the last (FLA shifts its labels the same)."""
  targets = np.concatenate([inputs_BxT[:, 1:], np.zeros_like(inputs_BxT[:, :1])], axis=1)
  mask = np.ones(inputs_BxT.shape, np.float32)
  mask[:, -1] = 0
  return {"inputs": inputs_BxT, "targets": targets, "mask": mask}


def attention_flops_per_token(m, seq_len: int) -> float:
  """Token mixers' forward + backward FLOPs per token (3x the forward): the chunked linear
  form in the L blocks, causal softmax attention (on average T / 2 keys a query, QK^T and
  PV) in a hybrid's A blocks."""
  H, K, V, C = m.num_heads, m.key_dim // m.num_heads, m.value_dim // m.num_heads, m.chunk_size
  kinds = m.block_kinds()
  linear = 3 * kinds.count("L") * H * (2 * C * K + 2 * C * V + 4 * K * V)
  heads, _, head_dim = m.attention_shape
  softmax = 3 * kinds.count("A") * heads * 2 * 2 * (seq_len / 2) * head_dim
  return linear + softmax


def run_ours(cfg, batches_path: str, out_path: str, profile: bool):
  """One of our runs (in the child process): train, time, optionally profile."""
  import trainer
  data = np.load(batches_path)
  inputs = data["inputs"]
  steps = inputs.shape[0]
  result = {"impl": "ours", "seq_len": int(inputs.shape[2]), "batch_size": int(inputs.shape[1]),
            "steps": steps, "remat": bool(cfg.model.remat), "jax": jax.__version__,
            "loss_chunk_size": int(cfg.train.get("loss_chunk_size", 0)),
            "environment": harness.environment()}
  try:
    exp = trainer.Experiment(cfg, trainer.make_mesh({"data": 1, "seq": 1}))
    state = exp.init_state()
    put = lambda s: exp.put_batch(lm_batch(inputs[s % steps]))
    losses, t0 = [], time.time()
    for s in range(steps):
      if s == _WARMUP.value:
        jax.block_until_ready(state)
        t_timed = time.time()
      state, m = exp.train_step(state, put(s))
      losses.append(m["loss"])
      if s == 0:
        jax.block_until_ready(m)
        result["compile_s"] = time.time() - t0
    jax.block_until_ready(state)
    dt = time.time() - t_timed
    timed = steps - _WARMUP.value
    stats = jax.devices()[0].memory_stats() or {}
    tokens = inputs.shape[1] * inputs.shape[2]
    result.update({
        "params_m": sum(x.size for x in jax.tree.leaves(state["params"])) / 1e6,
        "losses": [float(x) for x in jax.device_get(losses)],
        "tokens_per_s": tokens * timed / dt, "step_s": dt / timed,
        "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "device": jax.devices()[0].device_kind,
        "skipped_steps": int(jax.device_get(state["skipped_steps"]))})
    if profile:
      from benchmarks import profile_step
      trace_dir = tempfile.mkdtemp(prefix="trace_")
      holder = {"state": state}

      def args(i, out):
        if out is not None:
          holder["state"] = out[0]
        return holder["state"], put(i)
      profile_step.profile_steps(exp.train_step, args, 3, trace_dir)
      result["profile"] = profile_step.summarize(trace_dir, 3)
  except Exception as e:  # noqa: BLE001  (OOM and the like go to the table)
    import traceback
    traceback.print_exc()
    result["error"] = f"{type(e).__name__}: {str(e)[:400]}"
  with open(out_path, "w") as f:
    json.dump(result, f)


def fla_available() -> bool:
  try:
    import importlib.util
    return importlib.util.find_spec("fla") is not None and \
        importlib.util.find_spec("torch") is not None
  except Exception:  # noqa: BLE001
    return False


def table(results: list, model_cfg) -> str:
  rows = ["| run | tokens | tokens/s | ms/step | peak GiB | MFU | first / last loss | note |",
          "|---|---|---|---|---|---|---|---|"]
  for r in results:
    name = r.get("spec", r["impl"])
    if "error" in r or "tokens_per_s" not in r:
      rows.append(f"| {name} | {r.get('seq_len')} | - | - | - | - | - | "
                  f"{r.get('error', 'no result')[:120]} |")
      continue
    flops = 6 * r["params_m"] * 1e6 + attention_flops_per_token(model_cfg, r["seq_len"])
    mfu = flops * r["tokens_per_s"] / PEAK_FLOPS
    note = (f"compile {r['compile_s']:.0f}s" if "compile_s" in r
            else f"first step {r.get('first_step_s', 0):.0f}s")
    rows.append(f"| {name} | {r['batch_size']}x{r['seq_len']} | {r['tokens_per_s']:,.0f} | "
                f"{1e3 * r['step_s']:.1f} | {r['peak_memory_gib']:.2f} | {100 * mfu:.1f}% | "
                f"{r['losses'][0]:.3f} / {r['losses'][-1]:.3f} | {note} |")
  return "\n".join(rows)


def plot(results: list, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for r in results:
    if r.get("losses"):
      label = f"{r['impl']} T={r['seq_len']}" + (" remat" if r.get("remat") or
                                                  r.get("checkpointing") else "")
      ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (next token, every position)")
  ax.set_title("GLA-340M, same tokens, lr 3e-4, init std 0.006")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  if _CHILD.value:
    cfg = _CONFIG.value
    with open(_BATCHES.value + ".cfg.json") as f:
      seq_len = json.load(f)["seq_len"]
    run_ours(settings(cfg, seq_len, _STEPS.value, _REMAT.value), _BATCHES.value,
             _CHILD.value, _PROFILE.value)
    return
  outdir = harness.out_dir(_OUTDIR.value, "train_gla340m")
  tmp = tempfile.mkdtemp(prefix="bench340m_")
  # The child gets the config file and its overrides as given (--config=FILE, --config.x=v).
  argv = sys.argv[1:]
  overrides = [f"--config={argv[i + 1]}" if a == "--config" else a for i, a in enumerate(argv)
               if a.startswith("--config.") or a.startswith("--config=")
               or (a == "--config" and i + 1 < len(argv))]
  results, streams = [], {}
  out_json = f"train_gla340m_{_TAG.value}"
  cfg0 = settings(_CONFIG.value, 16384, _STEPS.value, False)
  from models import model_from_config
  model_cfg = model_from_config(cfg0.model.to_dict())[0]
  have_fla = fla_available()

  def write():
    meta = {"runs": _RUNS.value, "steps": _STEPS.value, "warmup": _WARMUP.value,
            "overrides": overrides, "peak_flops": PEAK_FLOPS,
            "attention_flops_per_token_16384": attention_flops_per_token(model_cfg, 16384),
            "results": results}
    text = (f"`python -m benchmarks.train_gla340m {' '.join(sys.argv[1:])}`\n\n"
            + table(results, model_cfg) + "\n")
    harness.write_environment(outdir, out_json, devices=False)
    for folder in dict.fromkeys((outdir, os.environ.get("OUT"))):
      if folder:
        with open(os.path.join(folder, out_json + ".json"), "w") as f:
          json.dump(meta, f, indent=1)
        with open(os.path.join(folder, out_json + ".md"), "w") as f:
          f.write(text)
        if sum(bool(r.get("losses")) for r in results) >= 2:
          plot(results, os.path.join(folder, f"loss_{_TAG.value}.png"))
    print(text, flush=True)

  for spec in _RUNS.value.split(","):
    parts = spec.split(":")
    impl, seq_len = parts[0], int(parts[1]) if len(parts) > 1 else 16384
    remat, dense = "remat" in parts[2:], "dense" in parts[2:]   # dense: float32 logits
    if impl == "fla" and not have_fla:
      results.append({"impl": "fla", "seq_len": seq_len, "error": "FLA not importable"})
      continue
    if seq_len not in streams:
      cfg = settings(_CONFIG.value, seq_len, _STEPS.value, False)
      path = os.path.join(tmp, f"tokens_{seq_len}.npz")
      import optax
      t = cfg.train
      sched = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, t.steps,
                                                 end_value=t.lr * t.min_lr_ratio)
      np.savez(path, inputs=token_stream(cfg, _STEPS.value),
               lrs=np.asarray([float(sched(s)) for s in range(_STEPS.value)]))
      with open(path + ".cfg.json", "w") as f:
        json.dump({"seq_len": seq_len}, f)
      streams[seq_len] = path
    out = os.path.join(tmp, spec.replace(":", "_") + ".json")
    if impl == "ours":
      cmd = [sys.executable, "-m", "benchmarks.train_gla340m", "--child", out,
             "--batches", streams[seq_len], f"--steps={_STEPS.value}",
             f"--warmup={_WARMUP.value}", f"--remat={remat}", f"--profile={_PROFILE.value}",
             *overrides, *(["--config.train.loss_chunk_size=0"] if dense else [])]
    else:
      cmd = [sys.executable, "-m", "benchmarks.fla_gla340m",
             "--batches", streams[seq_len], "--out", out, f"--warmup={_WARMUP.value}"]
      cmd += ["--checkpointing"] if remat else []
      if _PROFILE.value:
        cmd += ["--profile", os.path.join(outdir, f"fla_profile_{_TAG.value}.txt")]
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    t0 = time.time()
    print(f"== {spec}: {' '.join(cmd)}", flush=True)
    try:
      subprocess.run(cmd, cwd=ROOT, env=env, timeout=_TIMEOUT.value, check=False)
      with open(out) as f:
        r = json.load(f)
    except Exception as e:  # noqa: BLE001
      r = {"impl": impl, "seq_len": seq_len, "error": f"{type(e).__name__}: {e}"[:300]}
    r["wall_s"] = time.time() - t0
    r["remat"] = remat
    r["spec"] = spec
    results.append(r)
    if r.get("profile"):
      from benchmarks import profile_step
      name = f"profile_{_TAG.value}_{spec.replace(':', '_')}.txt"
      with open(os.path.join(outdir, name), "w") as f:
        f.write(profile_step.format_summary(r["profile"]) + "\n")
    write()
  write()


if __name__ == "__main__":
  app.run(main)
