"""Accuracy under mixed per-token decays (log-decays in [-1e4, 0] in one chunk), ours vs FLA.

For each input set, float32 outputs and gradients of ``chunk_gla`` (our jnp path and, on a
GPU, our Pallas kernels) and of flash-linear-attention's ``chunk_gla`` / ``chunk_simple_gla``
are compared with the float64 token loop and its vjp (``zeco_jax.ops.gla.reference.
gla_float64``, numpy). Error = relative norm ``||x - x64|| / ||x64||`` of o and of the
gradients of sum(o * w). Results: benchmarks/results/decay_range.md.

    python -m benchmarks.decay_range                 # CPU: our jnp path
    python -m benchmarks.decay_range --out DIR       # on the H200, with FLA installed

Writes decay_range.json, decay_range.md and decay_range.env.json to --out when given.
The inputs: q, k, v ~ N(0, 1), shape (1, 128, 1, 16); g = -0.05 with
every 7th token a spike (-1e4, -100, -10), and a random mix (10% of tokens at -1e4, the rest
uniform in [-5, 0]); scalar [B, T, H] and per-dim [B, T, H, K].
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness as harness
from benchmarks._harness import rel
from zeco_jax import chunk_gla


def inputs(kind: str, decay: str, seed: int = 0, B=1, T=128, H=1, K=16, V=16):
  r = np.random.default_rng(seed)
  q, k = (r.standard_normal((B, T, H, K)) for _ in range(2))
  v = r.standard_normal((B, T, H, V))
  w = r.standard_normal((B, T, H, V))
  shape = (B, T, H) if decay == "scalar" else (B, T, H, K)
  if kind == "mix":
    g = r.uniform(-5.0, 0.0, shape)
    g[r.uniform(size=shape) < 0.1] = -1e4
  else:
    g = np.full(shape, -0.05)
    g[:, ::7] = float(kind)
  return q, k, v, g, w


def truth(q, k, v, g, w):
  """o and the gradients (q, k, v, g) of sum(o * w) from the float64 token loop
  (``zeco_jax.ops.gla.reference.gla_float64``)."""
  B, _, H, K = q.shape
  h0 = np.zeros((B, H, K, v.shape[-1]))
  o, _, grads = harness.gla_float64(q, k, v, g, h0, w, None, K ** -0.5)
  return {"o": o, **{"d" + n: grads[n] for n in "qkvg"}}


def ours(q, k, v, g, w, backend):
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def loss(q, k, v, g):
    o, _ = chunk_gla(q, k, v, g, backend=backend)
    return jnp.sum(o * f32(w)), o

  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      f32(q), f32(k), f32(v), f32(g))
  return {"o": np.asarray(o), **{n: np.asarray(x) for n, x in zip(("dq", "dk", "dv", "dg"), grads)}}


def fla(q, k, v, g, w):
  import torch
  from fla.ops.gla import chunk_gla as fla_gla
  from fla.ops.simple_gla import chunk_simple_gla
  tq, tk, tv, tg = (torch.tensor(x, dtype=torch.float32, device="cuda", requires_grad=True)
                    for x in (q, k, v, g))
  op = fla_gla if g.ndim == 4 else chunk_simple_gla
  o, _ = op(tq, tk, tv, tg, scale=q.shape[-1] ** -0.5)
  (o * torch.tensor(w, dtype=torch.float32, device="cuda")).sum().backward()
  return {"o": o.detach().cpu().numpy(),
          **{n: x.grad.cpu().numpy() for n, x in zip(("dq", "dk", "dv", "dg"), (tq, tk, tv, tg))}}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", ""))
  ap.add_argument("--no-fla", action="store_true")
  args = ap.parse_args()
  gpu = jax.default_backend() == "gpu"
  impls = {"ours jnp": lambda *a: ours(*a, "jax")}
  if gpu:
    impls["ours pallas"] = lambda *a: ours(*a, "pallas")
  if gpu and not args.no_fla:
    try:
      import fla as fla_package
      impls[f"FLA {fla_package.__version__}"] = fla
    except ImportError as e:
      print("FLA not available:", e)
  rows = []
  for decay in ("scalar", "dim"):
    for kind in ("-1e4", "-100", "-10", "mix"):
      q, k, v, g, w = inputs(kind, decay)
      ref = truth(q, k, v, g, w)
      for name, impl in impls.items():
        try:
          got = impl(q, k, v, g, w)
          errs = {n: rel(got[n], ref[n]) for n in ref}
        except Exception as e:  # noqa: BLE001  (report, go on)
          errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append({"decay": decay, "spikes": kind, "impl": name, **errs})
        print(json.dumps(rows[-1]), flush=True)
  names = ["o", "dq", "dk", "dv", "dg"]
  lines = ["| g | spikes | implementation | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(names)]
  for r in rows:
    cells = [f"{r[n]:.1e}" if isinstance(r.get(n), float) else r.get("error", "-")[:40]
             for n in names]
    lines.append(f"| {r['decay']} | {r['spikes']} | {r['impl']} | " + " | ".join(cells) + " |")
  print("\n".join(lines))
  if args.out:
    harness.write_environment(args.out, "decay_range")
    with open(os.path.join(args.out, "decay_range.json"), "w") as fh:
      json.dump(rows, fh, indent=1)
    with open(os.path.join(args.out, "decay_range.md"), "w") as fh:
      fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
