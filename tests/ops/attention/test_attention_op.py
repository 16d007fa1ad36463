"""Softmax attention on one device (zeco_jax.ops.attention): the blockwise online softmax
(key blocks smaller than T, invisible blocks skipped) and the plain-jnp reference against
the float64 truth, causal or not, with packed documents and padding, a sliding window and
grouped key heads, also at the head size models use (128) with T around a block, jit and
eager; argument errors name the argument. Bars (relative norm, float32):
outputs 1e-5, gradients of q, k, v 1e-4."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err64
from zeco_jax.ops.attention.op import attention
from zeco_jax.ops.attention.reference import attention_float64, attention_reference

B, T, H, HKV, D = 2, 64, 4, 2, 16


def inputs(seed=0, h=H, hkv=HKV):
  r = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return n(B, T, h, D), n(B, T, hkv, D), n(B, T, hkv, D), n(B, T, h, D)


def documents():
  """Row 0: three documents with padding between two; row 1: leading padding."""
  ids = np.zeros((B, T), np.int32)
  ids[0, 20:] = 1
  ids[0, 40:44] = -1
  ids[0, 44:] = 2
  ids[1, :5] = -1
  return jnp.asarray(ids)


CASES = {"causal": {}, "documents": {"segment_ids": "docs"},
         "window": {"segment_ids": "docs", "window": 7},
         "bidirectional": {"causal": False, "segment_ids": "docs"}}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("op", ["blockwise", "reference"])
def test_against_float64(case, op):
  q, k, v, do = inputs()
  kw = {n: documents() if x == "docs" else x for n, x in CASES[case].items()}
  fn = {"blockwise": lambda q, k, v: attention(q, k, v, block_size=16, **kw),
        "reference": lambda q, k, v: attention_reference(q, k, v, **kw)}[op]
  o64, g64 = attention_float64(q, k, v, do, **kw)
  o, pull = jax.vjp(jax.jit(fn), q, k, v)
  assert rel_err64(o, o64) <= 1e-5
  for name, g in zip("qkv", pull(do)):
    assert rel_err64(g, g64[name]) <= 1e-4, name


def test_padding_outputs_zero():
  q, k, v, _ = inputs(1)
  o = attention(q, k, v, segment_ids=documents(), block_size=16)
  assert np.all(np.asarray(o[0, 40:44]) == 0) and np.all(np.asarray(o[1, :5]) == 0)
  assert np.all(np.isfinite(np.asarray(o)))


def test_errors_name_the_argument():
  q, k, v, _ = inputs()
  with pytest.raises(ValueError, match="Hkv = 3 must divide"):
    attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
  with pytest.raises(ValueError, match="`window`"):
    attention(q, k, v, window=0)
  with pytest.raises(ValueError, match="`segment_ids`"):
    attention(q, k, v, segment_ids=jnp.zeros((B, T - 1), jnp.int32))
  with pytest.raises(ValueError, match="`k` and `v`"):
    attention(q, k, v[:, :-1])


@pytest.mark.parametrize("T", [63, 64, 65, 192])
@pytest.mark.parametrize("compiled", [True, False], ids=["jit", "eager"])
def test_user_head_size_around_a_block(T, compiled):
  """D = 128 (the head size models use), T below, at and past one key / query block of 64
  (a T the block does not divide runs as one block; 192 is 3 x 3 blocks, 3 of them skipped
  above the diagonal), with documents, jit and eager."""
  r = np.random.default_rng(T)
  n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  q, k, v, do = n(1, T, 2, 128), n(1, T, 1, 128), n(1, T, 1, 128), n(1, T, 2, 128)
  ids = jnp.asarray((np.arange(T) >= T // 3).astype(np.int32)[None])
  fn = lambda q, k, v: attention(q, k, v, segment_ids=ids, backend="xla", block_size=64)
  o64, g64 = attention_float64(q, k, v, do, segment_ids=ids)
  o, pull = jax.vjp(jax.jit(fn) if compiled else fn, q, k, v)
  assert rel_err64(o, o64) <= 1e-5
  for name, g in zip("qkv", pull(do)):
    assert rel_err64(g, g64[name]) <= 1e-4, name
