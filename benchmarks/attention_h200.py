"""Softmax attention's local kernels on one GPU: does ``backend="auto"`` run cuDNN, is it
right, and does our wrapper cost anything beside ``jax.nn.dot_product_attention`` alone?

    python -m benchmarks.attention_h200 [--shape 1,16384,8,2,128] [--iters 10 --reps 5]
        [--json out.json]

Results: benchmarks/results/hybrid_h200.md (with the hybrid-340M step). With --json the
environment record goes beside it (``<json>.env.json``).

1. Correct: ``attention(backend="auto")`` and ``backend="cudnn"`` (bf16, B1 T1024 H8 Hkv2
   D128; causal, and causal with a 256-token window) against the float64 truth
   (``zeco_jax.ops.attention.reference.attention_float64`` of the bf16 inputs): output and
   gradients of q, k, v within 2e-2 (relative norm); the compiled HLO of "auto" must call
   cuDNN's fused attention (``__cudnn$fmha``).
2. Time, forward + backward (grad of sum(o * do) for q, k, v) at the hybrid-340M attention
   shape (B, T, H, Hkv, D; bf16, causal): ``jax.nn.dot_product_attention(implementation=
   "cudnn")`` alone; ``zeco_jax.ops.attention.op.attention`` (``"auto"``); ``sp_attention``
   over a one-GPU mesh (``P = 1``, the layer's path when seq = 1 is not taken: it checks
   the wrapper); and the XLA form (``backend="xla"``) for scale. Median over ``reps`` of the
   mean of ``iters`` calls after a warm-up (``benchmarks._harness.time_loop``).
"""
from __future__ import annotations

import argparse
import json
import os

from benchmarks import _harness as harness
from benchmarks._harness import rel

CUDNN_CALL = "__cudnn$fmha"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="1,16384,8,2,128", help="B,T,H,Hkv,D")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  from zeco_jax.ops.attention.op import attention
  from zeco_jax.ops.attention.parallel import sp_attention
  from zeco_jax.ops.attention.reference import attention_float64

  log = lambda *a: print(*a, flush=True)
  log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  result = {"checks": [], "times_ms": {}}

  def inputs(B, T, H, Hkv, D, seed=0):
    r = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.bfloat16)
    return n(B, T, H, D), n(B, T, Hkv, D), n(B, T, Hkv, D), n(B, T, H, D)

  def fwd_bwd(fn):
    def run(q, k, v, do):
      o, pull = jax.vjp(fn, q, k, v)
      return o, pull(do)
    return jax.jit(run)

  # 1. correctness against the float64 truth, and "auto" = cuDNN
  q, k, v, do = inputs(1, 1024, 8, 2, 128)
  for window in (None, 256):
    o64, g64 = attention_float64(q.astype(jnp.float32), k.astype(jnp.float32),
                                 v.astype(jnp.float32), do.astype(jnp.float32), window=window)
    for backend in ("auto", "cudnn"):
      f = fwd_bwd(lambda q, k, v: attention(q, k, v, window=window, backend=backend))
      hlo = f.lower(q, k, v, do).compile().as_text()
      o, grads = f(q, k, v, do)
      errs = {"o": rel(o.astype(jnp.float32), o64)}
      errs.update({n: rel(g.astype(jnp.float32), g64[n]) for n, g in zip("qkv", grads)})
      row = dict(backend=backend, window=window, cudnn_calls=hlo.count(CUDNN_CALL),
                 errors=errs, ok=all(e <= 2e-2 for e in errs.values())
                 and hlo.count(CUDNN_CALL) >= 2)
      result["checks"].append(row)
      log("check", json.dumps(row))

  # 2. time at the model's shape
  B, T, H, Hkv, D = map(int, args.shape.split(","))
  result["shape"] = dict(B=B, T=T, H=H, Hkv=Hkv, D=D)
  q, k, v, do = inputs(B, T, H, Hkv, D, seed=1)
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  fns = {
      "jax.nn.dot_product_attention (cuDNN) alone": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn"),
      "attention (auto)": lambda q, k, v: attention(q, k, v),
      "sp_attention, P = 1 (auto)": lambda q, k, v: sp_attention(q, k, v, mesh=mesh),
      "attention (xla)": lambda q, k, v: attention(q, k, v, backend="xla"),
  }
  for name, fn in fns.items():
    f = fwd_bwd(fn)
    ms = harness.time_loop(lambda: f(q, k, v, do), None, args.iters, args.reps, warmup=1)
    result["times_ms"][name] = ms
    log(f"time {name}: {ms:.3f} ms")
  base = result["times_ms"]["jax.nn.dot_product_attention (cuDNN) alone"]
  for name, ms in result["times_ms"].items():
    log(f"  {name}: {ms / base:.3f}x cuDNN alone")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(result, fh, indent=1)
    harness.write_environment(os.path.dirname(os.path.abspath(args.json)),
                              os.path.splitext(os.path.basename(args.json))[0])


if __name__ == "__main__":
  main()
