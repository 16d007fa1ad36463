"""FLA's GLA-340M (PyTorch, flash-linear-attention 0.6.0) trained on a given token stream:
tokens/s, peak memory, per-step losses, optionally a torch.profiler kernel summary.

Run by ``benchmarks.train_gla340m`` in its own process (torch and JAX never share the
GPU at once), or alone on a batch file it wrote (one GPU, torch and FLA installed):

    python -m benchmarks.fla_gla340m --batches B.npz --out R.json [--checkpointing]
        [--profile P.txt] [--init-std 0.006]

``B.npz`` holds ``inputs`` int32 ``[steps, B, T]`` (next-token targets are the inputs
shifted by one: FLA shifts its ``labels`` itself) and ``lrs`` float ``[steps]``, the
learning rate of each step (the JAX side's optax schedule, so both follow one schedule).

The model is GLA-340M in FLA's terms: ``GLAConfig(hidden_size=1024,
num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1.0, hidden_ratio=4,
vocab_size=32000, attn_mode="chunk", use_gk=True, use_gv=False, tie_word_embeddings=True,
fuse_cross_entropy=True, fuse_norm=True, use_cache=False)``, plus ``initializer_range``
(``--init-std``; init only, no effect on speed), with the attention and MLP output
projections redrawn from N(0, init_std / sqrt(2 L)) as ours are (FLA's GLA draws them
from N(0, init_std)). float32 parameters under
``torch.autocast(bfloat16)``, ``torch.optim.AdamW(fused=True)`` with weight decay on
matrices only (as the JAX trainer's mask), gradient clipping at 1.0. The first step
includes Triton's autotuning unless ``TRITON_CACHE_DIR`` holds a filled cache. R.json
carries the run's environment record (``benchmarks._harness.environment``, no jax device).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from benchmarks import _harness as harness


def build(init_std: float, checkpointing: bool):
  import torch
  from fla.models import GLAConfig, GLAForCausalLM
  config = GLAConfig(hidden_size=1024, num_hidden_layers=24, num_heads=4, expand_k=0.5,
                     expand_v=1.0, hidden_ratio=4, vocab_size=32000, attn_mode="chunk",
                     use_gk=True, use_gv=False, tie_word_embeddings=True,
                     fuse_cross_entropy=True, fuse_norm=True, use_cache=False,
                     initializer_range=init_std)
  torch.manual_seed(0)
  model = GLAForCausalLM(config).cuda().float()
  # FLA draws every projection from N(0, init_std); ours draws the two residual-branch
  # outputs (attention o_proj, MLP down_proj) from N(0, init_std / sqrt(2 L)) (GPT-2's
  # scaling, models/gla.py). Same here, so both start from one init distribution.
  out_std = init_std / math.sqrt(2 * config.num_hidden_layers)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(("o_proj.weight", "down_proj.weight")):
        p.normal_(0.0, out_std)
  if checkpointing:
    model.gradient_checkpointing_enable()
  model.train()
  return model


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--warmup", type=int, default=3, help="steps not timed (first: autotune)")
  ap.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing")
  ap.add_argument("--profile", default="", help="write a torch.profiler kernel summary here")
  ap.add_argument("--init-std", type=float, default=0.006)
  ap.add_argument("--weight-decay", type=float, default=0.01)
  ap.add_argument("--b2", type=float, default=0.95)
  args = ap.parse_args()

  import torch
  data = np.load(args.batches)
  inputs, lrs = data["inputs"], data["lrs"]
  steps, B, T = inputs.shape
  result = {"impl": "fla", "seq_len": T, "batch_size": B, "steps": steps,
            "checkpointing": args.checkpointing, "torch": torch.__version__,
            "environment": {**harness.environment(devices=False),
                            "device": torch.cuda.get_device_name()}}
  try:
    import fla
    result["fla"] = getattr(fla, "__version__", "?")
    t0 = time.time()
    model = build(args.init_std, args.checkpointing)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=float(lrs[0]), betas=(0.9, args.b2), eps=1e-8, fused=True)
    torch.cuda.reset_peak_memory_stats()
    losses, marks = [], {}

    def step(s):
      for group in opt.param_groups:
        group["lr"] = float(lrs[s])
      ids = torch.from_numpy(inputs[s].astype(np.int64)).cuda(non_blocking=True)
      with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      opt.step()
      opt.zero_grad(set_to_none=True)
      return loss.detach()

    for s in range(steps):
      if s == args.warmup:
        torch.cuda.synchronize()
        marks["t0"] = time.time()
      losses.append(step(s))
      if s == 0:
        torch.cuda.synchronize()
        result["first_step_s"] = time.time() - t0
      if s < args.warmup or s == steps - 1:   # progress: the first steps autotune for minutes
        print(f"fla step {s}: loss {float(losses[-1]):.4f} at {time.time() - t0:.0f} s",
              flush=True)
    torch.cuda.synchronize()
    timed = steps - args.warmup
    dt = time.time() - marks["t0"]
    result.update({
        "params_m": n_params / 1e6, "losses": [float(x) for x in losses],
        "tokens_per_s": B * T * timed / dt, "step_s": dt / timed,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30})
    if args.profile:
      from torch.profiler import ProfilerActivity, profile
      n = 3
      with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in range(n):
          step(s % steps)
        torch.cuda.synchronize()
      table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=80,
                                        max_name_column_width=90)
      rows = [(e.key, e.device_time_total / n / 1e3, e.count / n)
              for e in prof.key_averages() if e.device_time_total > 0]
      with open(args.profile, "w") as f:
        f.write(f"torch.profiler, {n} steps, kernel time per step (ms)\n{table}\n")
      result["profile_kernels"] = sorted(rows, key=lambda r: -r[1])
  except Exception as e:  # noqa: BLE001  (report to the caller's table)
    import traceback
    traceback.print_exc()
    result["error"] = f"{type(e).__name__}: {str(e)[:400]}"
  with open(args.out, "w") as f:
    json.dump(result, f)
  print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "profile_kernels")}),
        flush=True)


if __name__ == "__main__":
  main()
