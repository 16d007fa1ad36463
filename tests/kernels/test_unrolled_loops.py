"""The GPU kernels' loops as Triton runs them, unrolled at trace time, compute what the
interpreter's one-step loops compute (``pallas_kernels._launch.unroll_for``: the
interpreter takes one step per loop iteration, so the other kernel tests run that form).

Each family's op runs forward and backward in the Pallas interpreter twice on the same
inputs, jitted (one program each; eagerly every pallas_call and glue op is compiled on
its own, slower here: ``benchmarks/results/test_suite_cpu.md``): as every other CPU test
runs it, then with ``unroll_for`` giving the Triton launch's steps per iteration. The two
must agree to float32 rounding (relative norm <= 1e-6 for every output and gradient; the
same operations in the same order, so only XLA's fusion of them may differ). Decays are
strong and mixed (uniform in [-5, 0] per token, some tokens at -1e4), so that GLA's exact
diagonal loops run beside its dots."""
import sys

import jax
import jax.numpy as jnp
import pytest

from helpers import rel_err
from zeco_jax import chunk_gated_delta_rule, chunk_gla, chunk_kda

pallas_kernels = pytest.importorskip("pallas_kernels")
from pallas_kernels import _launch  # noqa: E402

B, T, H, K, V, C = 1, 64, 2, 16, 16, 32


def _inputs(family):
  ks = jax.random.split(jax.random.PRNGKey(3), 9)
  q = jax.random.normal(ks[0], (B, T, H, K))
  k = jax.random.normal(ks[1], (B, T, H, K))
  v = jax.random.normal(ks[2], (B, T, H, V))
  gshape = (B, T, H) if family == "gdn" else (B, T, H, K)
  g = -5.0 * jax.random.uniform(ks[3], gshape)
  g = jnp.where(jax.random.uniform(ks[4], gshape) < 0.1, -1e4, g)
  h0 = jax.random.normal(ks[5], (B, H, K, V))
  cot = (jax.random.normal(ks[6], (B, T, H, V)), jax.random.normal(ks[7], (B, H, K, V)))
  if family == "gla":
    return (q, k, v, g, h0), cot
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  beta = jax.random.uniform(ks[8], (B, T, H), minval=0.1, maxval=0.9999)
  return (q, k, v, g, beta, h0), cot


def _run(family, config_changes, args, cot):
  op = {"gla": chunk_gla, "gdn": chunk_gated_delta_rule, "kda": chunk_kda}[family]
  folder = {"gdn": "gated_delta"}.get(family, family)
  config = pallas_kernels.family_default_config(folder, "cpu", B, T, H, K, V, jnp.float32,
                                                chunk_size=C).replace(**config_changes)

  def f(*a):
    return op(*a[:-1], initial_state=a[-1], output_final_state=True, chunk_size=C,
              backend="pallas", kernel_config=config)

  @jax.jit
  def run(args, cot):
    out, vjp = jax.vjp(f, *args)
    return list(out) + list(vjp(cot))

  return run(args, cot)


@pytest.mark.parametrize("family, config_changes", [
    ("gla", {}), ("gla", {"diag_dots": False}), ("gdn", {}), ("kda", {})],
    ids=["gla", "gla-diag-loops", "gdn", "kda"])
def test_triton_unrolled_loops_match_the_interpreters(family, config_changes, monkeypatch):
  # The inputs once, before jax.clear_caches(): their eager random ops are not compiled again.
  args, cot = _inputs(family)
  stepped = _run(family, config_changes, args, cot)
  # Every kernel module imported by that run that holds the helper (imported by name).
  helper = _launch.unroll_for
  for name, module in list(sys.modules.items()):
    if name.startswith("pallas_kernels") and getattr(module, "unroll_for", None) is helper:
      monkeypatch.setattr(module, "unroll_for", lambda config, unroll: unroll)
  jax.clear_caches()                 # trace the kernels again, through the patched helper
  unrolled = _run(family, config_changes, args, cot)
  errs = [rel_err(a, b) for a, b in zip(unrolled, stepped)]
  assert max(errs) <= 1e-6, errs
