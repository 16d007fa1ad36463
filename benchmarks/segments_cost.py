"""What ``segment_ids`` (packed documents, docs/design.md §10) cost, and a GPU check of them.

One script for one GPU. First the checks, on the GPU, of the compiled Pallas
kernels with segments (documents of 1 to ~700 tokens, starts on and off chunk boundaries,
padding): float32 with strong decay against the jnp path with segments and against a
float64 per-document numpy loop (forward, final state and every gradient), and bf16
against the float32 jnp path. Then the timing at the kernel benchmark's first shape
(B1 T16384 H16 K128 V128, bf16, per-dim decay logsigmoid(x)/16, chunk 64): forward and
forward + backward of ``chunk_gla(backend="pallas")`` without segments and with about 8
documents per row, interleaved (none, segments, none, segments, ...) in one run, each the
median over ``--reps`` repeats of the mean of ``--iters`` calls (each repeat after one
synchronised call: ``benchmarks._harness.mean_ms``).

    python -m benchmarks.segments_cost --out DIR          # on the H200 (results: segments_cost.md)
    python -m benchmarks.segments_cost --smoke            # tiny shapes, any machine

Writes segments_cost.json, segments_cost.log and segments_cost.env.json to --out (default
$OUT, else runs/benchmarks/segments_cost).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _harness as harness  # noqa: E402
from benchmarks._harness import rel  # noqa: E402
from zeco_jax import chunk_gla, segments  # noqa: E402
from zeco_jax.ops.gla.reference import gla_float64_documents  # noqa: E402


def random_ids(rng, B, T, docs, pad):
  """[B, T] int32: ``docs`` documents of random lengths per row, then ``pad`` padding."""
  rows = []
  for _ in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T - pad), docs - 1, replace=False))
    cu = np.concatenate([[0], cuts, [T - pad]])
    rows.append(np.asarray(segments.cu_seqlens_to_segment_ids(cu, T))[0])
  return np.stack(rows).astype(np.int32)


def vjp_fn(backend, chunk_size):
  def run(q, k, v, g, h0, ids, do, dht):
    def f(q, k, v, g, h0):
      return chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True,
                       chunk_size=chunk_size, backend=backend, segment_ids=ids)
    (o, final), pull = jax.vjp(f, q, k, v, g, h0)
    return o, final, pull((do.astype(o.dtype), dht))
  return jax.jit(run)


def checks(log, smoke):
  """GPU checks of the compiled kernels with segments. Returns {name: error} and ok."""
  rng = np.random.default_rng(0)
  B, T, H, K, V = (1, 256, 2, 16, 16) if smoke else (2, 2048, 4, 64, 64)
  x = lambda *s: rng.standard_normal(s).astype(np.float32)
  q, k, v, do = x(B, T, H, K), x(B, T, H, K), x(B, T, H, V), x(B, T, H, V)
  h0, dht = x(B, H, K, V), x(B, H, K, V)
  g = (-np.log1p(np.exp(-x(B, T, H, K))) * 4.0 - rng.uniform(0, 3, (B, T, H, K))).astype(np.float32)
  # Row 0: starts on chunk boundaries (64, 128, 1024), a 1-token document, 7 padding
  # tokens at the end and one inside a document; the other rows: random lengths.
  ids = random_ids(rng, B, T, docs=12, pad=7)
  cu = np.array([0, 1, 64, 70, 128, 129, 700, 1024, T - 7]) if T >= 2048 else \
      np.array([0, 1, 64, 70, 128, 129, T - 7])
  ids[0] = np.asarray(segments.cu_seqlens_to_segment_ids(cu, T))[0]
  ids[0, 3] = -5
  args = [jnp.asarray(a) for a in (q, k, v, g, h0)] + [jnp.asarray(ids)]
  cots = [jnp.asarray(do), jnp.asarray(dht)]
  errs, ok = {}, True
  o_p, s_p, gr_p = vjp_fn("pallas", 64)(*args, *cots)
  o_j, s_j, gr_j = vjp_fn("jax", 64)(*args, *cots)
  t0 = time.perf_counter()
  o_t, s_t, gr_t = gla_float64_documents(q, k, v, g, h0, do, dht, ids, K ** -0.5)
  log(f"float64 per-document truth: {time.perf_counter() - t0:.1f} s on the host")
  names = "q k v g h0".split()
  for label, (o, s, gr), ref, tol in (
      ("f32 pallas vs jnp", (o_p, s_p, gr_p), (o_j, s_j, dict(zip(names, gr_j))), (1e-5, 1e-4)),
      ("f32 pallas vs f64", (o_p, s_p, gr_p), (o_t, s_t, gr_t), (1e-5, 1e-4)),
      ("f32 jnp vs f64", (o_j, s_j, gr_j), (o_t, s_t, gr_t), (1e-5, 1e-4))):
    e = {"o": rel(o, ref[0]), "final": rel(s, ref[1])}
    e.update({"d" + n: rel(a, ref[2][n]) for n, a in zip(names, gr)})
    good = all(val <= (tol[0] if n in ("o", "final") else tol[1]) for n, val in e.items())
    ok &= good
    errs[label] = e
    log(f"{label}: " + " ".join(f"{n} {val:.1e}" for n, val in e.items())
        + ("  ok" if good else "  FAIL"))
  pad = ids < 0
  padded_zero = not np.any(np.asarray(o_p)[pad]) and not np.any(np.asarray(gr_p[0])[pad])
  ok &= padded_zero
  log(f"padding: outputs and dq zero on the GPU: {padded_zero}")
  # bf16 kernels against the float32 jnp path
  bf = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 and a.ndim == 4 and i != 3 else a
        for i, a in enumerate(args)]
  o_b, s_b, gr_b = vjp_fn("pallas", 64)(*bf, *cots)
  e = {"o": rel(jnp.asarray(o_b, jnp.float32), o_j), "final": rel(s_b, s_j)}
  e.update({"d" + n: rel(jnp.asarray(a, jnp.float32), r) for n, a, r in zip(names, gr_b, gr_j)})
  good = all(val <= 2e-2 for val in e.values())
  ok &= good
  errs["bf16 pallas vs f32 jnp"] = e
  log("bf16 pallas vs f32 jnp: " + " ".join(f"{n} {val:.1e}" for n, val in e.items())
      + ("  ok" if good else "  FAIL"))
  return errs, ok


def timings(log, smoke, iters, reps, docs):
  rng = np.random.default_rng(1)
  B, T, H, K, V = (1, 512, 2, 16, 16) if smoke else (1, 16384, 16, 128, 128)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v, do = x(B, T, H, K), x(B, T, H, K), x(B, T, H, V), x(B, T, H, V)
  g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)) / 16
  ids = jnp.asarray(random_ids(rng, B, T, docs=docs, pad=0))
  starts = int(np.asarray(segments.document_starts(ids)).sum())
  lengths = np.diff(np.flatnonzero(np.r_[np.asarray(segments.document_starts(ids))[0], True]))
  log(f"timing B{B} T{T} H{H} K{K} V{V} bf16: {starts} documents per row "
      f"(lengths {lengths.tolist()})")

  def fns(with_ids):
    def fwd(q, k, v, g, ids):
      return chunk_gla(q, k, v, g, backend="pallas",
                       segment_ids=ids if with_ids else None)[0]

    def fwd_bwd(q, k, v, g, ids, do):
      o, pull = jax.vjp(lambda q, k, v, g: fwd(q, k, v, g, ids), q, k, v, g)
      return o, pull(do)          # o too: else XLA drops the forward's output as dead code
    return (jax.jit(fwd).lower(q, k, v, g, ids).compile(),
            jax.jit(fwd_bwd).lower(q, k, v, g, ids, do).compile())

  variants = {"none": fns(False), "segments": fns(True)}
  sync = lambda out: jax.block_until_ready(out)

  def once(fn, *a):
    return harness.mean_ms(lambda: fn(*a), sync, iters, warmup=1)

  for name, (f, fb) in variants.items():      # warm-up
    sync(f(q, k, v, g, ids)), sync(fb(q, k, v, g, ids, do))
  times = {name: {"fwd": [], "fwd_bwd": []} for name in variants}
  for _ in range(reps):                        # interleaved: drift hits both alike
    for name, (f, fb) in variants.items():
      times[name]["fwd"].append(once(f, q, k, v, g, ids))
      times[name]["fwd_bwd"].append(once(fb, q, k, v, g, ids, do))
  med = {n: {p: float(np.median(ts)) for p, ts in d.items()} for n, d in times.items()}
  spread = {n: {p: [float(min(ts)), float(max(ts))] for p, ts in d.items()}
            for n, d in times.items()}
  for p in ("fwd", "fwd_bwd"):
    a, b = med["none"][p], med["segments"][p]
    log(f"{p:8s} none {a:.3f} ms [{spread['none'][p][0]:.3f}-{spread['none'][p][1]:.3f}]  "
        f"segments {b:.3f} ms [{spread['segments'][p][0]:.3f}-{spread['segments'][p][1]:.3f}]"
        f"  overhead {100 * (b / a - 1):+.1f}%")
  return {"shape": [B, T, H, K, V], "documents_per_row": starts, "median_ms": med,
          "min_max_ms": spread, "iters": iters, "reps": reps}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--docs", type=int, default=8)
  ap.add_argument("--smoke", action="store_true")
  a = ap.parse_args()
  a.out = harness.out_dir(a.out, "segments_cost")
  harness.write_environment(a.out, "segments_cost")
  lines = []

  def log(s):
    print(s, flush=True)
    lines.append(s)

  log(f"jax {jax.__version__}, devices {jax.devices()}")
  errs, ok = checks(log, a.smoke)
  result = {"checks": errs, "checks_ok": bool(ok),
            "timing": timings(log, a.smoke, a.iters, a.reps, a.docs)}
  with open(os.path.join(a.out, "segments_cost.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(a.out, "segments_cost.log"), "w") as f:
    f.write("\n".join(lines) + "\n")
  log("checks: " + ("all ok" if ok else "FAILED"))


if __name__ == "__main__":
  main()
