"""DEV A/B (untracked, not for landing): Gated DeltaNet's op with the fused WY kernel
(``gdn_wy``) against ``gdn_ut_inverse`` + ``gdn_wu``, switched by the dev attribute
``pallas_kernels.gated_delta.chunk.FUSED_WY`` between ``jax.clear_caches()`` calls in one
process.

    OUT=/tmp/ab python .dev_ab_gdn.py            # on the GPU machine, from the repo root
    AB_DEADLINE=500 ...                          # skip rows once 500 s have passed
    AB_SHAPES="1,128,2,32,32" ...                # B,T,H,K,V[;...] (CPU smoke: interpreter)
    AB_MODES="unfused,fused,unfused" ...         # the rows' order (default below)

Modes: ``unfused`` (FUSED_WY False), ``fused`` (FUSED_WY and FUSED_WY_BWD True: gdn_wy in
the forward, and in the backward writing T for gdn_dwy), ``fused_fwd`` (fused forward
only: FUSED_WY_BWD False), ``fused_w4`` / ``fused_w8`` (fused, ``wy_warps`` 4 / 8; the
default is 2, the inverse's).

Per shape and mode, one JSON line appended to ``$OUT/gdn_ab.jsonl`` (OUT default "."):
forward ms (jit, mean of 100 calls, median of 3: ``benchmarks._harness.time_loop``),
forward + backward ms (jax.grad of sum(o * do) for q, k, v, g, beta; 30 calls), the kernel
names in the traced forward + backward (a check that the switch took), and the
relative norm of o and of each gradient against the shape's first row (unfused). Inputs:
``benchmarks._harness.gdn_inputs`` (k unit-norm, g = log U(0.9, 1) per head, beta =
sigmoid(N(0, 1))), q, k, v, beta, do in bf16, g float32.
"""
import json
import os
import time

import jax
import jax.numpy as jnp

from benchmarks import _harness as harness
from pallas_kernels.gated_delta import chunk, default_config
from zeco_jax import chunk_gated_delta_rule

T0 = time.time()
DEADLINE = float(os.environ.get("AB_DEADLINE", "1e9"))
OUT = os.environ.get("OUT", ".")
ON_GPU = jax.default_backend() == "gpu"
SHAPES = [tuple(int(x) for x in s.split(",")) for s in os.environ.get(
    "AB_SHAPES", "8,4096,16,128,128;1,16384,16,128,128").split(";")]
MODES = os.environ.get("AB_MODES", "unfused,fused,unfused,fused_w4,fused_fwd,fused_w8").split(",")
FWD_ITERS, FB_ITERS, REPS = (100, 30, 3) if ON_GPU else (1, 1, 1)
NAMES = ("gdn_wy", "gdn_ut_inverse", "gdn_wu")


def emit(row):
  os.makedirs(OUT, exist_ok=True)
  row = dict(row, t_s=round(time.time() - T0, 1), device=str(jax.devices()[0].device_kind),
             jax=jax.__version__)
  with open(os.path.join(OUT, "gdn_ab.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")
  print(json.dumps(row), flush=True)


def rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def set_mode(mode):
  chunk.FUSED_WY = mode != "unfused"
  chunk.FUSED_WY_BWD = mode != "fused_fwd"
  jax.clear_caches()


def run_shape(shape):
  B, T, H, K, V = shape
  bf = jnp.bfloat16
  qn, kn, vn, gn, bn, don = harness.gdn_inputs(0, B, T, H, K, V)
  q, k, v, beta, do = (jnp.asarray(x, bf) for x in (qn, kn, vn, bn, don))
  g = jnp.asarray(gn, jnp.float32)
  args = (q, k, v, g, beta)
  platform = "gpu" if ON_GPU else "cpu"
  ref = None
  for mode in MODES:
    label = dict(shape=f"B{B} T{T} H{H} K{K} V{V}", mode=mode)
    if time.time() - T0 > DEADLINE:
      emit(dict(label, skipped="AB_DEADLINE"))
      continue
    set_mode(mode)
    cfg = None
    if mode in ("fused_w4", "fused_w8"):
      cfg = default_config(platform, B, T, H, K, V, bf).replace(wy_warps=int(mode[-1]))
    op = lambda *a, cfg=cfg: chunk_gated_delta_rule(*a, backend="pallas",
                                                    kernel_config=cfg)[0]
    fwd = jax.jit(op)
    loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32) * do.astype(jnp.float32))
    fb = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4)))
    text = str(jax.make_jaxpr(fb)(*args))           # forward + backward, traced only
    seen = [n for n in NAMES if n in text]
    row = dict(label, kernels=seen,
               wy_warps=None if chunk.FUSED_WY is False else (cfg.wy.warps if cfg else
                                                              "default"))
    row["fwd_ms"] = harness.time_loop(lambda: fwd(*args), iters=FWD_ITERS, reps=REPS)
    row["fwd_bwd_ms"] = harness.time_loop(lambda: fb(*args), iters=FB_ITERS, reps=REPS)
    outs = (fwd(*args),) + tuple(fb(*args))
    if ref is None:
      ref = outs
    else:
      row["rel_vs_first_unfused"] = {n: rel(a, b) for n, a, b in zip(
          ("o", "dq", "dk", "dv", "dg", "dbeta"), outs, ref)}
    emit(row)
    del outs


def main():
  print(f"devices: {jax.devices()}; modes {MODES}; shapes {SHAPES}", flush=True)
  for shape in SHAPES:
    run_shape(shape)
  set_mode("fused")


if __name__ == "__main__":
  main()
