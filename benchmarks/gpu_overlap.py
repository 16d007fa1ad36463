"""The All-Scan's overlap on the GPU path: the schedule XLA's GPU compiler gives the chain's
sends, and what splitting the local pass (``overlap_pieces``) costs on a GPU.

Two modes, each its own process (--mock changes the GPU client):

  # The schedule: zeco_gla forward + backward over seq = P GPUs, compiled by the real GPU
  # compiler, so the latency-hiding scheduler's placement of every collective-permute
  # start/done pair can be read from the compiled HLO. On a multi-GPU host without --mock;
  # on ONE GPU --mock 8 mocks 8 processes of one GPU each (jax's mock_num_gpu_processes,
  # mock NCCL; with jax 0.11.2 on an H200 it did not finish compiling: results/gpu_overlap.md).
  python -m benchmarks.gpu_overlap schedule --mock 8 --pieces 1 2 4 8

  # The cost: the local pass of one GPU (16K tokens, H16, K = V = 128, bf16) whole against
  # in head groups, forward + backward, timed (median of --iters single calls after warm-up).
  python -m benchmarks.gpu_overlap local --pieces 1 2 4 8

Each prints one JSON line per configuration (and appends them to --out, the environment
record beside it as ``<out>.env.json``). The shapes are those of benchmarks/tpu_schedule.py
(B1 x 16384 tokens per device, H16, K = V = 128).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness as harness
from zeco_jax import chunk_gla, zeco_gla
from zeco_jax.runtime import hlo_stats

B, H, K, V = 1, 16, 128, 128


def _inputs(T, sharding=None):
  r = np.random.default_rng(0)
  shapes = ((B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K))
  dtypes = (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.float32)
  make = lambda i, s: (np.log(r.uniform(0.9, 1.0, s)) if i == 3   # log-decays in (log 0.9, 0]
                       else r.standard_normal(s)).astype(np.float32)
  hosts = [make(i, s) for i, s in enumerate(shapes)]
  if sharding is None:
    return [jnp.asarray(h, dt) for h, dt in zip(hosts, dtypes)]
  return [jax.make_array_from_callback(h.shape, sharding,
                                       lambda idx, h=h, dt=dt: jnp.asarray(h[idx], dt))
          for h, dt in zip(hosts, dtypes)]


def _time(f, args, iters):
  """Median ms of ``iters`` single synchronised calls, after two warm-up calls."""
  return harness.time_loop(lambda: f(*args), iters=1, reps=iters)


def schedule(pieces, iters, L):
  devices = jax.devices()
  P = len(devices)
  if P < 2:
    raise ValueError(f"schedule needs 2+ devices, got {P} ({devices[0].device_kind}): pass "
                     "--mock N on one GPU, or run on a multi-GPU host")
  mesh = jax.sharding.Mesh(np.array(devices), ("seq",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
  T = P * L
  specs = [jax.ShapeDtypeStruct((B, T, H, d), dt, sharding=sharding)
           for d, dt in ((K, jnp.bfloat16), (K, jnp.bfloat16), (V, jnp.bfloat16),
                         (K, jnp.float32))]
  print(f"schedule: {P} devices, {jax.process_count()} processes", file=sys.stderr, flush=True)
  rows = []
  for n in pieces:
    def loss(q, k, v, g, n=n):
      o, _ = zeco_gla(q, k, v, g, mesh=mesh, method="all_scan", overlap_pieces=n)
      return jnp.sum(o.astype(jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    t0 = time.perf_counter()
    compiled = step.lower(*specs).compile()
    text = compiled.as_text()
    print(f"compiled pieces={n}", file=sys.stderr, flush=True)
    ov = hlo_stats.async_overlap(text)
    row = {"mode": "schedule", "P": P, "overlap_pieces": n, "compile_s":
           round(time.perf_counter() - t0, 1), "device_kind": devices[0].device_kind,
           "tokens": L, "permute_pairs": len(ov), "with_compute": sum(c > 0 for c, _ in ov),
           "with_kernel": sum(k > 0 for _, k in ov), "pairs": ov,
           "triton_calls": text.count("__gpu$xla.gpu.triton")}
    if iters:
      try:   # mock NCCL moves no data: the time is this GPU's work and the schedule's waits
        row["ms_mock_nccl"] = round(_time(compiled, _inputs(T, sharding), iters), 3)
      except Exception as e:  # noqa: BLE001 - recorded: executing on a mock topology
        row["ms_mock_nccl"] = f"{type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
  return rows


def local(pieces, iters, L):
  q, k, v, g = _inputs(L)
  rows = []
  for n in pieces:
    hs = H // n
    def loss(q, k, v, g, n=n):
      outs = [chunk_gla(*(x[:, :, i * hs:(i + 1) * hs] for x in (q, k, v, g)))[0]
              for i in range(n)]
      return jnp.sum(jnp.concatenate(outs, axis=2).astype(jnp.float32))
    fwd = jax.jit(lambda *a, n=n: loss(*a, n=n))
    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    rows.append({"mode": "local", "overlap_pieces": n, "tokens": L,
                 "device_kind": jax.devices()[0].device_kind,
                 "fwd_ms": round(_time(fwd, (q, k, v, g), iters), 3),
                 "fwd_bwd_ms": round(_time(fb, (q, k, v, g), iters), 3)})
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("mode", choices=("schedule", "local"))
  ap.add_argument("--pieces", type=int, nargs="+", default=[1, 2, 4, 8])
  ap.add_argument("--iters", type=int, default=20, help="0: compile only (schedule)")
  ap.add_argument("--tokens", type=int, default=16384, help="tokens per device")
  ap.add_argument("--mock", type=int, default=0,
                  help="schedule: mock N processes of one GPU each (mock NCCL) on this GPU")
  ap.add_argument("--out", default=None, help="append the JSON rows to this file")
  a = ap.parse_args(argv)
  if a.mock:   # before the GPU client is made: it reads these when it is created
    jax.config.update("mock_num_gpu_processes", a.mock)
  rows = (schedule if a.mode == "schedule" else local)(a.pieces, a.iters, a.tokens)
  for row in rows:
    print(json.dumps(row), flush=True)
  if a.out:
    with open(a.out, "a") as fh:
      fh.writelines(json.dumps(r) + "\n" for r in rows)
    harness.write_environment(os.path.dirname(os.path.abspath(a.out)),
                              os.path.basename(a.out).rsplit(".", 1)[0])


if __name__ == "__main__":
  main()
