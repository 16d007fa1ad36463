"""Our delta-rule ops beside flash-linear-attention's, on one GPU: Gated DeltaNet
(``chunk_gated_delta_rule``) or Kimi Delta Attention (``chunk_kda``).

    python -m benchmarks.delta_h200 [--family gdn|kda] [--backend jax|pallas|auto]
        [--shapes 1,16384,16,128,128 8,4096,16,128,128] [--iters 100 --reps 5] [--no-fla]
        [--json out.json] [--profile TRACE_DIR] [--check B,T,H,K,V] [--set NAME=VALUE ...]

Results: benchmarks/results/gdn_h200.md and kda_h200.md. With --json, the environment
record goes beside it (``<json>.env.json``).

For each shape (B, T, H, K, V; bf16 q, k, v, beta, float32 g, l2-normalised keys, chunk
64; g per head for gdn, per key channel for kda: ``logsigmoid(N(0, 1))`` clipped at -5):
times jit(our op) with ``--backend`` (default "jax", the jnp path, whose rows are
labelled "jnp"; else labelled by the backend's name), forward and forward + backward (o and
its vjp of do for q, k, v, g, beta, o returned so that the forward runs whole as FLA's
does; until 2026-12-06 only the vjp was returned and XLA dropped our forward's kernels as
dead code: ``benchmarks/results/kda_h200.md``), then FLA 0.6.0's ``chunk_gated_delta_rule`` or
``chunk_kda`` on the same inputs (after its autotuning), and reports the relative
difference of o and of the gradients between the two (bf16 outputs, so ~1e-2 is
agreement). Median over ``reps`` of the mean of ``iters`` calls after one warm-up call
(``benchmarks._harness.time_loop``). 100 calls by default: what starts the first call's
kernels (about 0.3 ms for our ops on an H100, where their kernels leave the GPU no idle
time between them) is spread over them; at 10 calls it added 0.03 ms a call to ours
(``benchmarks/results/gdn_h200.md``, 2026-12-06). With ``--profile``, our forward and
forward + backward are traced (3 calls each, ``jax.profiler``) after their timing, and the
GPU time per kernel is printed and kept in the JSON
(``benchmarks.profile_step.summarize``): every kernel's share from the one compilation
the timing needed; FLA's forward and forward +
backward likewise (``torch.profiler``, CUDA activity, :func:`torch_kernel_profile`). JAX
and torch share the GPU in one process: XLA_PYTHON_CLIENT_PREALLOCATE=false is set before
jax starts. With ``--check``, first the op on ``--backend`` against the jnp path in float32
on the same device (:func:`float32_check`): the kernels' parity on the GPU, which the CPU
tests hold in the interpreter only (a launch's stages and warps are not in its program).
With ``--set``, the kernels run on the family's default launch with those changes.

With ``--ab NAME:CHANGES ...`` (CHANGES as ``--set``'s, comma-separated, e.g.
``one_warp:intra_warps=1,intra_kd=32``) one process compares launches instead: per shape
the default launch ("default") and each variant, forward (and with ``--ab-fb`` forward +
backward, o live) and FLA's forward (and forward + backward), timed in ``--ab-rounds``
alternating rounds, each variant's o against the default's and its ratios to FLA (the best
round of each); with ``--check`` the float32 check runs on the last variant's launch.
Figures move between processes more than most launch changes (FLA's KDA forward at B1
T16384 from 1.204 to 1.372 ms on H200s and H100s, ``benchmarks/results/kda_h200.md``), so
a launch is compared within one process.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks import _harness as harness  # noqa: E402
from benchmarks._harness import rel  # noqa: E402


def time_loop(fn, sync, iters, reps):
  return harness.time_loop(fn, sync, iters, reps, warmup=1)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--family", choices=("gdn", "kda"), default="gdn")
  ap.add_argument("--shapes", nargs="+", default=["1,16384,16,128,128", "8,4096,16,128,128"])
  ap.add_argument("--iters", type=int, default=100)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--no-fla", action="store_true")
  ap.add_argument("--backend", choices=("jax", "pallas", "auto"), default="jax")
  ap.add_argument("--json", default=None)
  ap.add_argument("--profile", default=None, metavar="TRACE_DIR")
  ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                  help="with --backend pallas: changes to the family's default KernelConfig "
                       "for each shape (KernelConfig.replace), e.g. dpairs_stages=1 "
                       "save_pairs=False")
  ap.add_argument("--check", default=None, metavar="B,T,H,K,V",
                  help="first, --backend against the jnp path in float32 on this device at "
                       "that shape (packed documents, an initial state, the final state)")
  ap.add_argument("--ab", nargs="+", default=None, metavar="NAME:CHANGES",
                  help="with --backend pallas: compare these launches with the default in "
                       "one process, e.g. one_warp:intra_warps=1,intra_kd=32")
  ap.add_argument("--ab-rounds", type=int, default=2)
  ap.add_argument("--ab-fb", action="store_true", help="--ab also times forward + backward")
  args = ap.parse_args()
  changes = harness.config_changes(args.set)
  if (changes or args.ab) and args.backend != "pallas":
    ap.error("--set and --ab change the kernels' launch: they need --backend pallas")
  if args.ab and changes:
    ap.error("--ab takes its changes per variant; drop --set")
  variants = (harness.ab_variants(args.ab, ap.error, first={"default": {}}, option="--ab")
              if args.ab else {})                               # {} without --ab

  import jax
  ours = functools.partial(op_of(args.family), backend=args.backend)
  tag = "jnp" if args.backend == "jax" else args.backend

  log = lambda *a: print(*a, flush=True)
  log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
  fla = None
  if not args.no_fla:
    import torch
    import fla as fla_pkg
    if args.family == "gdn":
      from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    else:
      from fla.ops.kda import chunk_kda as fla_op
    fla = (torch, fla_op)
    log(f"torch {torch.__version__}, fla {getattr(fla_pkg, '__version__', '?')}, "
        f"{torch.cuda.get_device_name()}")
  rows = []
  if args.check:
    check_changes = list(variants.values())[-1] if variants else changes
    rows.append(float32_check(args.family, args.backend, args.check, log, check_changes))
  if variants:
    rows += [ab_row(args, shape, variants, ours, fla, log) for shape in args.shapes]
  else:
    rows += [shape_row(args, shape, changes, ours, tag, fla, log) for shape in args.shapes]
  log(json.dumps(rows, indent=1))
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(rows, fh, indent=1)
    harness.write_environment(os.path.dirname(os.path.abspath(args.json)),
                              os.path.basename(args.json).rsplit(".", 1)[0])


def shape_row(args, shape, changes, ours, tag, fla, log) -> dict:
  """One shape of the normal run: our forward and forward + backward (o live) on the
  default launch with ``changes``, optionally profiled, then FLA's beside them with the
  outputs' and gradients' agreement."""
  import jax
  import jax.numpy as jnp
  name, (qn, kn, vn, gn, bn, don), (q, k, v, g, beta, do) = shape_inputs(args.family, shape)
  row = {"shape": name}
  op = ours
  if changes:
    row["kernel_config changes"] = changes
    op = functools.partial(ours, kernel_config=kernel_config(args.family, shape, changes))
  fwd = jax.jit(lambda *a: op(*a)[0])

  fb = harness.live_fwd_bwd(op, do)          # o returned: the forward runs whole
  sync = jax.block_until_ready
  t0 = time.perf_counter()
  o_j = sync(fwd(q, k, v, g, beta))
  grads_j = sync(fb(q, k, v, g, beta))[1]
  log(f"{name} {tag}: compiled + first call {time.perf_counter() - t0:.1f} s")
  row[f"{tag} fwd ms"] = time_loop(lambda: fwd(q, k, v, g, beta), sync, args.iters,
                                   args.reps)
  row[f"{tag} fwd+bwd ms"] = time_loop(lambda: fb(q, k, v, g, beta), sync, args.iters,
                                       args.reps)
  log(f"{name} {tag}: fwd {row[f'{tag} fwd ms']:.3f} ms, fwd+bwd "
      f"{row[f'{tag} fwd+bwd ms']:.3f} ms")
  if args.profile:
    for label, fn in (("fwd", fwd), ("fwd+bwd", fb)):
      folder = os.path.join(args.profile, f"{name}_{label}".replace(" ", "_"))
      row[f"{tag} {label} kernels"] = kernel_profile(fn, (q, k, v, g, beta), folder, log)
  if fla is not None:
    torch, fla_fn = fla
    ffwd, ffb = fla_calls(torch, fla_fn, qn, kn, vn, gn, bn, don)
    t0 = time.perf_counter()
    with torch.no_grad():
      o_f = ffwd()
    torch.cuda.synchronize()
    log(f"{name} fla: first forward (autotune) {time.perf_counter() - t0:.1f} s")
    tsync = harness.torch_sync
    with torch.no_grad():
      row["fla fwd ms"] = time_loop(ffwd, tsync, args.iters, args.reps)
      if args.profile:
        row["fla fwd kernels"] = torch_kernel_profile(torch, ffwd, log)
    to_np = lambda x: x.detach().float().cpu().numpy()
    row["rel o (ours vs fla)"] = rel(o_j.astype(jnp.float32), to_np(o_f))
    row[f"{tag} / fla fwd"] = row[f"{tag} fwd ms"] / row["fla fwd ms"]
    grads_f = fla_backward(ffb, row)
    if grads_f is None:
      log(f"{name} fla backward: {row['fla fwd+bwd']}")
    else:
      row["fla fwd+bwd ms"] = time_loop(ffb, tsync, args.iters, args.reps)
      if args.profile:
        row["fla fwd+bwd kernels"] = torch_kernel_profile(torch, ffb, log)
      for nm, a, b in zip("q k v g beta".split(), grads_j, grads_f):
        row[f"rel d{nm}"] = rel(a.astype(jnp.float32), to_np(b))
      row[f"{tag} / fla fwd+bwd"] = row[f"{tag} fwd+bwd ms"] / row["fla fwd+bwd ms"]
    agreement = {k2: round(v2, 5) for k2, v2 in row.items() if k2.startswith("rel")}
    fb_ms = row.get("fla fwd+bwd ms")
    log(f"{name} fla: fwd {row['fla fwd ms']:.3f} ms"
        + (f", fwd+bwd {fb_ms:.3f} ms" if fb_ms is not None else "")
        + f"; agreement {json.dumps(agreement)}")
  return row


def ab_row(args, shape, variants, ours, fla, log) -> dict:
  """One shape of ``--ab``: each launch's forward (and forward + backward) and FLA's
  likewise, ``args.ab_rounds`` alternating rounds; o of each against the default's, and
  each launch's time over FLA's (the best round of each)."""
  import jax
  import jax.numpy as jnp
  name, (qn, kn, vn, gn, bn, don), (q, k, v, g, beta, do) = shape_inputs(args.family, shape)
  a = (q, k, v, g, beta)
  sync = jax.block_until_ready
  row = {"shape": name, "ab": {}}
  configs = {vname: kernel_config(args.family, shape, ch) for vname, ch in variants.items()}
  timed, o_default = [], None          # (label, the call, its sync, the dict its times go to, key)
  for vname, ch in variants.items():
    op = functools.partial(ours, kernel_config=configs[vname])
    fwd = jax.jit(lambda *x, op=op: op(*x)[0])
    t0 = time.perf_counter()
    o = sync(fwd(*a)).astype(jnp.float32)
    o_default = o if o_default is None else o_default
    out = row["ab"][vname] = {"changes": ch, "rel o vs default": rel(o, o_default)}
    timed.append((f"{vname} fwd", lambda fwd=fwd: fwd(*a), sync, out, "fwd ms"))
    if args.ab_fb:
      fb = harness.live_fwd_bwd(op, do)
      sync(fb(*a))
      timed.append((f"{vname} fwd+bwd", lambda fb=fb: fb(*a), sync, out, "fwd+bwd ms"))
    log(f"{name} {vname}: compiled + first calls {time.perf_counter() - t0:.1f} s")
  if fla is not None:
    torch, fla_fn = fla
    ffwd, ffb = fla_calls(torch, fla_fn, qn, kn, vn, gn, bn, don)

    def fla_fwd():
      with torch.no_grad():
        return ffwd()

    fla_fwd()
    torch.cuda.synchronize()
    timed.append(("fla fwd", fla_fwd, harness.torch_sync, row, "fla fwd ms"))
    if args.ab_fb and fla_backward(ffb, row) is not None:
      torch.cuda.synchronize()
      timed.append(("fla fwd+bwd", ffb, harness.torch_sync, row, "fla fwd+bwd ms"))
  for r in range(args.ab_rounds):
    last = {}
    for label, fn, fsync, out, key in timed:
      ms = time_loop(fn, fsync, args.iters, args.reps)
      out.setdefault(key, []).append(ms)
      last[label] = round(ms, 4)
    log(f"{name} round {r}: {json.dumps(last)}")
  for out in row["ab"].values():      # each launch's ratio to FLA from the same rounds
    for key in ("fwd", "fwd+bwd"):
      if f"{key} ms" in out and f"fla {key} ms" in row:
        out[f"/ fla {key}"] = min(out[f"{key} ms"]) / min(row[f"fla {key} ms"])
  return row


def shape_inputs(family, shape):
  """``(name, numpy inputs, device inputs)`` of one ``--shapes`` item: :func:`inputs`' q,
  k, v, g, beta, do (seed 0) and the same on the device (g float32, the rest bf16)."""
  import jax.numpy as jnp
  B, T, H, K, V = map(int, shape.split(","))
  host = inputs(family, 0, B, T, H, K, V)
  qn, kn, vn, gn, bn, don = host
  q, k, v, beta, do = (jnp.asarray(x, jnp.bfloat16) for x in (qn, kn, vn, bn, don))
  return f"{family} B{B} T{T} H{H} K{K} V{V}", host, (q, k, v, jnp.asarray(gn), beta, do)


def fla_calls(torch, fla_fn, qn, kn, vn, gn, bn, don):
  """``(forward, forward_backward)``: FLA's op on the GPU on :func:`inputs`' numpy arrays
  (q, k, v, beta and do in bf16, g float32, each a leaf needing its gradient); the first
  returns o, the second the gradients of q, k, v, g, beta for the cotangent do."""
  tq, tk, tv, tb, tdo = (torch.tensor(x, device="cuda").to(torch.bfloat16)
                         for x in (qn, kn, vn, bn, don))
  tg = torch.tensor(gn, device="cuda")
  for x in (tq, tk, tv, tg, tb):
    x.requires_grad_(True)

  def forward():
    return fla_fn(tq, tk, tv, tg, tb)[0]

  def forward_backward():
    return torch.autograd.grad(forward(), (tq, tk, tv, tg, tb), tdo)

  return forward, forward_backward


def fla_backward(ffb, row):
  """FLA's gradients from ``ffb()``, or None where FLA refuses its backward: FLA 0.6.0
  refuses its GDN backward on Hopper with Triton 3.4 <= v < 3.7.1 (its issue #640: wrong
  gradients), and then ``row["fla fwd+bwd"]`` says so and only the forward is compared."""
  try:
    return ffb()
  except RuntimeError as e:
    row["fla fwd+bwd"] = f"refused: {str(e).splitlines()[0]}"
    return None


def op_of(family):
  """Our op for ``--family``."""
  from zeco_jax import chunk_gated_delta_rule, chunk_kda
  return {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}[family]


def sp_op_of(family):
  """Our sequence-parallel op for ``--family``."""
  from zeco_jax import zeco_gated_delta_rule, zeco_kda
  return {"gdn": zeco_gated_delta_rule, "kda": zeco_kda}[family]


def inputs(family, seed, B, T, H, K, V):
  """float32 numpy ``q, k, v, g, beta, do`` (:func:`benchmarks._harness.gdn_inputs`); for
  kda g per key channel, ``logsigmoid(N(0, 1))`` clipped at -5 (generator ``seed + 1``)."""
  import numpy as np
  qn, kn, vn, gn, bn, don = harness.gdn_inputs(seed, B, T, H, K, V)
  if family == "kda":
    z = np.random.default_rng(seed + 1).standard_normal((B, T, H, K))
    gn = np.maximum(-np.logaddexp(0.0, -z), -5.0).astype(np.float32)
  return qn, kn, vn, gn, bn, don


def kernel_config(family, shape, changes, dtype="bfloat16"):
  """The family's default KernelConfig for this device, ``shape`` and ``dtype`` (what
  ``backend="pallas"`` would pick), with ``changes``."""
  import jax
  import jax.numpy as jnp
  import pallas_kernels
  B, T, H, K, V = map(int, shape.split(","))
  dev = jax.devices()[0]
  config = pallas_kernels.family_default_config(
      {"gdn": "gated_delta", "kda": "kda"}[family], dev.platform, B, T, H, K, V,
      jnp.dtype(dtype), sm_count=getattr(dev, "core_count", None))
  return config.replace(**changes)


def float32_check(family, backend, shape, log, changes=None):
  """The op on ``backend`` (its kernels' launch with ``changes``, as ``--set``) against the
  jnp path, both in float32 on this device: o, the
  final state and every gradient (of q, k, v, g, beta and the initial state, for random
  cotangents of o and the final state), with packed documents (segment starts at 0, T/3,
  T/3 + 1, 2T/3) and a random initial state; their relative differences (a row). Then the
  same for the sequence-parallel op on ``backend`` (its default launch) over a one-device
  mesh: one rank's local pass, whose widened state's K columns give the fix-up rows and
  the segment transition that carry the initial state into o and the final state
  (``local rel ...``)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  op = op_of(family)
  B, T, H, K, V = map(int, shape.split(","))
  qn, kn, vn, gn, bn, don = inputs(family, 5, B, T, H, K, V)
  rng = np.random.default_rng(7)
  h0 = jnp.asarray(0.1 * rng.standard_normal((B, H, K, V)), jnp.float32)
  dht = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
  starts = np.isin(np.arange(T), [0, T // 3, T // 3 + 1, 2 * T // 3])
  seg = jnp.asarray(np.broadcast_to(np.cumsum(starts), (B, T)).astype(np.int32))
  arrays = [jnp.asarray(x, jnp.float32) for x in (qn, kn, vn, gn, bn)] + [h0]
  do = jnp.asarray(don, jnp.float32)

  kw = {}
  if changes:
    kw["kernel_config"] = kernel_config(family, shape, changes, "float32")

  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))

  @functools.partial(jax.jit, static_argnums=0)
  def run(which, arrays, seg, do, dht):
    def f(q, k, v, g, beta, h):
      if which == "local":
        return sp_op_of(family)(q, k, v, g, beta, mesh=mesh, initial_state=h,
                                output_final_state=True, segment_ids=seg, backend=backend)
      return op(q, k, v, g, beta, initial_state=h, output_final_state=True, segment_ids=seg,
                backend=which, **(kw if which != "jax" else {}))
    (o, ht), vjp = jax.vjp(f, *arrays)
    return [o, ht, *vjp((do, dht))]

  names = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
  got, ref, local = (run(which, arrays, seg, do, dht) for which in (backend, "jax", "local"))
  row = {"check": f"{family} {backend} against jnp, float32, B{B} T{T} H{H} K{K} V{V}, "
                  "documents, initial state", "kernel_config changes": changes or {},
         **{f"rel {n}": rel(np.asarray(a), np.asarray(b)) for n, a, b in zip(names, got, ref)},
         **{f"local rel {n}": rel(np.asarray(a), np.asarray(b))
            for n, a, b in zip(names, local, ref)}}
  log(json.dumps(row))
  return row


def kernel_profile(fn, args, trace_dir, log, calls=3):
  """GPU time per kernel of ``calls`` calls of ``fn(*args)`` (already compiled), per call,
  and the GPU span per call (first kernel's start to last kernel's end over the calls,
  issued back to back, divided by ``calls``): the span less the kernel time is the GPU's
  idle time between kernels."""
  from benchmarks import profile_step
  profile_step.profile_steps(fn, lambda i, out: args, calls, trace_dir)
  summary = profile_step.summarize(trace_dir, calls, top=30)
  log(profile_step.format_summary(summary))
  return {"kernel ms": summary["kernel_ms_per_step"],
          "gpu span ms": summary["gpu_span_ms_per_step"],
          "by kernel": [{"name": r["name"], "ms": r["ms_per_step"], "calls": r["calls_per_step"]}
                        for r in summary["top"]]}


def torch_kernel_profile(torch, fn, log, calls=3):
  """GPU time per kernel of ``calls`` calls of ``fn()`` (warmed up), ms per call, largest
  first: ``{"kernel ms": total, "gpu span ms", "by kernel": [{"name", "ms", "calls"}]}``
  as :func:`kernel_profile` (the span from the CUDA events' time ranges; None where torch
  gives none). A failure is logged and returned, not raised (the timings above are
  kept)."""
  try:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      for _ in range(calls):
        fn()
      torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
      us = getattr(e, "self_device_time_total", None)
      us = getattr(e, "self_cuda_time_total", 0) if us is None else us
      if us > 0:
        rows.append({"name": e.key, "ms": us / 1e3 / calls, "calls": e.count / calls})
    rows.sort(key=lambda r: -r["ms"])
    out = {"kernel ms": sum(r["ms"] for r in rows), "gpu span ms": _torch_span_ms(prof, calls),
           "by kernel": rows[:30]}
    log(json.dumps(out, indent=1))
    return out
  except Exception as e:  # noqa: BLE001 -- a profile is optional; keep the run's timings
    log(f"torch profile failed: {e!r}")
    return {"error": repr(e)}


def _torch_span_ms(prof, calls):
  """First CUDA event's start to last one's end, ms per call; None if there are none."""
  try:
    from torch.autograd import DeviceType
    ranges = [e.time_range for e in prof.events() if e.device_type == DeviceType.CUDA]
  except Exception:  # noqa: BLE001 -- optional, as the profile
    return None
  if not ranges:
    return None
  return (max(r.end for r in ranges) - min(r.start for r in ranges)) / 1e3 / calls


if __name__ == "__main__":
  main()
