"""What the benchmark scripts share: the timing loop, the error measure, input builders and
the environment record written beside every result.

Timing (:func:`time_loop`): the median over ``reps`` repeats of the mean time of ``iters``
back-to-back calls, after ``warmup`` synchronised calls; the device is synchronised once at
the end of each repeat (``jax.block_until_ready`` of the last result, or the ``sync`` given,
e.g. :func:`torch_sync`). ``iters=1`` gives the median of single synchronised calls. The
kernel, Gated DeltaNet, segments and overlap timings of ``benchmarks/results`` were taken
with this loop (before it moved here, as copies in each script).

Error (:func:`rel`): the relative norm ``||a - b|| / ||b||`` in float64. The float64 truths
live in the library (``zeco_jax.ops.gla.reference.gla_float64``,
``zeco_jax.ops.gated_delta.reference.gdn_float64``), re-exported here.

Environment (:func:`environment`, :func:`write_environment`): versions (jax, jaxlib, torch,
triton, FLA, libtpu: those installed), the device, the commit (``git rev-parse --short HEAD``)
and the uncommitted paths a run reads, the UTC date and the command line.

This module imports jax only inside functions: scripts set ``XLA_FLAGS`` / ``JAX_PLATFORMS``
before jax starts. It does not time training steps (``train_gla340m`` times whole steps).
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# Raw output of a run when no --out is given: ignored by git (/runs/), never results/.
RUNS = os.path.join(ROOT, "runs", "benchmarks")

# The kernel benchmark's shapes: (name, B, T, H, K, V).
GLA_SHAPES = [
    ("paper B1 T16384 H16 K128 V128", 1, 16384, 16, 128, 128),
    ("GLA-340M B8 T4096 H4 K128 V256", 8, 4096, 4, 128, 256),
]


# -- timing -----------------------------------------------------------------------------------

def _jax_sync(out):
  import jax
  return jax.block_until_ready(out)


def torch_sync(_=None):
  """``sync`` for PyTorch calls: waits for the current CUDA stream."""
  import torch
  torch.cuda.synchronize()


def mean_ms(fn, sync=None, iters: int = 20, *, warmup: int = 0) -> float:
  """Mean ms of ``iters`` back-to-back calls of ``fn()`` (synchronised once, at the end),
  after ``warmup`` synchronised calls."""
  sync = sync or _jax_sync
  for _ in range(warmup):
    sync(fn())
  t0 = time.perf_counter()
  out = None
  for _ in range(iters):
    out = fn()
  sync(out)
  return (time.perf_counter() - t0) / iters * 1e3


def time_loop(fn, sync=None, iters: int = 20, reps: int = 7, *, warmup: int = 2) -> float:
  """Median over ``reps`` of :func:`mean_ms` (``iters`` calls each), after ``warmup``
  synchronised calls (the first compiles or autotunes). ``fn`` takes no arguments."""
  sync = sync or _jax_sync
  for _ in range(warmup):
    sync(fn())
  return float(np.median([mean_ms(fn, sync, iters) for _ in range(reps)]))


# -- errors and truths ------------------------------------------------------------------------

def live_fwd_bwd(op, do):
  """jit of ``op``'s output o (``op(*a)[0]``) with its vjp of ``do``, returned together,
  so that the forward runs whole, as FLA's ``o.backward(do)`` does: the vjp alone needs
  only the backward's residuals (for our delta-rule ops, the inputs), and XLA drops the
  forward's kernels as dead code."""
  import jax

  def fwd_bwd(*a):
    o, vjp = jax.vjp(lambda *x: op(*x)[0], *a)
    return o, vjp(do)

  return jax.jit(fwd_bwd)


def rel(a, b) -> float:
  """``||a - b|| / ||b||`` in float64; NaN when ``a`` has a non-finite value (so every
  ``rel(...) <= tol`` check fails on it)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if not np.all(np.isfinite(a)):
    return float("nan")
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def gla_float64(*args, **kwargs):
  """``zeco_jax.ops.gla.reference.gla_float64``: GLA's float64 token loop and its vjp."""
  from zeco_jax.ops.gla.reference import gla_float64 as truth
  return truth(*args, **kwargs)


def gdn_float64(*args, **kwargs):
  """``zeco_jax.ops.gated_delta.reference.gdn_float64``: Gated DeltaNet's float64 truth."""
  from zeco_jax.ops.gated_delta.reference import gdn_float64 as truth
  return truth(*args, **kwargs)


# -- inputs -----------------------------------------------------------------------------------

def gla_inputs(seed: int, B: int, T: int, H: int, K: int, V: int, *, strong: bool = False):
  """float32 numpy ``q, k, v, g, do`` (``g`` per dim ``[B, T, H, K]``). The benchmark's
  mild decay ``g = logsigmoid(x) / 16`` (a chunk of 64 decays by about 3: the kernels'
  whole-chunk path), or with ``strong`` ``4 logsigmoid(x) - U(0, 3)`` (about -4 per token:
  the exact loops)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, H, K), np.float32)
  k = rng.standard_normal((B, T, H, K), np.float32)
  v = rng.standard_normal((B, T, H, V), np.float32)
  x = rng.standard_normal((B, T, H, K), np.float32)
  if strong:
    g = -np.log1p(np.exp(-x)) * 4.0 - rng.uniform(0, 3, x.shape).astype(np.float32)
  else:
    g = -np.log1p(np.exp(-x)) / 16.0      # logsigmoid(x) / 16
  do = rng.standard_normal((B, T, H, V), np.float32)
  return q, k, v, g.astype(np.float32), do


def gdn_inputs(seed: int, B: int, T: int, H: int, K: int, V: int):
  """float32 numpy ``q, k, v, g, beta, do`` for Gated DeltaNet: k unit-norm over K,
  ``g = log U(0.9, 1)`` ``[B, T, H]``, ``beta = sigmoid(N(0, 1))``."""
  r = np.random.default_rng(seed)
  q = r.standard_normal((B, T, H, K)).astype(np.float32)
  k = r.standard_normal((B, T, H, K)).astype(np.float32)
  k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
  v = r.standard_normal((B, T, H, V)).astype(np.float32)
  g = np.log(r.uniform(0.9, 1.0, (B, T, H))).astype(np.float32)
  beta = (1 / (1 + np.exp(-r.standard_normal((B, T, H))))).astype(np.float32)
  do = r.standard_normal((B, T, H, V)).astype(np.float32)
  return q, k, v, g, beta, do


def config_changes(items) -> dict:
  """``--set`` items ``["name=value", ...]`` -> ``KernelConfig.replace`` arguments (True /
  False, else int)."""
  flags = {"True": True, "False": False}
  out = {}
  for item in items:
    name, value = item.split("=", 1)
    out[name] = flags[value] if value in flags else int(value)
  return out


def ab_variants(items, error, *, first: dict, option: str) -> dict:
  """A/B items ``["name:a=1,b=2", ...]`` -> ``{name: changes}``, after ``first`` (the
  variants every run has, e.g. ``{"default": {}}``); a malformed item or a name already
  taken is ``error(message)`` (argparse's) naming ``option``."""
  out = dict(first)
  for item in items:
    name, sep, body = item.partition(":")
    if not sep or not name or " " in name or not body or name in out:
      error(f"{option} item {item!r}: write NAME:CHANGES with a new name, e.g. "
            "one_warp:intra_warps=1,intra_kd=32")
    try:
      out[name] = config_changes(body.split(","))
    except (ValueError, KeyError):
      error(f"{option} item {item!r}: each change is NAME=VALUE (an int, True or False)")
  return out


# -- environment ------------------------------------------------------------------------------

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "libtpu", "torch",
            "triton", "flash-linear-attention", "fla-core", "flax", "optax")


def _git(*args) -> str:
  try:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=20).stdout.rstrip("\n")
  except (OSError, subprocess.SubprocessError):
    return ""


def commit() -> str:
  """``git rev-parse --short HEAD`` ("unknown" outside a checkout)."""
  return _git("rev-parse", "--short", "HEAD").strip() or "unknown"


def uncommitted() -> list:
  """The tracked paths a run reads that differ from HEAD (library, kernels, models,
  configs, trainer, benchmarks)."""
  out = _git("status", "--porcelain", "--untracked-files=no", "--", "zeco_jax",
             "pallas_kernels", "models", "configs", "trainer", "trainer.py", "benchmarks")
  return [line[3:] for line in out.splitlines() if line.strip()]


def environment(*, devices: bool = True) -> dict:
  """Versions, device, commit, UTC date and command line of this run. ``devices=False``
  leaves jax's backend alone (a parent process that must not take the GPU)."""
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  env = {"command": "python -m " + " ".join([_module_name()] + sys.argv[1:]),
         "commit": commit(), "uncommitted": uncommitted(),
         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "python": platform.python_version(), "host": platform.machine(),
         "versions": versions}
  if devices:
    import jax
    found = jax.devices()
    env["devices"] = {"platform": found[0].platform, "kind": found[0].device_kind,
                      "count": len(found), "processes": jax.process_count()}
  return env


def _module_name() -> str:
  main = sys.modules.get("__main__")
  spec = getattr(main, "__spec__", None)
  if spec is not None and spec.name:
    return spec.name
  return os.path.relpath(sys.argv[0], ROOT) if sys.argv and sys.argv[0] else "?"


def write_environment(folder: str, name: str, *, devices: bool = True, extra=None) -> str:
  """Writes :func:`environment` (and ``extra``) as ``folder/<name>.env.json``; returns it."""
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f"{name}.env.json")
  with open(path, "w") as fh:
    json.dump({**environment(devices=devices), **(extra or {})}, fh, indent=1)
  return path


def env_line(env: dict) -> str:
  """One line for a results header: commit, date, versions, device."""
  v = env.get("versions", {})
  parts = [f"commit {env['commit']}" + (" + uncommitted changes" if env.get("uncommitted")
                                          else ""), env["date"]]
  parts += [f"{n} {v[n]}" for n in ("jax", "libtpu", "torch", "triton", "fla-core") if n in v]
  if "devices" in env:
    d = env["devices"]
    parts.append(f"{d['count']} x {d['kind']}")
  return ", ".join(parts)


def out_dir(given: str | None, name: str) -> str:
  """Where a run writes its raw output: ``given`` (``--out``), else ``$OUT``, else
  ``runs/benchmarks/<name>`` (ignored by git). Created."""
  folder = given or os.environ.get("OUT") or os.path.join(RUNS, name)
  os.makedirs(folder, exist_ok=True)
  return folder
