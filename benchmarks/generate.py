"""GLA-340M generation on one GPU, ours (JAX) beside FLA's PyTorch model with Hugging Face
``generate``: prefill time, and decode tokens/s at batch 1 and 64 after a long prompt.

    python -m benchmarks.generate                     # ours + FLA: prompt 4096, 128 new tokens
    python -m benchmarks.generate --impls ours --batches 1,64 --prompt 4096 --new 128 \\
        --long_prompt 65536

(Run from the repository root; one GPU; FLA and torch for its part; results:
benchmarks/results/generate_h200.md.) Each side runs in its own process, ours first
(JAX and torch never hold the GPU at once). Both are GLA-340M (``configs/gla_340m.py``'s
model; FLA's ``GLAForCausalLM`` as in ``benchmarks.fla_gla340m``) at random init with
bfloat16 parameters and activations, greedy decoding of exactly ``--new`` tokens (no EOS
stop) after a prompt of ``--prompt`` random tokens.

Per batch size B: ``prefill`` is the prompt's forward with the caches filled (ours:
``LM.prefill``, one jitted program; FLA: ``model(prompt, use_cache=True)``), ``generate``
the whole call (ours: ``models.generation.generate``, one jitted program of the prefill and
a ``lax.while_loop`` of decode steps; FLA: ``model.generate(prompt, max_new_tokens=N,
min_new_tokens=N, do_sample=False)``, whose layers switch to ``fused_recurrent`` for short
inputs). Decode tokens/s = B x N / (generate - prefill), medians of ``--reps`` calls after
one warm-up call (compilation, Triton autotuning). ``--long_prompt``: prefill alone at B = 1.

Writes ``generate_<tag>.json`` (figures and each side's environment) and ``.md`` (the table)
to --outdir (default $OUT, else runs/benchmarks/generate).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from benchmarks import _harness as harness

_IMPLS = flags.DEFINE_list("impls", ["ours", "fla"], "which sides to run")
_BATCHES = flags.DEFINE_list("batches", ["1", "64"], "decode batch sizes")
_PROMPT = flags.DEFINE_integer("prompt", 4096, "prompt tokens before decoding")
_NEW = flags.DEFINE_integer("new", 128, "tokens decoded per row")
_LONG = flags.DEFINE_integer("long_prompt", 65536, "a prompt timed for prefill alone at "
                             "B = 1 (0: skip)")
_REPS = flags.DEFINE_integer("reps", 3, "timed calls per figure (median)")
_OUTDIR = flags.DEFINE_string("outdir", None, "default $OUT, else runs/benchmarks/generate")
_TAG = flags.DEFINE_string("tag", "h200", "file name tag")
_TIMEOUT = flags.DEFINE_integer("timeout", 420, "seconds per side")
_CHILD = flags.DEFINE_string("child", None, "internal: run one side, write JSON here")

VOCAB = 32000


def _median_s(fn, sync, reps):
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    sync(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def run_ours(batches, prompt_len, new, long_prompt, reps) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import configs.gla_340m
  from models import model_from_config
  from models.generation import generate
  cfg, lm_cls = model_from_config(configs.gla_340m.get_config().model.to_dict())
  model = lm_cls(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  model = nnx.merge(graphdef, params)
  prefill = jax.jit(lambda state, p: nnx.merge(graphdef, state).prefill(p))
  out = {"impl": "ours", "env": harness.environment(), "rows": []}
  rng = np.random.default_rng(0)
  for B in batches:
    prompt = jnp.asarray(rng.integers(0, VOCAB, (B, prompt_len)), jnp.int32)
    row = {"B": B}
    jax.block_until_ready(prefill(params, prompt))
    row["prefill_s"] = _median_s(lambda: prefill(params, prompt), jax.block_until_ready, reps)
    gen = lambda: generate(model, prompt, max_new_tokens=new)
    t0 = time.perf_counter()
    tokens, _ = jax.block_until_ready(gen())
    row["first_call_s"] = time.perf_counter() - t0
    row["generate_s"] = _median_s(gen, jax.block_until_ready, reps)
    row["decode_tokens_per_s"] = B * new / (row["generate_s"] - row["prefill_s"])
    row["first_tokens"] = np.asarray(tokens[0, :8]).tolist()
    out["rows"].append(row)
    print(json.dumps(row), flush=True)
  if long_prompt:
    prompt = jnp.asarray(rng.integers(0, VOCAB, (1, long_prompt)), jnp.int32)
    jax.block_until_ready(prefill(params, prompt))
    out["long_prefill_s"] = _median_s(lambda: prefill(params, prompt),
                                      jax.block_until_ready, reps)
  out["peak_gib"] = jax.devices()[0].memory_stats().get("peak_bytes_in_use", 0) / 2**30
  return out


def run_fla(batches, prompt_len, new, long_prompt, reps) -> dict:
  import torch
  from fla.models import GLAConfig, GLAForCausalLM
  config = GLAConfig(hidden_size=1024, num_hidden_layers=24, num_heads=4, expand_k=0.5,
                     expand_v=1.0, hidden_ratio=4, vocab_size=VOCAB, attn_mode="chunk",
                     use_gk=True, use_gv=False, tie_word_embeddings=True, fuse_norm=True,
                     use_cache=True)
  torch.manual_seed(0)
  model = GLAForCausalLM(config).cuda().to(torch.bfloat16).eval()
  out = {"impl": "fla", "env": harness.environment(devices=False), "rows": []}
  sync = harness.torch_sync
  rng = np.random.default_rng(0)
  with torch.no_grad():
    for B in batches:
      prompt = torch.as_tensor(rng.integers(0, VOCAB, (B, prompt_len)), device="cuda")
      row = {"B": B}
      call = lambda: model(prompt, use_cache=True)
      t0 = time.perf_counter()
      sync(call())
      row["prefill_first_call_s"] = time.perf_counter() - t0
      row["prefill_s"] = _median_s(call, sync, reps)
      gen = lambda: model.generate(prompt, max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, use_cache=True, pad_token_id=0)
      t0 = time.perf_counter()
      tokens = gen()
      sync()
      row["first_call_s"] = time.perf_counter() - t0
      assert tokens.shape[1] == prompt_len + new, tokens.shape
      row["generate_s"] = _median_s(gen, sync, reps)
      row["decode_tokens_per_s"] = B * new / (row["generate_s"] - row["prefill_s"])
      out["rows"].append(row)
      print(json.dumps(row), flush=True)
      del prompt
      torch.cuda.empty_cache()
    if long_prompt:
      prompt = torch.as_tensor(rng.integers(0, VOCAB, (1, long_prompt)), device="cuda")
      call = lambda: model(prompt, use_cache=True)
      sync(call())
      out["long_prefill_s"] = _median_s(call, sync, reps)
  out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
  return out


def table(results: dict, new: int, prompt_len: int, long_prompt: int) -> str:
  lines = [f"| B | side | prefill {prompt_len} (ms) | generate {new} (ms) | decode tokens/s |",
           "|---|---|---|---|---|"]
  for B in sorted({r["B"] for side in results.values() for r in side.get("rows", [])}):
    for name, side in results.items():
      for r in side.get("rows", []):
        if r["B"] == B:
          lines.append(f"| {B} | {name} | {r['prefill_s'] * 1e3:.1f} | "
                       f"{r['generate_s'] * 1e3:.1f} | {r['decode_tokens_per_s']:.0f} |")
  if long_prompt:
    for name, side in results.items():
      if "long_prefill_s" in side:
        lines.append(f"\nprefill of {long_prompt} tokens (B = 1), {name}: "
                     f"{side['long_prefill_s'] * 1e3:.1f} ms")
  for name, side in results.items():
    if "error" in side:
      lines.append(f"\n{name}: {side['error']}")
  return "\n".join(lines)


def main(argv):
  del argv
  batches = [int(b) for b in _BATCHES.value]
  args = (batches, _PROMPT.value, _NEW.value, _LONG.value, _REPS.value)
  if _CHILD.value:
    impl = os.environ["ZECO_BENCH_IMPL"]
    result = (run_ours if impl == "ours" else run_fla)(*args)
    with open(_CHILD.value, "w") as f:
      json.dump(result, f, indent=1)
    return
  outdir = harness.out_dir(_OUTDIR.value, "generate")
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for impl in _IMPLS.value:
      path = os.path.join(tmp, f"{impl}.json")
      cmd = [sys.executable, "-m", "benchmarks.generate", "--child", path,
             f"--batches={','.join(map(str, batches))}", f"--prompt={_PROMPT.value}",
             f"--new={_NEW.value}", f"--long_prompt={_LONG.value}", f"--reps={_REPS.value}"]
      env = dict(os.environ, ZECO_BENCH_IMPL=impl)
      print(f"== {impl}: {' '.join(cmd)}", flush=True)
      try:
        subprocess.run(cmd, cwd=harness.ROOT, env=env, timeout=_TIMEOUT.value, check=False)
        with open(path) as f:
          results[impl] = json.load(f)
      except Exception as e:  # noqa: BLE001 (a side that fails is reported, not fatal)
        results[impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
  text = table(results, _NEW.value, _PROMPT.value, _LONG.value)
  print(text)
  with open(os.path.join(outdir, f"generate_{_TAG.value}.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(outdir, f"generate_{_TAG.value}.md"), "w") as f:
    f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
