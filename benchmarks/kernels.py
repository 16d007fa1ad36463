"""Pallas chunked-GLA kernels vs the plain-jnp chunk path vs flash-linear-attention.

One script, run on one GPU: it checks correctness on the GPU first
(float32 with strong decay against the jnp path; bf16 against FLA), then times, on
identical bf16 inputs with per-dim decay logsigmoid(x)/16, for each shape: forward and
forward+backward of our Pallas path, our jnp chunk path and FLA's ``chunk_gla``.

Timing (``benchmarks._harness.time_loop``): each number is the median over ``--reps`` repeats
of the mean time of ``--iters`` back-to-back calls after warm-up (device synchronised at the
end of each repeat). Forward + backward returns o too, so the forward runs whole. FLA is
also timed with ``triton.testing.do_bench`` (median).
Peak memory: for JAX, the compiled program's arguments + outputs + temporaries
(``memory_analysis``); for FLA, ``torch.cuda.max_memory_allocated`` over the call with the
same inputs and outputs resident.

    python -m benchmarks.kernels --out DIR              # on the H200 (results: kernels_h200.md)
    python -m benchmarks.kernels --check-only           # correctness only
    python -m benchmarks.kernels --smoke --no-fla       # tiny shapes, any machine

Writes kernels.json, kernels.log and kernels.env.json to --out (default $OUT, else
runs/benchmarks/kernels).

Kernel configurations are passed explicitly: every Pallas timing and check runs with
``pallas_kernels.default_config`` for the device's platform and the shape, changed by the
JSON overrides of ``--base-tune`` (all of them) and ``--tune`` / ``--stage-tune`` /
``--stage-sweep`` / ``--check-tune`` (one variant each), whose keys are the flat names of
``pallas_kernels.KernelConfig`` (``cfg.flat()``; ``cfg.replace`` takes them): e.g.
``--tune '[{"state_bv": 64}]'``.

FLA's first call autotunes its Triton kernels for minutes per shape. To hide that, run FLA
in a second process (``--no-pallas --ready-file R --go-file G --compare-outputs D``) beside
ours (``--no-fla --wait-file R --save-outputs D``; ``touch G`` when ours exits): FLA tunes
while ours starts up, ours checks and times while FLA waits, then FLA times. (FLA's
autotuning times its kernels, so nothing of ours runs on the GPU beside it.)
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from benchmarks import _harness as harness  # noqa: E402
from benchmarks._harness import rel  # noqa: E402
from zeco_jax import chunk_gla  # noqa: E402
from zeco_jax.ops.gla import chunked  # noqa: E402
from zeco_jax.runtime import target  # noqa: E402

SHAPES = harness.GLA_SHAPES     # (name, B, T, H, K, V)


BASE = {}     # --base-tune: KernelConfig overrides applied to every configuration


def config_for(B, T, H, K, V, overrides=None, dtype=jnp.bfloat16):
  """The default kernel configuration for this device and shape, with ``--base-tune`` and
  ``overrides`` (KernelConfig field names) applied."""
  found = target.target_of()
  base = pallas_kernels.default_config(found.platform, B, T, H, K, V, dtype,
                                       sm_count=found.num_cores)
  return base.replace(**{**BASE, **(overrides or {})})   # ValueError naming unknown fields


make_inputs = harness.gla_inputs


def jax_fns(backend, scale, config=None):
  def fwd(q, k, v, g):
    return chunk_gla(q, k, v, g, scale=scale, backend=backend, kernel_config=config)[0]

  def fwd_bwd(q, k, v, g, do):
    # o is returned so that the forward runs whole, as FLA's (eager) does: vjp(do) alone
    # needs only the backward's residuals, and XLA drops the forward's output kernel and
    # (unless the states are kept) its state walk as dead code.
    o, vjp = jax.vjp(fwd, q, k, v, g)
    return o, vjp(do)

  return jax.jit(fwd), jax.jit(fwd_bwd)


QUIET = {"file": None}     # --wait-file: time only once the other process is idle


def wait_quiet():
  """Blocks (once) until QUIET["file"] exists, or QUIET["limit_s"] has passed."""
  path, t0, limit_s = QUIET["file"], time.perf_counter(), QUIET.get("limit_s", 300)
  while path and not os.path.exists(path) and time.perf_counter() - t0 < limit_s:
    time.sleep(1)
  QUIET["waited_s"] = QUIET.get("waited_s", 0) + time.perf_counter() - t0
  QUIET["file"] = None


def time_loop(fn, sync, iters, reps):
  """The harness's loop (two warm-up calls, median of ``reps`` means of ``iters`` calls),
  once the other process is idle (``--wait-file``)."""
  wait_quiet()
  return harness.time_loop(fn, sync, iters, reps)


def compiled(jfn, *args):
  """AOT-compiles once: the same executable is timed and its memory is read."""
  return jfn.lower(*args).compile()


def jax_peak(exe):
  try:
    m = exe.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes) / 2**30
  except Exception:  # noqa: BLE001
    return float("nan")


# Which stages a KernelConfig field changes (--stage-sweep times only those).
STAGE_OF_KEY = {"cumsum": ("chunk_cumsum", "chunk_cumsum_fold", "chunk_decays"),
                "decays": ("chunk_decays",),
                "state": ("folded_state_pass", "state_pass", "state_grad_pass", "state_passes",
                          "folded_state_grad_pass"),
                "scores": ("scores", "scores_off"),
                "diag": ("scores", "scores_diag"),
                "out": ("output",), "dv": ("dv",), "dqdk_diag": ("dqdk_diag",),
                "dqdk": ("dqdk",)}


def stages_of(tune):
  names = set()
  for key in tune:
    prefix = max((p for p in STAGE_OF_KEY if key.startswith(p + "_")), key=len, default=None)
    names.update(STAGE_OF_KEY[prefix] if prefix else ())
  return names


def stage_inputs(q, k, v, g, do, scale, config):
  """The intermediates each stage reads, computed once under ``config``."""
  from pallas_kernels.gla import grads, intra, state
  kw = dict(chunk_size=64, config=config)
  B, T, H, K = q.shape
  V = v.shape[-1]
  h0 = jnp.zeros((B, H, K, V), jnp.float32)
  g = g if g.ndim == 4 else jnp.broadcast_to(g[..., None], q.shape).astype(jnp.float32)
  d = jax.jit(lambda g, q, k: state.chunk_decays(g, q, k, **kw))(g, q, k)
  p, s = jax.jit(lambda g: state.chunk_cumsum(g, **kw))(g)
  _, _, qd, dl = jax.jit(lambda g, q: state.chunk_cumsum_folded(g, q, scale=scale, **kw))(g, q)
  h, _ = jax.jit(lambda k, v, p, s: state.state_pass(k, v, p, s, h0, **kw))(k, v, p, s)
  dH, _ = jax.jit(lambda q, do, p: state.state_grad_pass(q, do, p, h0, scale=scale,
                                                         **kw))(q, do, p)
  A = jax.jit(lambda d, q, k, g: intra.scores(d, q, k, g, **kw))(d, q, k, g)
  diag = jax.jit(lambda q, k, g, do, v, p: grads.diag_grads(q, k, g, do, v, p, scale=scale,
                                                            **kw))(q, k, g, do, v, p)
  return dict(h0=h0, g=g, d=d, p=p, s=s, qd=qd, dl=dl, h=h, dH=dH, A=A, diag=diag)


def stage_times(q, k, v, g, do, scale, iters, reps, config, *, names=None, pre=None):
  """Each Pallas kernel alone under ``config``, on the benchmark inputs (where the time
  goes); ``names``: only these stages; ``pre``: stage_inputs computed already. The
  forward runs chunk_decays, folded_state_pass, scores (with ``diag_dots`` one launch of
  gla_scores, diagonal included; else scores_off, then scores_diag in place: timed
  alone, scores_diag also copies A; scores_off is the off-diagonal kernel alone either
  way) and output; the backward chunk_cumsum_fold and folded_state_grad_pass (with
  ``save_states``; else chunk_cumsum and state_passes, state_pass and state_grad_pass in
  one launch), dv, dqdk_diag and dqdk."""
  from pallas_kernels.gla import grads, intra, state
  kw = dict(chunk_size=64, config=config)
  p = pre or stage_inputs(q, k, v, g, do, scale, config)
  h0, g, d, h, dH, A, diag, ps, ss, qd, dl = (
      p[n] for n in ("h0", "g", "d", "h", "dH", "A", "diag", "p", "s", "qd", "dl"))
  stages = {
      "chunk_decays": (lambda g, q, k: state.chunk_decays(g, q, k, **kw), (g, q, k)),
      "folded_state_pass": (lambda kd, v, dl: state.folded_state_pass(kd, v, dl, h0, **kw),
                            (d.kd, v, d.dl)),
      "scores": (lambda q, k, g, d: intra.scores(d, q, k, g, **kw), (q, k, g, d)),
      "scores_off": (lambda d: intra.scores_off(d, **kw), (d,)),
      "scores_diag": (lambda q, k, g, A: intra.scores_diag(q, k, g, A, **kw), (q, k, g, A)),
      "output": (lambda qp, v, h, A, t: intra.output(qp, v, h, A, t, scale=scale, **kw),
                 (d.qp, v, h, A, d.tots)),
      "chunk_cumsum": (lambda g: state.chunk_cumsum(g, **kw), (g,)),
      "chunk_cumsum_fold": (lambda g, q: state.chunk_cumsum_folded(g, q, scale=scale, **kw),
                            (g, q)),
      "folded_state_grad_pass": (
          lambda qd, do, dl: state.folded_state_grad_pass(qd, do, dl, h0, **kw), (qd, do, dl)),
      "state_pass": (lambda k, v, p, s: state.state_pass(k, v, p, s, h0, **kw), (k, v, ps, ss)),
      "state_grad_pass": (lambda q, do, p: state.state_grad_pass(q, do, p, h0, scale=scale,
                                                                 **kw), (q, do, ps)),
      "state_passes": (lambda q, k, v, do, p, s: state.both_passes(q, k, v, do, p, s, h0, h0,
                                                                   scale=scale, **kw),
                       (q, k, v, do, ps, ss)),
      "dv": (lambda k, p, s, do, A, dH: grads.dv(k, p, s, do, A, dH, scale=scale, **kw),
             (k, ps, ss, do, A, dH)),
      "dqdk_diag": (lambda q, k, g, do, v, p: grads.diag_grads(q, k, g, do, v, p, scale=scale,
                                                               **kw), (q, k, g, do, v, ps)),
      "dqdk": (lambda *a: grads.dqdk(*a[:9], scale=scale, diag=a[9], **kw),
               (q, k, v, g, ps, ss, do, h, dH, diag)),
  }
  out = {}
  for name, (fn, args) in stages.items():
    if names is not None and name not in names:
      continue
    f = jax.jit(fn)
    out[name] = time_loop(lambda: f(*args), jax.block_until_ready, iters, reps)
  return out


def fla_stage_times(torch, qn, kn, vn, gn, don, scale, iters, reps):
  """flash-linear-attention's own kernels one by one (its chunk_gla_fwd / _bwd pieces)."""
  from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
  from fla.ops.gla import chunk as fc
  from fla.ops.utils.constant import RCP_LN2
  from fla.ops.utils.cumsum import chunk_local_cumsum
  dev = "cuda"
  q, k, v, do = (torch.tensor(x, device=dev).to(torch.bfloat16) for x in (qn, kn, vn, don))
  g = torch.tensor(gn, device=dev)
  C = 64
  gc = chunk_local_cumsum(g, C, scale=RCP_LN2)
  h, _ = chunk_fwd_h(k=k, v=v, gk=gc, h0=None, output_final_state=False, chunk_size=C)
  A = fc.chunk_gla_fwd_intra_gk(q=q, k=k, g=gc, scale=scale, chunk_size=C)
  dh, _ = chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=None, scale=scale, gk=gc,
                       chunk_size=C, states_in_fp32=True)
  dA = fc.chunk_gla_bwd_dA(v=v, do=do, scale=scale, chunk_size=C)
  dq, dk = fc.chunk_gla_bwd_dqk_intra(q=q, k=k, g=gc, dA=dA, chunk_size=C)
  stages = {
      "cumsum": lambda: chunk_local_cumsum(g, C, scale=RCP_LN2),
      "fwd_h": lambda: chunk_fwd_h(k=k, v=v, gk=gc, h0=None, output_final_state=False,
                                   chunk_size=C),
      "intra A": lambda: fc.chunk_gla_fwd_intra_gk(q=q, k=k, g=gc, scale=scale, chunk_size=C),
      "o": lambda: fc.chunk_gla_fwd_o_gk(q=q, v=v, g=gc, A=A, h=h, scale=scale, chunk_size=C),
      "bwd_dh": lambda: chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=None, scale=scale,
                                     gk=gc, chunk_size=C, states_in_fp32=True),
      "dA": lambda: fc.chunk_gla_bwd_dA(v=v, do=do, scale=scale, chunk_size=C),
      "dv": lambda: fc.chunk_gla_bwd_dv(k=k, g=gc, A=A, do=do, dh=dh, chunk_size=C),
      "dqk_intra": lambda: fc.chunk_gla_bwd_dqk_intra(q=q, k=k, g=gc, dA=dA, chunk_size=C),
      "dqkg": lambda: fc.chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=h, g=gc, do=do, dh=dh, dq=dq, dk=dk,
                                            scale=scale, chunk_size=C),
  }
  return {n: time_loop(fn, harness.torch_sync, iters, reps) for n, fn in stages.items()}


def check_truth64(log):
  """float32 strong decay, Pallas and the jnp path each against the float64 truth
  (``zeco_jax.ops.gla.reference.gla_float64``, numpy on the host)."""
  B, T, H, K, V = 1, 256, 2, 64, 128
  q, k, v, g, do = make_inputs(1, B, T, H, K, V, strong=True)
  dht = np.random.default_rng(3).standard_normal((B, H, K, V)).astype(np.float32)
  h0 = np.zeros((B, H, K, V), np.float32)
  _, _, grads64 = harness.gla_float64(q, k, v, g, h0, do, dht, K ** -0.5)
  truth = [grads64[n] for n in "qkvg"]
  kw = dict(scale=K ** -0.5, initial_state=jnp.asarray(h0), chunk_size=64)
  a = [jnp.asarray(x) for x in (q, k, v, g, do)]
  config = config_for(B, T, H, K, V, dtype=jnp.float32)
  for label, mod, extra in (("pallas", pallas_kernels.backend("gla", config.platform),
                             dict(config=config)), ("jnp", chunked, {})):
    r = jax.jit(lambda *xs: mod.bwd(*xs, **kw, **extra))(*a, jnp.asarray(dht))
    log(f"truth64 check {label}: " + " ".join(
        f"{n}={rel(x, t):.1e}" for n, x, t in zip(("dq", "dk", "dv", "dg"), r, truth)))


_REFERENCES = {}     # check_gpu: the jnp path's results per shape, shared by every config


def check_gpu(log, overrides=None):
  """float32: Pallas (default config with ``overrides``) vs the jnp chunk path (HIGHEST),
  fwd and all grads, at three shapes with the strong decay (the diagonal blocks' exact
  loops) and one with the benchmark's mild decay (their dots). The jnp path's results are
  computed once per case and reused for every ``--check-tune`` configuration."""
  ok = True
  for (B, T, H, K, V), strong in [((2, 256, 2, 64, 128), True), ((1, 512, 2, 128, 256), True),
                                  ((1, 192, 3, 256, 64), True), ((1, 512, 2, 128, 256), False)]:
    config = config_for(B, T, H, K, V, overrides, dtype=jnp.float32)
    be = pallas_kernels.backend("gla", config.platform)
    q, k, v, g, do = make_inputs(1, B, T, H, K, V, strong=strong)
    rng = np.random.default_rng(2)
    h0 = jnp.asarray(rng.standard_normal((B, H, K, V), np.float32))
    dht = jnp.asarray(rng.standard_normal((B, H, K, V), np.float32))
    kw = dict(scale=K ** -0.5, initial_state=h0, chunk_size=64)
    q, k, v, g, do = map(jnp.asarray, (q, k, v, g, do))

    def op_vjp(backend):     # chunk_gla's custom_vjp: the backward with A kept
      def f(q, k, v, g, h0):
        return chunk_gla(q, k, v, g, scale=K ** -0.5, initial_state=h0, output_final_state=True,
                         backend=backend, kernel_config=config if backend == "pallas" else None)
      return jax.jit(lambda *a: jax.vjp(f, *a)[1]((do, dht)))(q, k, v, g, h0)

    o1, s1 = jax.jit(lambda *a: be.fwd(*a, **kw, config=config))(q, k, v, g)
    r1 = jax.jit(lambda *a: be.bwd(*a, **kw, config=config))(q, k, v, g, do, dht)
    if (B, T, H, K, V, strong) not in _REFERENCES:
      _REFERENCES[B, T, H, K, V, strong] = (
          jax.jit(lambda *a: chunked.fwd(*a, **kw))(q, k, v, g),
          jax.jit(lambda *a: chunked.bwd(*a, **kw))(q, k, v, g, do, dht), op_vjp("jax"))
    (o2, s2), r2, op_ref = _REFERENCES[B, T, H, K, V, strong]
    errs = {"o": rel(o1, o2), "ht": rel(s1, s2)}
    errs.update({n: rel(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), r1, r2)})
    errs.update({f"op {n}": rel(a, b) for n, a, b in zip(
        ("dq", "dk", "dv", "dg", "dh0"), op_vjp("pallas"), op_ref)})
    good = errs["o"] <= 1e-5 and errs["ht"] <= 1e-5 and all(
        e <= 1e-4 for n, e in errs.items() if n not in ("o", "ht"))
    good = good and all(np.isfinite(list(errs.values())))
    ok &= good
    log(f"check f32 {'strong' if strong else 'mild'} decay B{B} T{T} H{H} K{K} V{V}: "
        + " ".join(f"{n}={e:.1e}" for n, e in errs.items()) + ("  OK" if good else "  FAIL"))
  return ok


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None, help="results folder (default $OUT, else "
                  "runs/benchmarks/kernels)")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--check-only", action="store_true")
  ap.add_argument("--skip-checks", action="store_true", help="time only (no GPU checks)")
  ap.add_argument("--no-fla", action="store_true")
  ap.add_argument("--no-jnp", action="store_true")
  ap.add_argument("--stages", action="store_true", help="also time each Pallas kernel alone")
  ap.add_argument("--tune", default="",
                  help="JSON list of KernelConfig overrides to time (Pallas only)")
  ap.add_argument("--base-tune", default="",
                  help="JSON KernelConfig overrides applied to every configuration")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU run of the script)")
  ap.add_argument("--fla-stages", action="store_true", help="also time FLA's kernels one by one")
  ap.add_argument("--stage-tune", default="[{}]",
                  help="JSON list of KernelConfig overrides under which --stages times each "
                  "kernel")
  ap.add_argument("--stage-sweep", default="",
                  help="JSON list of KernelConfig overrides; each times only the stages its "
                  "keys change")
  ap.add_argument("--only", default="", help="comma-separated shape indices to run (0, 1)")
  ap.add_argument("--no-pallas", action="store_true", help="skip the whole-op Pallas timings")
  ap.add_argument("--check-tune", default="[{}]",
                  help="JSON list of KernelConfig overrides to check")
  ap.add_argument("--wait-file", default="", help="time nothing until this file exists")
  ap.add_argument("--wait-limit", type=float, default=300, help="seconds --wait-file waits at most")
  ap.add_argument("--save-outputs", default="", help="folder: our bf16 forward outputs (.npy)")
  ap.add_argument("--compare-outputs", default="",
                  help="folder of --save-outputs to compare FLA with")
  ap.add_argument("--ready-file", default="", help="FLA: touch after the first shape's warm-up")
  ap.add_argument("--go-file", default="", help="FLA: then wait for this file before timing")
  ap.add_argument("--triton-cache", default="",
                  help="Triton cache folder (FLA's compiled kernels and autotune results)")
  args = ap.parse_args()
  args.out = harness.out_dir(args.out, "kernels")
  harness.write_environment(args.out, "kernels")
  lines = []
  if args.base_tune:
    BASE.update(json.loads(args.base_tune))
  configs = {}
  shapes = [("smoke B1 T256 H2 K64 V128", 1, 256, 2, 64, 128)] if args.smoke else SHAPES

  t_start = time.perf_counter()

  def log(s):
    s = f"[{time.perf_counter() - t_start:6.1f}s] {s}" if s else s
    print(s, flush=True)
    lines.append(s)

  log(f"jax {jax.__version__}, devices {jax.devices()}")
  ok = None
  QUIET["file"], QUIET["limit_s"] = args.wait_file or None, args.wait_limit
  if not args.skip_checks:
    # FLA autotunes by timing its kernels: leave the GPU to it until it is done (tuned
    # beside these checks, it picks slower kernels: benchmarks/results/kernels_h200.md).
    wait_quiet()
    ok = True
    for ctune in json.loads(args.check_tune):
      if ctune:
        log(f"checks with config overrides {json.dumps(ctune, separators=(',', ':'))}")
      ok &= check_gpu(log, ctune)
    try:
      check_truth64(log)
    except Exception as e:  # noqa: BLE001
      log(f"truth64 check: FAILED {e!r}")
  if args.check_only:
    return
  fla = None
  if args.triton_cache:
    os.environ["TRITON_CACHE_DIR"] = os.path.abspath(args.triton_cache)
  if not args.no_fla:
    try:
      import torch
      import triton
      from fla.ops.gla import chunk_gla as fla_chunk_gla
      import fla as fla_pkg
      fla = (torch, triton, fla_chunk_gla)
      log(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"fla {getattr(fla_pkg, '__version__', '?')}, {torch.cuda.get_device_name()}")
    except Exception as e:  # noqa: BLE001
      log(f"FLA unavailable: {e!r}")
  results = []
  jsync = jax.block_until_ready
  if args.only:
    shapes = [shapes[int(i)] for i in args.only.split(",")]
  for name, B, T, H, K, V in shapes:
    scale = K ** -0.5
    qn, kn, vn, gn, don = make_inputs(0, B, T, H, K, V)
    bf = jnp.bfloat16
    q, k, v, do = (jnp.asarray(x, bf) for x in (qn, kn, vn, don))
    g = jnp.asarray(gn)
    row = {"shape": name}
    variants = [] if args.no_pallas else [("pallas", {})]
    if args.tune:
      variants += [(f"pallas{json.dumps(t, separators=(',', ':'))}", t)
                   for t in json.loads(args.tune)]
    if not args.no_jnp:
      variants.append(("jnp", {}))
    outs = {}
    configs[name] = config_for(B, T, H, K, V).flat()
    for vname, tune in variants:
      backend = "jax" if vname == "jnp" else "pallas"
      try:
        config = None if backend == "jax" else config_for(B, T, H, K, V, tune)
        f, fb = jax_fns(backend, scale, config)
        f = compiled(f, q, k, v, g)
        fb = compiled(fb, q, k, v, g, do)
        o = f(q, k, v, g)
        outs[vname] = np.asarray(o.astype(jnp.float32))
        if vname == "pallas" and args.save_outputs:
          os.makedirs(args.save_outputs, exist_ok=True)
          np.save(os.path.join(args.save_outputs, f"{T}_{H}_{V}.npy"), outs[vname])
        row[f"{vname} fwd ms"] = time_loop(lambda: f(q, k, v, g), jsync, args.iters, args.reps)
        row[f"{vname} fwd+bwd ms"] = time_loop(lambda: fb(q, k, v, g, do), jsync, args.iters,
                                               args.reps)
        row[f"{vname} fwd GiB"] = jax_peak(f)
        row[f"{vname} fwd+bwd GiB"] = jax_peak(fb)
        if vname == "pallas":
          _, gp = fb(q, k, v, g, do)
          outs["pallas_grads"] = [np.asarray(x.astype(jnp.float32)) for x in gp]
        log(f"{name} {vname}: fwd {row[f'{vname} fwd ms']:.3f} ms, fwd+bwd "
            f"{row[f'{vname} fwd+bwd ms']:.3f} ms, peak {row[f'{vname} fwd GiB']:.2f} / "
            f"{row[f'{vname} fwd+bwd GiB']:.2f} GiB")
      except Exception as e:  # noqa: BLE001
        log(f"{name} {vname}: FAILED {e!r}")
        traceback.print_exc()
    if args.stages:
      for stune in json.loads(args.stage_tune):
        tag = f" {json.dumps(stune, separators=(',', ':'))}" if stune else ""
        try:
          times = stage_times(q, k, v, g, do, scale, args.iters, args.reps,
                              config_for(B, T, H, K, V, stune))
          for sname, ms in times.items():
            row[f"stage{tag} {sname} ms"] = ms
            log(f"{name} stage{tag} {sname}: {ms:.3f} ms")
        except Exception as e:  # noqa: BLE001
          log(f"{name} stages{tag}: FAILED {e!r}")
    if args.stage_sweep:
      try:
        base_config = config_for(B, T, H, K, V)
        pre = stage_inputs(q, k, v, g, do, scale, base_config)
        base = stage_times(q, k, v, g, do, scale, args.iters, args.reps, base_config, pre=pre)
        for sname, ms in base.items():
          row[f"sweep base {sname} ms"] = ms
          log(f"{name} sweep base {sname}: {ms:.3f} ms")
        for stune in json.loads(args.stage_sweep):
          tag = json.dumps(stune, separators=(",", ":"))
          try:
            times = stage_times(q, k, v, g, do, scale, args.iters, args.reps,
                                config_for(B, T, H, K, V, stune), names=stages_of(stune),
                                pre=pre)
            for sname, ms in times.items():
              row[f"sweep {tag} {sname} ms"] = ms
              log(f"{name} sweep {tag} {sname}: {ms:.3f} ms (base {base[sname]:.3f})")
          except Exception as e:  # noqa: BLE001
            log(f"{name} sweep {tag}: FAILED {e!r}")
      except Exception as e:  # noqa: BLE001
        log(f"{name} sweep: FAILED {e!r}")
        traceback.print_exc()
    if "jnp" in outs and "pallas" in outs:
      row["pallas vs jnp fwd rel"] = rel(outs["pallas"], outs["jnp"])
    if fla is not None:
      torch, triton, fla_fn = fla
      try:
        dev = "cuda"
        tq, tk, tv, tdo = (torch.tensor(x, device=dev).to(torch.bfloat16)
                           for x in (qn, kn, vn, don))
        tg = torch.tensor(gn, device=dev)
        for t in (tq, tk, tv, tg):
          t.requires_grad_(True)
        ffwd = lambda: fla_fn(tq, tk, tv, tg, scale=scale)[0]

        def ffb():
          o = fla_fn(tq, tk, tv, tg, scale=scale)[0]
          return torch.autograd.grad(o, (tq, tk, tv, tg), tdo)

        if args.go_file and not os.path.exists(args.go_file):
          ffb()                      # Triton autotuning of FLA's kernels, then wait
          torch.cuda.synchronize()
          log(f"{name} fla: warmed up (autotuned); waiting for {args.go_file}")
          if args.ready_file:
            open(args.ready_file, "w").close()
          while not os.path.exists(args.go_file):
            time.sleep(1)
        saved = os.path.join(args.compare_outputs, f"{T}_{H}_{V}.npy")
        if "pallas" not in outs and args.compare_outputs and os.path.exists(saved):
          outs["pallas"] = np.load(saved)

        with torch.no_grad():
          of = ffwd().float().cpu().numpy()
        tsync = harness.torch_sync
        row["fla fwd ms"] = time_loop(lambda: ffwd(), tsync, args.iters, args.reps)
        row["fla fwd+bwd ms"] = time_loop(ffb, tsync, args.iters, args.reps)
        row["fla fwd ms (do_bench)"] = triton.testing.do_bench(ffwd, return_mode="median")
        row["fla fwd+bwd ms (do_bench)"] = triton.testing.do_bench(ffb, return_mode="median")
        for key, fn in (("fwd", ffwd), ("fwd+bwd", ffb)):
          torch.cuda.synchronize()
          torch.cuda.reset_peak_memory_stats()
          base = torch.cuda.memory_allocated()
          r = fn()
          torch.cuda.synchronize()
          # Inputs (q, k, v, g, do) are resident for both frameworks: count them.
          inputs = sum(t.numel() * t.element_size() for t in (tq, tk, tv, tg)) + (
              tdo.numel() * tdo.element_size() if key == "fwd+bwd" else 0)
          row[f"fla {key} GiB"] = (torch.cuda.max_memory_allocated() - base + inputs) / 2**30
          del r
        row["pallas vs fla fwd rel"] = rel(outs.get("pallas", np.nan), of)
        fg = [x.float().cpu().numpy() for x in ffb()]
        if "pallas_grads" in outs:
          row["pallas vs fla grad rel"] = [rel(a, b) for a, b in zip(outs["pallas_grads"], fg)]
        log(f"{name} fla: fwd {row['fla fwd ms']:.3f} ms "
            f"(do_bench {row['fla fwd ms (do_bench)']:.3f}),"
            f" fwd+bwd {row['fla fwd+bwd ms']:.3f} ms (do_bench "
            f"{row['fla fwd+bwd ms (do_bench)']:.3f}), peak {row['fla fwd GiB']:.2f} / "
            f"{row['fla fwd+bwd GiB']:.2f} GiB; pallas vs fla fwd rel "
            f"{row['pallas vs fla fwd rel']:.2e}, grads {row.get('pallas vs fla grad rel')}")
        del tq, tk, tv, tg, tdo
        torch.cuda.empty_cache()
        if args.fla_stages:
          for sname, ms in fla_stage_times(torch, qn, kn, vn, gn, don, scale, args.iters,
                                           args.reps).items():
            row[f"fla stage {sname} ms"] = ms
            log(f"{name} fla stage {sname}: {ms:.3f} ms")
      except Exception as e:  # noqa: BLE001
        log(f"{name} fla: FAILED {e!r}")
        traceback.print_exc()
    results.append(row)

  log("")
  log("| shape | pass | Pallas (ms) | jnp chunk (ms) | FLA (ms) | FLA / Pallas "
      "| peak Pallas / FLA (GiB) |")
  log("|---|---|---|---|---|---|---|")
  for r in results:
    for key in ("fwd", "fwd+bwd"):
      p, j, f = (r.get(f"{x} {key} ms", float("nan")) for x in ("pallas", "jnp", "fla"))
      log(f"| {r['shape']} | {key} | {p:.3f} | {j:.3f} | {f:.3f} | {f / p:.2f} | "
          f"{r.get(f'pallas {key} GiB', float('nan')):.2f} / "
          f"{r.get(f'fla {key} GiB', float('nan')):.2f} |")
  log(f"GPU correctness checks: {'not run' if ok is None else 'all OK' if ok else 'FAILED'}")
  if args.wait_file:
    log(f"waited {QUIET.get('waited_s', 0):.0f} s for {args.wait_file} before timing")
  with open(os.path.join(args.out, "kernels.json"), "w") as fh:
    json.dump({"results": results, "configs": configs, "base_overrides": BASE, "checks_ok": ok},
              fh, indent=1, default=str)
  with open(os.path.join(args.out, "kernels.log"), "w") as fh:
    fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
