"""The local attention's backends (zeco_jax.ops.attention.op.BACKENDS): the splash kernel
(Pallas, interpreted on CPU) against the float64 truth on one device and under Ulysses at
P = 2, with packed documents (two runs of one id, padding), grouped key heads, a window and
bidirectional attention; which backend "auto" picks on each platform, and the errors of a
kernel backend that cannot take the inputs. cuDNN runs on the H200 only
(benchmarks/hybrid_h200.py checks it against the same truth). Bars (relative norm,
float32): outputs 1e-5, gradients of q, k, v 1e-4."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err64, seq_mesh
from zeco_jax.ops.attention import op
from zeco_jax.ops.attention.op import attention
from zeco_jax.ops.attention.parallel import sp_attention
from zeco_jax.ops.attention.reference import attention_float64

B, T, H, HKV, D = 1, 256, 4, 2, 32


def inputs(seed=0):
  r = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return n(B, T, H, D), n(B, T, HKV, D), n(B, T, HKV, D), n(B, T, H, D)


def documents():
  """Id 0 twice (tokens 0-99 and 170-255: two documents), padding 100-109, id 1 between."""
  ids = np.zeros((B, T), np.int32)
  ids[0, 100:110] = -1
  ids[0, 110:170] = 1
  return jnp.asarray(ids)


CASES = {"documents": dict(segment_ids="docs"),
         "window": dict(segment_ids="docs", window=37),
         "bidirectional": dict(causal=False, segment_ids="docs"),
         "plain": dict()}


def check(fn, kw):
  q, k, v, do = inputs()
  o64, g64 = attention_float64(q, k, v, do, **kw)
  o, pull = jax.vjp(jax.jit(fn), q, k, v)
  assert rel_err64(o, o64) <= 1e-5
  for name, g in zip("qkv", pull(do)):
    assert rel_err64(g, g64[name]) <= 1e-4, name
  return o


@pytest.mark.parametrize("case", CASES)
def test_splash_one_device(case):
  kw = {n: documents() if x == "docs" else x for n, x in CASES[case].items()}
  o = check(lambda q, k, v: attention(q, k, v, backend="splash", **kw), kw)
  if "segment_ids" in kw:
    assert np.all(np.asarray(o[0, 100:110]) == 0)


@pytest.mark.parametrize("T", [128, 384])
def test_splash_eager_at_the_user_head_size(T):
  """D = 128, one and three splash blocks of 128, documents, eager (no jit)."""
  r = np.random.default_rng(T)
  n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  q, k, v, do = n(1, T, 2, 128), n(1, T, 1, 128), n(1, T, 1, 128), n(1, T, 2, 128)
  ids = jnp.asarray((np.arange(T) >= T // 3).astype(np.int32)[None])
  o64, g64 = attention_float64(q, k, v, do, segment_ids=ids)
  o, pull = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids=ids, backend="splash"),
                    q, k, v)
  assert rel_err64(o, o64) <= 1e-5
  for name, g in zip("qkv", pull(do)):
    assert rel_err64(g, g64[name]) <= 1e-4, name


def test_splash_under_ulysses():
  kw = dict(segment_ids=documents())
  mesh = seq_mesh(2)
  check(lambda q, k, v: sp_attention(q, k, v, mesh=mesh, method="ulysses", backend="splash",
                                     **kw), kw)


def resolve(backend, platform, dtype=jnp.bfloat16, D=128, T=1024, causal=True, window=None,
            segmented=False):
  return op.resolve(backend, platform, dtypes=(dtype,) * 3, D=D, T=T, causal=causal,
                    window=window, segmented=segmented, name="attention")


def test_splash_blocks_grow_with_long_sequences():
  assert [op.splash_block(T) for T in (256, 384, 16384, 131072, 262144)] == [
      256, 128, 512, 512, 1024]
  assert op.splash_block(1 << 19) is None
  with pytest.raises(ValueError, match="SMEM"):
    resolve("splash", "tpu", T=1 << 19)


def test_auto_picks_the_platforms_kernel():
  assert resolve("auto", "cpu") == "xla"
  assert resolve("auto", "gpu") == "cudnn"
  assert resolve("auto", "tpu") == "splash"
  assert resolve("auto", "gpu", window=128) == "cudnn"
  assert resolve("xla", "gpu") == "xla"


@pytest.mark.parametrize("platform, facts, reason", [
    ("gpu", dict(segmented=True), "no documents"),
    ("gpu", dict(dtype=jnp.float32), "bf16 or f16"),
    ("gpu", dict(D=256), "up to 128"),
    ("gpu", dict(causal=False, window=8), "window only with causal"),
    ("tpu", dict(T=1000), "multiple of 128"),
])
def test_auto_says_why_it_runs_xla_and_explicit_kernels_raise(platform, facts, reason):
  with pytest.warns(UserWarning, match=reason):
    assert resolve("auto", platform, **facts) == "xla"
  kernel = "cudnn" if platform == "gpu" else "splash"
  with pytest.raises(ValueError, match=f"backend='{kernel}' cannot run these inputs.*{reason}"):
    resolve(kernel, platform, **facts)


def test_backend_errors():
  with pytest.raises(ValueError, match="unknown `backend` 'flash'"):
    resolve("flash", "gpu")
  with pytest.raises(ValueError, match="cuDNN runs on GPU, the target is cpu"):
    resolve("cudnn", "cpu")
  q, k, v, _ = inputs()
  mesh = seq_mesh(2)
  for method in ("all_gather", "ring"):
    with pytest.raises(ValueError, match=f"method='{method}' does not have"):
      sp_attention(q, k, v, mesh=mesh, method=method, backend="splash")
  with warnings.catch_warnings():
    warnings.simplefilter("error")          # auto on CPU: XLA, nothing said
    resolve("auto", "cpu", segmented=True)
