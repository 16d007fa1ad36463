"""Gated DeltaNet's Mosaic TPU kernels (``pallas_kernels.gated_delta.tpu``): in the Pallas
interpreter against the float64 truth, and compiled by libtpu for v5e / v5p / v6e.

Parity: ``fwd_res`` / ``bwd_res`` (and ``fwd`` / ``bwd``, which recomputes the chunk
states) against ``gdn_float64`` (the token loop and its hand-written vjp in numpy: nothing
to compile), float32 forward (o, final) <= 1e-5 and gradients <= 1e-4, bf16 <= 2e-2.
Strong decay (g uniform in [-5, 0], one case with document starts at -1e4), beta up to
0.9999, random h0 and cotangents; K = V = 128, K != V, chunks of 16 to 128 (the UT inverse
with 0 to 3 merge levels), more than 8 chunks (two blocks of g rows), B and H > 1. And
``chunk_gated_delta_rule`` on these kernels (T not a multiple of the chunk) against the
float64 truth.

Compiled (skipped without libtpu, ``pip install -e '.[tpu]'``): through
``chunk_gated_delta_rule`` with the TPU kernels (``benchmarks/tpu_aot_kernels.py``'s
helpers), forward and forward + backward, bf16 and float32, for one device of each
generation; the compiled HLO holds the Mosaic kernels. Numerics on a chip are unverified.
"""
import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import check_gdn_against_float64, gdn_inputs, rel_err64

import pallas_kernels
from pallas_kernels.gated_delta import KernelConfig, tpu
from zeco_jax import chunk_gated_delta_rule
from zeco_jax.ops.gated_delta.reference import gdn_float64

INTERPRET = KernelConfig(platform="tpu", interpret=True)
NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")
requires_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                     reason="TPU compiler not installed: pip install -e '.[tpu]'")


@functools.partial(jax.jit, static_argnames=("scale", "C", "config"))
def _kernels(q, k, v, g, beta, h0, do, dht, *, scale, C, config):
  kw = dict(scale=scale, initial_state=h0, chunk_size=C, config=config)
  (o, final), res = tpu.fwd_res(q, k, v, g, beta, **kw)
  grads = tpu.bwd_res(res, q, k, v, g, beta, do, dht, **kw)
  return (o, final, *grads), (*tpu.fwd(q, k, v, g, beta, **kw),
                              *tpu.bwd(q, k, v, g, beta, do, dht, **kw))


def _truth(q, k, v, g, beta, h0, do, dht, *, scale):
  """``gdn_float64`` on the inputs (bf16 ones as their float32 values): o, final and the
  vjp of (do, dht) for q, k, v, g, beta, h0, in float64."""
  f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
  o, final, grads = gdn_float64(*map(f32, (q, k, v, g, beta, h0, do, dht)), scale)
  return (o, final, *(grads[n] for n in ("q", "k", "v", "g", "beta", "h0")))


def _inputs(seed, B, T, H, K, V, dtype, decay="strong"):
  """g uniform in [-5, 0] ("strong"; "resets": with -1e4 at a few tokens, as document
  starts) or [-0.5, 0] ("mild": the state carries over many chunks); beta up to 0.9999."""
  (q, k, v, g, beta, h0), (do, dht) = gdn_inputs(
      seed, B, T, H, K, V, g_low=-0.5 if decay == "mild" else -5.0, beta_high=0.9999,
      dtype=dtype)
  if decay == "resets":
    g = g.at[:, 5::37].set(-1e4)
  return q, k, v, g, beta.astype(jnp.float32), h0, do, dht


@pytest.mark.parametrize("B,T,H,K,V,C,dtype,decay", [
    (1, 128, 1, 128, 128, 64, jnp.float32, "strong"),
    (1, 128, 1, 128, 128, 64, jnp.float32, "resets"),
    (1, 256, 2, 64, 128, 128, jnp.float32, "strong"),
    (2, 160, 1, 32, 16, 16, jnp.float32, "strong"),
    (2, 160, 1, 32, 16, 16, jnp.float32, "mild"),
    (1, 128, 1, 128, 64, 32, jnp.bfloat16, "strong"),
], ids=["K128V128C64", "resets", "K64V128C128H2", "B2C16N10", "B2C16N10mild", "bf16K128V64C32"])
def test_matches_float64(B, T, H, K, V, C, dtype, decay):
  args = _inputs(0, B, T, H, K, V, dtype, decay)
  scale = K ** -0.5
  kept, recomputed = _kernels(*args, scale=scale, C=C, config=INTERPRET)
  want = _truth(*args, scale=scale)
  fwd_tol, grad_tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 2e-2)
  assert kept[0].dtype == dtype and kept[0].shape == (B, T, H, V)
  for got in (kept, recomputed):
    errors = {n: rel_err64(a, b) for n, a, b in zip(NAMES, got, want)}
    bad = {n: e for n, e in errors.items() if e > (fwd_tol if n in NAMES[:2] else grad_tol)}
    assert not bad, errors


def test_kernels_are_registered_for_tpu():
  assert pallas_kernels.backend("gated_delta", "tpu") is tpu
  assert isinstance(tpu, pallas_kernels.ChunkKernels)


def test_op_with_tpu_kernels_matches_float64():
  """``chunk_gated_delta_rule`` on these kernels (T padded to the chunk) against the
  float64 truth."""
  inputs, weights = gdn_inputs(3, 1, 100, 2, 32, 32, g_low=-5.0, beta_high=0.9999)
  op = functools.partial(chunk_gated_delta_rule, chunk_size=32, backend="pallas",
                         kernel_config=INTERPRET)
  check_gdn_against_float64(op, inputs, weights)


def test_float32_states_residual():
  """``states_in_input_dtype=False``: the kept chunk states are float32."""
  args = _inputs(1, 1, 64, 1, 32, 32, jnp.bfloat16)
  config = INTERPRET.replace(states_in_input_dtype=False)
  kw = dict(scale=0.2, initial_state=args[5], chunk_size=32, config=config)
  shapes = jax.eval_shape(lambda *a: tpu.fwd_res(*a, **kw), *args[:5])
  assert shapes[1].h.shape == (1, 1, 2, 32, 32) and shapes[1].h.dtype == jnp.float32


# --- compiled by libtpu -------------------------------------------------------------------

def _aot():
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")   # before the first topology
  from benchmarks import tpu_aot_kernels
  return tpu_aot_kernels


@pytest.fixture(scope="module", params=["v5e", "v5p", "v6e"])
def mesh(request):
  aot = _aot()
  return aot.one_device_mesh(aot.GENERATIONS[request.param])


@requires_libtpu
@pytest.mark.parametrize("which", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_mosaic_kernels_compile_for_tpu(mesh, dtype, which):
  aot = _aot()
  shape = aot.SHAPES["small (test)"]
  compiled, _ = aot.compile_kernels(mesh, shape, dtype, which, family="gated_delta")
  assert compiled.as_text().count(aot.CUSTOM_CALL) == aot.CALLS["gated_delta"][which]
  m = compiled.memory_analysis()
  B, T, H, K, V = shape
  item = jnp.dtype(dtype).itemsize
  assert m.argument_size_in_bytes == B * T * H * ((2 * K + V) * item + 2 * 4)
  assert m.temp_size_in_bytes < 64 * 2**20
  assert aot.flops(compiled) > 0


@requires_libtpu
def test_backward_with_recompute_compiles_for_tpu():
  """``bwd`` (no residual): the forward kernel emitting the states, then the backward."""
  aot = _aot()
  mesh = aot.one_device_mesh(aot.GENERATIONS["v5e"])
  B, T, H, K, V = 1, 256, 2, 128, 64
  s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (sds((B, T, H, K), bf), sds((B, T, H, K), bf), sds((B, T, H, V), bf),
          sds((B, T, H), f32), sds((B, T, H), f32), sds((B, T, H, V), bf),
          sds((B, H, K, V), f32), sds((B, H, K, V), f32))
  config = KernelConfig(platform="tpu", interpret=False)

  def backward(q, k, v, g, beta, do, dht, h0):
    return tpu.bwd(q, k, v, g, beta, do, dht, scale=0.1, initial_state=h0, chunk_size=64,
                   config=config)

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(backward).lower(*args).compile()
  assert compiled.as_text().count(aot.CUSTOM_CALL) == 2
