"""Gated DeltaNet's Pallas kernels on one GPU: each stage's launch options, the op, our GLA
beside it, and the sequence-parallel local pass.

    python -m benchmarks.gdn_kernels_h200 [--sweep] [--heads-340m] [--json out.json]
        [--profile TRACE_DIR] [--local-ab NAME:CHANGES ...] [--local-only]
        [--iters 10 --reps 3] [--rounds 1]

Results: benchmarks/results/gdn_h200.md (FLA beside the op: ``benchmarks.delta_h200``).

* ``--sweep``: at B1 T16384 H16 K=V=128 bf16, every kernel of
  :mod:`pallas_kernels.gated_delta` timed alone under each launch in :data:`OPTIONS`
  (the other stages at their defaults), then the walks' options at B8 T4096 H16.
* ``--heads-340m``: at Gated DeltaNet-340M's heads (B1 T16384 H6 K=256 V=512 bf16, where
  the walks and ``gdn_dqk`` take most of that model's step) the walks' and ``gdn_dqk``'s
  options of :func:`_options_340m` alone, then the op's forward + backward with the
  chunk states kept (``save_states=True``, the default) and walked again.
* always: ``chunk_gated_delta_rule`` (the default kernel configuration) forward and
  forward + backward (o and the vjp of do for q, k, v, g, beta, so that the forward runs
  whole: :func:`benchmarks._harness.live_fwd_bwd`) at B1 T16384 and B8 T4096 (H16,
  K=V=128, bf16), our ``chunk_gla`` forward + backward on the same tokens (g broadcast
  over K), and one rank's local pass: ``zeco_gated_delta_rule`` on a one-device
  mesh (the widened-state kernels and the fix-up; the scan over one rank is trivial),
  also with the widened pass's states kept (``kept``: a ``kernel_config`` with
  ``save_states``), against ``chunk_gated_delta_rule`` on the same 2048 tokens (B1 H16,
  forward + backward).
* ``--local-only``: the local pass alone (its row above), without the op's rows.
* ``--local-ab NAME:CHANGES ...``: more local passes, each with the widened pass's
  default configuration changed (``kept32:save_states=True,walk_bv=32``, as
  ``delta_h200 --ab``), timed in the same row as ``kept``.
* ``--profile``: the local pass and the op on its tokens traced after their timing (3
  calls each, ``jax.profiler``), the GPU time per kernel printed and kept in the JSON
  (``benchmarks.delta_h200.kernel_profile``): where the widened state's cost goes.

Inputs: q, k unit-norm over K, v ~ N(0, 1), g ~ U(-1, 0) per head, beta ~ U(0.05,
0.9999), do ~ N(0, 1). Median over 3 repeats of the mean of 10 calls after one warm-up
call (``benchmarks._harness.time_loop``); the op and local pass rows over ``--reps`` of
``--iters`` calls. The local pass at 10 calls moved between processes (1.23x and 1.41x the
op on one H100, 2026-12-07); at 100 calls, 5 repeats, it held within 0.03x over three rounds
(``benchmarks/results/gdn_h200.md``): use ``--iters 100 --reps 5 --rounds 3`` for it.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks import _harness as harness

SHAPES = ((1, 16384, 16, 128, 128), (8, 4096, 16, 128, 128))
SHAPE_340M = (1, 16384, 6, 256, 512)


def _options():
  from pallas_kernels import Launch
  L = Launch
  walk = [L(bv=16, warps=4, stages=3), L(bv=32, warps=4, stages=3),
          L(bv=64, warps=8, stages=3), L(bv=16, warps=4, stages=2)]
  return {
      "inv": [L(kd=128, warps=1, stages=1), L(kd=128, warps=2, stages=1),
              L(kd=128, warps=4, stages=1)],
      "wu": [L(bv=64, warps=4, stages=1), L(bv=128, warps=4, stages=1),
             L(bv=64, warps=2, stages=1)],
      "walk": walk,
      "out": [L(bv=64, warps=4, stages=2), L(bv=128, warps=4, stages=2),
              L(bv=128, warps=8, stages=2)],
      "vnew": [L(bv=64, warps=4, stages=2), L(bv=128, warps=4, stages=2),
               L(bv=128, warps=8, stages=2)],
      "dwalk": walk,
      "dqk": [L(kd=128, bv=64, warps=4, stages=1), L(kd=32, bv=64, warps=4, stages=1),
              L(kd=128, bv=64, warps=8, stages=1),
              L(kd=128, bv=128, warps=8, stages=1)],
      "dwy": [L(bv=64, warps=4, stages=1), L(bv=64, warps=8, stages=1),
              L(bv=128, warps=8, stages=1)],
  }


def _options_340m():
  """The launches tried at K = 256, V = 512 (the defaults there: walks V tile 32 with 4
  warps and 2 stages, ``gdn_dqk`` in K slices of 64; 3 stages at tile 32 overflow shared
  memory)."""
  from pallas_kernels import Launch as L
  walk = [L(bv=32, warps=4, stages=2), L(bv=16, warps=4, stages=3),
          L(bv=32, warps=8, stages=2), L(bv=16, warps=8, stages=2)]
  return {"walk": walk, "dwalk": walk,
          "dqk": [L(kd=64, bv=64, warps=4, stages=1), L(kd=128, bv=64, warps=4, stages=1),
                  L(kd=32, bv=64, warps=4, stages=1), L(kd=128, bv=64, warps=8, stages=1)]}


def save_states_times(shape, log):
  """The op's forward + backward (o live: :func:`benchmarks._harness.live_fwd_bwd`) with
  the chunk states kept and walked again. (Until 2026-12-07 this timed the vjp alone,
  which left the forward dead code unless the states were kept.)"""
  import functools

  import jax
  import jax.numpy as jnp
  from pallas_kernels.gated_delta import default_config
  from zeco_jax import chunk_gated_delta_rule
  B, T, H, K, V = shape
  q, k, v, g, beta, do = inputs(B, T, H, K, V, jnp.bfloat16)
  row = {"shape": f"B{B} T{T} H{H} K{K} V{V}"}
  for keep in (True, False):
    cfg = default_config("gpu", B, T, H, K, V, q.dtype).replace(save_states=keep)
    fb = harness.live_fwd_bwd(functools.partial(chunk_gated_delta_rule, kernel_config=cfg),
                              do)
    row[f"fwd+bwd ms, save_states={keep}"] = harness.time_loop(
        lambda: fb(q, k, v, g, beta), jax.block_until_ready, 10, 3, warmup=1)
  log(row)
  return row


def inputs(B, T, H, K, V, dtype, seed=0):
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (B, T, H, K)))
  k = unit(jax.random.normal(ks[1], (B, T, H, K)))
  v = jax.random.normal(ks[2], (B, T, H, V))
  g = -jax.random.uniform(ks[3], (B, T, H))
  beta = jax.random.uniform(ks[4], (B, T, H), minval=0.05, maxval=0.9999)
  do = jax.random.normal(ks[6], (B, T, H, V))
  c = lambda x: x.astype(dtype)
  return c(q), c(k), c(v), g, c(beta), c(do)


def sweep(shape, stages, log, options=None):
  """Each stage's kernel alone under each launch option (``options``, default
  :func:`_options`); the fastest per stage."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.gated_delta import chunk, default_config, walk
  B, T, H, K, V = shape
  q, k, v, g, beta, do = inputs(B, T, H, K, V, jnp.bfloat16)
  bf = beta.astype(jnp.float32)
  h0, dht = jnp.zeros((B, H, K, V)), jnp.ones((B, H, K, V))
  base = default_config("gpu", B, T, H, K, V, q.dtype)
  sc, C = K ** -0.5, 64
  kw = dict(chunk_size=C, config=base)
  Tv = jax.jit(lambda: chunk.inverse(k, g, bf, **kw))()
  w, u, kd, gc, qb = jax.jit(lambda: chunk.wu(Tv, k, v, g, bf, q=q, scale=sc, **kw))()
  eg = walk.chunk_decay(gc, C)
  h, vn, _ = jax.jit(lambda: walk.state_walk(w, u, kd, eg, h0, store_dtype=q.dtype, **kw))()
  vn2, dvl = jax.jit(lambda: chunk.vnew(q, k, g, w, u, h, do, scale=sc, **kw))()
  dH, dvn, _ = jax.jit(lambda: walk.grad_walk(qb, eg, w, kd, do, dvl, dht,
                                              store_dtype=q.dtype, **kw))()
  _, dk1, dw, _ = jax.jit(lambda: chunk.dqk(q, k, g, gc, vn2, dvn, do, h, dH, scale=sc,
                                            **kw))()
  fns = {
      "inv": lambda c: chunk.inverse(k, g, bf, chunk_size=C, config=c),
      "wu": lambda c: chunk.wu(Tv, k, v, g, bf, chunk_size=C, config=c),
      "walk": lambda c: walk.state_walk(w, u, kd, eg, h0, store_dtype=q.dtype, chunk_size=C,
                                        config=c),
      "out": lambda c: chunk.output(q, k, g, gc, vn, h, scale=sc, chunk_size=C, config=c),
      "vnew": lambda c: chunk.vnew(q, k, g, w, u, h, do, scale=sc, chunk_size=C, config=c),
      "dwalk": lambda c: walk.grad_walk(qb, eg, w, kd, do, dvl, dht, store_dtype=q.dtype,
                                        chunk_size=C, config=c),
      "dqk": lambda c: chunk.dqk(q, k, g, gc, vn2, dvn, do, h, dH, scale=sc, chunk_size=C,
                                 config=c),
      "dwy": lambda c: chunk.dwy(Tv, k, v, g, bf, dw, dvn, dk1, chunk_size=C, config=c),
  }
  rows = []
  for stage, launches in (options or _options()).items():
    if stage not in stages:
      continue
    for launch in launches:
      cfg = base.replace(**{stage: launch})
      f = jax.jit(lambda cfg=cfg, stage=stage: fns[stage](cfg))
      ms = harness.time_loop(f, jax.block_until_ready, 10, 3, warmup=1)
      rows.append({"shape": shape, "stage": stage, "launch": launch.set(), "ms": ms})
      log(rows[-1])
  return rows


def op_times(shape, log, timing=(10, 3)):
  """The op (default kernels) forward, forward + backward, and our GLA's forward + backward."""
  import jax
  import jax.numpy as jnp
  from zeco_jax import chunk_gated_delta_rule, chunk_gla
  B, T, H, K, V = shape
  q, k, v, g, beta, do = inputs(B, T, H, K, V, jnp.bfloat16)
  tl = lambda f: harness.time_loop(f, jax.block_until_ready, *timing, warmup=1)
  fwd = jax.jit(lambda *a: chunk_gated_delta_rule(*a)[0])
  fb = harness.live_fwd_bwd(chunk_gated_delta_rule, do)
  gk = jnp.broadcast_to(g[..., None], q.shape)
  fbg = harness.live_fwd_bwd(chunk_gla, do)
  row = {"shape": f"B{B} T{T} H{H} K{K} V{V}",
         "gdn fwd ms": tl(lambda: fwd(q, k, v, g, beta)),
         "gdn fwd+bwd ms": tl(lambda: fb(q, k, v, g, beta)),
         "gla fwd+bwd ms": tl(lambda: fbg(q, k, v, gk))}
  row["gdn / gla fwd+bwd"] = row["gdn fwd+bwd ms"] / row["gla fwd+bwd ms"]
  log(row)
  return row


def local_pass_times(log, variants, T=2048, profile=None, timing=(10, 3)):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from pallas_kernels.gated_delta import default_config
  from zeco_jax import chunk_gated_delta_rule, zeco_gated_delta_rule
  H, K, V = 16, 128, 128
  q, k, v, g, beta, do = inputs(1, T, H, K, V, jnp.bfloat16)
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  tl = lambda f: harness.time_loop(f, jax.block_until_ready, *timing, warmup=1)
  fb_chunk = harness.live_fwd_bwd(chunk_gated_delta_rule, do)
  fb_local = harness.live_fwd_bwd(lambda *a: zeco_gated_delta_rule(*a, mesh=mesh), do)
  row = {"shape": f"local pass B1 T{T} H{H} K{K} V{V}",
         "chunk fwd+bwd ms": tl(lambda: fb_chunk(q, k, v, g, beta)),
         "local pass fwd+bwd ms": tl(lambda: fb_local(q, k, v, g, beta))}
  row["local / chunk"] = row["local pass fwd+bwd ms"] / row["chunk fwd+bwd ms"]
  # Each variant is the widened pass's default configuration (V + K columns) changed
  # (``main``'s "kept" first: without a kernel_config the local pass walks its states again).
  for name, changes in variants.items():
    cfg = default_config("gpu", 1, T, H, K, V + K, jnp.bfloat16).replace(**changes)
    fb = harness.live_fwd_bwd(
        lambda *a, cfg=cfg: zeco_gated_delta_rule(*a, mesh=mesh, kernel_config=cfg), do)
    try:
      ms = tl(lambda: fb(q, k, v, g, beta))
    except Exception as e:      # a launch refused while tracing: reported, the rest run
      row[f"local pass {name} {changes}"] = f"{type(e).__name__}: {str(e)[:200]}"
      continue
    row[f"local pass {name} {changes} fwd+bwd ms"] = ms
    row[f"local {name} / chunk"] = ms / row["chunk fwd+bwd ms"]
  if profile:
    from benchmarks.delta_h200 import kernel_profile
    for name, fn in (("chunk", fb_chunk), ("local", fb_local)):
      row[f"{name} fwd+bwd kernels"] = kernel_profile(
          fn, (q, k, v, g, beta), os.path.join(profile, f"{name}_T{T}"), log)
  log(row)
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--heads-340m", action="store_true")
  ap.add_argument("--json", default=None)
  ap.add_argument("--profile", default=None, metavar="TRACE_DIR")
  ap.add_argument("--local-ab", nargs="+", default=(), metavar="NAME:CHANGES")
  ap.add_argument("--local-only", action="store_true",
                  help="only the local pass against the op on its tokens (no op rows)")
  ap.add_argument("--iters", type=int, default=10,
                  help="calls per timing of the op and the local pass rows")
  ap.add_argument("--reps", type=int, default=3, help="timings per row (the median)")
  ap.add_argument("--rounds", type=int, default=1, help="the local pass row this many times")
  args = ap.parse_args()
  variants = harness.ab_variants(args.local_ab, ap.error, first={"kept": {"save_states": True}},
                                 option="--local-ab")
  t0 = time.perf_counter()
  log = lambda row: print(json.dumps(row, default=str),
                          f"[{time.perf_counter() - t0:.0f} s]", flush=True)
  rows = []
  if args.sweep:
    rows += sweep(SHAPES[0], tuple(_options()), log)
    rows += sweep(SHAPES[1], ("walk", "dwalk"), log)
  if args.heads_340m:
    rows += sweep(SHAPE_340M, ("walk", "dwalk", "dqk"), log, _options_340m())
    rows.append(save_states_times(SHAPE_340M, log))
  timing = (args.iters, args.reps)
  if not args.local_only:
    rows.append(op_times(SHAPES[0], log, timing))
  for _ in range(args.rounds):
    rows.append(local_pass_times(log, variants, profile=args.profile, timing=timing))
  if not args.local_only:
    rows.append(op_times(SHAPES[1], log, timing))
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(rows, fh, indent=1, default=str)
    harness.write_environment(os.path.dirname(os.path.abspath(args.json)),
                              os.path.basename(args.json).rsplit(".", 1)[0])


if __name__ == "__main__":
  main()
