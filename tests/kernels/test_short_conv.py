"""The short convolution's kernels (pallas_kernels.short_conv) in the Pallas interpreter
against a float64 token loop (forward, dx, dw; T not a multiple of the tile, across a
backward program's rows, packed documents, bf16), ShortConvolution on them against its XLA
form (eager and jitted, on a sequence mesh too), their lowering for an H200, and the
errors. Tolerances are relative norms."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import abstract_mesh
from pallas_kernels.short_conv import ConvConfig, conv_silu_bwd, conv_silu_fwd
from zeco_jax.nn import ShortConvolution

# Tiles of 16 tokens, a backward program of 32: T = 5 is inside one tile, 17 one token
# past it, 40 across two backward programs.
CONFIG = ConvConfig(bt=16, bwd_bt=16, bc=16, rows=32, interpret=True)


def _truth(x, w, ids, dy):
  """(y, dx, dw) by a float64 token loop: tap j reads x[t - j] while tokens t - j + 1 .. t
  all continue the document of the token before them; the gradients by the chain rule
  through each tap (the autodiff of the XLA form is the other check, below)."""
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  B, T, C = x.shape
  W = w.shape[0]
  taps = []                                   # (b, t, j) of every tap read
  pre = np.zeros_like(x)
  for b in range(B):
    for t in range(T):
      for j in range(W):
        if t - j < 0 or (ids is not None and j and np.any(
            np.diff(np.asarray(ids)[b, t - j:t + 1]) != 0)):
          break
        pre[b, t] += x[b, t - j] * w[W - 1 - j]
        taps.append((b, t, j))
  sig = 1 / (1 + np.exp(-pre))
  dpre = dy * sig * (1 + pre * (1 - sig))
  dx, dw = np.zeros_like(x), np.zeros_like(w)
  for b, t, j in taps:
    dx[b, t - j] += dpre[b, t] * w[W - 1 - j]
    dw[W - 1 - j] += dpre[b, t] * x[b, t - j]
  return pre * sig, dx, dw


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _inputs(T, with_ids, seed=0, C=32, W=4):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((2, T, C)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((W, C)) * 0.5, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((2, T, C)), jnp.float32)
  ids = (jnp.asarray(np.cumsum(rng.random((2, T)) < 0.2, axis=1), jnp.int32)
         if with_ids else None)
  return x, w, ids, dy


@pytest.mark.parametrize("T, with_ids", [(5, False), (17, True), (40, True), (40, False)])
def test_kernels_match_a_float64_loop(T, with_ids):
  x, w, ids, dy = _inputs(T, with_ids)
  y = conv_silu_fwd(x, w, ids, config=CONFIG)
  dx, dw = conv_silu_bwd(x, w, ids, dy, config=CONFIG)
  for got, want in zip((y, dx, dw), _truth(x, w, ids, dy)):
    assert _rel(got, want) < 1e-6


def test_kernels_in_bf16():
  x, w, ids, dy = _inputs(40, True, seed=1)
  bf = jnp.bfloat16
  y = conv_silu_fwd(x.astype(bf), w.astype(bf), ids, config=CONFIG)
  dx, dw = conv_silu_bwd(x.astype(bf), w.astype(bf), ids, dy.astype(bf), config=CONFIG)
  assert y.dtype == bf and dx.dtype == bf and dw.dtype == jnp.float32
  # The truth of the bf16-rounded inputs: what is left is the kernels' rounding of y, dx.
  xr, wr, dyr = (np.asarray(a.astype(bf), np.float64) for a in (x, w, dy))
  for got, want in zip((y, dx, dw), _truth(xr, wr, ids, dyr)):
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("jit", [False, True])
def test_short_convolution_on_the_kernels_matches_its_xla_form(jit):
  x, _, ids, dy = _inputs(40, True, seed=2)
  convs = {b: ShortConvolution(32, 4, rngs=nnx.Rngs(0), backend=b) for b in ("jax", "pallas")}

  def run(conv, x):
    y, vjp = jax.vjp(lambda x, w: conv.apply_weight(x, w, ids), x, conv.weight[...])
    return y, *vjp(dy)

  outs = {b: (jax.jit(run, static_argnums=0) if jit else run)(c, x) for b, c in convs.items()}
  for got, want in zip(outs["pallas"], outs["jax"]):
    assert _rel(got, want) < 1e-5


def test_short_convolution_on_the_kernels_over_a_sequence_mesh(devices):
  x, _, ids, dy = _inputs(32, True, seed=3)
  conv = ShortConvolution(32, 4, rngs=nnx.Rngs(0), backend="pallas")
  # data x seq, Auto axes (as the delta kernels' local-pass tests); B split over data.
  mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("data", "seq"))
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))

  def run(mesh):
    f = lambda x, w: conv.apply_weight(x, w, ids, mesh=mesh)
    y, vjp = jax.vjp(f, x, conv.weight[...])
    return y, *vjp(dy)

  for got, want in zip(jax.jit(lambda: run(mesh))(), run(None)):
    assert _rel(got, want) < 1e-6


def test_kernels_lower_for_an_h200():
  """Masked loads at negative rows (the taps before a row's start) and the stores past T
  lower to Triton for an H200, with and without documents."""
  sd = jax.ShapeDtypeStruct
  cfg = ConvConfig()
  for with_ids in (False, True):
    def both(x, w, ids, dy):
      ids = ids if with_ids else None
      return (conv_silu_fwd(x, w, ids, config=cfg),
              conv_silu_bwd(x, w, ids, dy, config=cfg))
    args = (sd((1, 1000, 256), jnp.bfloat16), sd((4, 256), jnp.bfloat16),
            sd((1, 1000), jnp.int32), sd((1, 1000, 256), jnp.bfloat16))
    with jax.sharding.use_abstract_mesh(abstract_mesh("gpu", "NVIDIA H200", 132)):
      text = jax.jit(both).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("short_conv_fwd") >= 1 and text.count("short_conv_bwd") >= 1


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"ShortConvolution: unknown `backend` .triton.; choose one of"):
    ShortConvolution(32, 4, rngs=nnx.Rngs(0), backend="triton")
  conv = ShortConvolution(24, 4, rngs=nnx.Rngs(0), backend="pallas")
  with pytest.raises(ValueError, match=r"channels in multiples of 16, got 24; use "
                     r"backend='jax'"):
    conv(jnp.ones((1, 8, 24)))
  with pytest.raises(ValueError, match=r"ConvConfig: `rows`=40 must be a multiple of "
                     r"`bt`=32"):
    ConvConfig(rows=40)
  with pytest.raises(ValueError, match=r"ConvConfig: `bc` must be a power of two >= 16"):
    ConvConfig(bc=24)
