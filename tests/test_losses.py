"""zeco_jax.losses against the dense float32 reference (values and gradients), on CPU.

Tolerances are relative norms: float32 inputs 1e-5 (same arithmetic, other order);
bf16 inputs 2e-2 against the float32 reference of the same (bf16-rounded) inputs (bf16
matmul operands in the backward).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err
from zeco_jax.losses import cross_entropy_reference, embedding_lookup, linear_cross_entropy

N, D, V, C = 96, 16, 50, 32


def assert_close(a, b, tol, name):
  err = rel_err(a, b)
  assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def _inputs(seed, dtype):
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k1, (N, D), jnp.float32).astype(dtype)
  w = (jax.random.normal(k2, (V, D), jnp.float32) * 0.5).astype(dtype)
  t = jax.random.randint(k3, (N,), 0, V)
  g = jax.random.uniform(k4, (N,), jnp.float32)          # per-token weights (a mask, scaled)
  return h, w, t, g


def _loss(fn):
  return lambda h, w, t, g: jnp.sum(fn(h, w, t)[0] * g)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_linear_cross_entropy_matches_reference(dtype, tol):
  h, w, t, g = _inputs(0, dtype)
  fast = jax.jit(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=C))
  nll, correct = fast(h, w, t)
  ref_nll, ref_correct = cross_entropy_reference(h.astype(jnp.float32),
                                                 w.astype(jnp.float32), t)
  assert nll.dtype == jnp.float32 and nll.shape == (N,)
  assert_close(nll, ref_nll, 1e-5 if dtype == jnp.float32 else 1e-2, "nll")
  assert float(jnp.mean(jnp.abs(correct - ref_correct))) <= (0 if dtype == jnp.float32 else 0.05)
  grads = jax.jit(jax.grad(_loss(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=C)),
                           argnums=(0, 1)))(h, w, t, g)
  ref = jax.grad(_loss(cross_entropy_reference), argnums=(0, 1))(
      h.astype(jnp.float32), w.astype(jnp.float32), t, g)
  for name, a, b, src in zip(("dh", "dw"), grads, ref, (h, w)):
    assert a.dtype == src.dtype
    assert_close(a.astype(jnp.float32), b, tol, name)


def test_chunk_size_must_divide_tokens():
  h, w, t, _ = _inputs(1, jnp.float32)
  with pytest.raises(ValueError, match="chunk_size=40"):
    linear_cross_entropy(h, w, t, chunk_size=40)


def test_embedding_lookup_gradient_is_float32_scatter():
  table = (jax.random.normal(jax.random.key(2), (V, D)) * 0.3).astype(jnp.bfloat16)
  ids = jax.random.randint(jax.random.key(3), (4, 24), 0, 8)   # many repeats
  cot = jax.random.normal(jax.random.key(4), (4, 24, D), jnp.float32)
  f = lambda tb: jnp.sum(embedding_lookup(tb, ids).astype(jnp.float32) * cot)
  assert np.array_equal(np.asarray(embedding_lookup(table, ids)), np.asarray(table[ids]))
  got = jax.grad(f)(table)
  want = jnp.zeros((V, D), jnp.float32).at[ids.reshape(-1)].add(cot.reshape(-1, D))
  assert got.dtype == jnp.bfloat16
  assert_close(got.astype(jnp.float32), want, 5e-3, "embedding grad")
