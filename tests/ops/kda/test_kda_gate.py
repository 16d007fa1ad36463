"""kda_gate (zeco_jax.ops.kda.gate), FLA's KDA gate, against the formulas in numpy float64:
``-exp(A_log) softplus(g + dt_bias)`` and the lower-bound form ``lower_bound
sigmoid(exp(A_log) (g + dt_bias))`` (with and without A_log); the gradients against FLA's
hand-written backward (``kda_gate_bwd_kernel``); argument errors. Bars (relative norm,
float32): 1e-6 for the values, 1e-5 for the gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err64
from zeco_jax import kda_gate

B, T, H, K = 2, 5, 3, 4


def _inputs(seed=0):
  r = np.random.default_rng(seed)
  g = 4.0 * r.standard_normal((B, T, H, K))           # softplus's both ends: -12 .. 12
  A_log = r.uniform(-2.0, 2.5, H)
  dt_bias = r.standard_normal(H * K)
  dy = r.standard_normal((B, T, H, K))
  return g, A_log, dt_bias, dy


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("bias", [True, False])
def test_softplus_form_matches_numpy(bias):
  g, A_log, dt_bias, dy = _inputs()
  x = g + (dt_bias.reshape(H, K) if bias else 0.0)
  rate = np.exp(A_log)[:, None]
  want = -rate * np.logaddexp(0.0, x)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  args = (f32(g), f32(A_log), f32(dt_bias) if bias else None)
  got = kda_gate(*args)
  assert got.dtype == jnp.float32 and got.shape == g.shape
  assert rel_err64(got, want) <= 1e-6 and np.all(np.asarray(got) <= 0)
  # FLA's backward: dg = -exp(A_log) sigmoid(x) dy, dA_log = sum(dy * y) per head,
  # dt_bias = dg summed over the leading axes.
  dg_want = -rate * _sigmoid(x) * dy
  loss = lambda *a: jnp.sum(kda_gate(*a) * f32(dy))
  grads = jax.grad(loss, argnums=(0, 1, 2) if bias else (0, 1))(*args)
  assert rel_err64(grads[0], dg_want) <= 1e-5
  assert rel_err64(grads[1], np.sum(dy * want, axis=(0, 1, 3))) <= 1e-5
  if bias:
    assert rel_err64(grads[2], dg_want.sum(axis=(0, 1)).reshape(H * K)) <= 1e-5


@pytest.mark.parametrize("with_A", [True, False])
def test_lower_bound_form_matches_numpy(with_A):
  g, A_log, dt_bias, dy = _inputs(1)
  x = g + dt_bias.reshape(H, K)
  rate = np.exp(A_log)[:, None] if with_A else 1.0
  s = _sigmoid(rate * x)
  want = -5.0 * s
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  A = f32(A_log) if with_A else None
  got = kda_gate(f32(g), A, f32(dt_bias), lower_bound=-5.0)
  assert rel_err64(got, want) <= 1e-6
  assert np.all(np.asarray(got) <= 0) and np.all(np.asarray(got) >= -5.0)
  # FLA's backward: d_inner = dy lower_bound s (1 - s); dg = d_inner * rate;
  # dA_log = sum(dg * x) per head.
  dg_want = dy * (-5.0) * s * (1 - s) * rate
  grads = jax.grad(lambda g, b: jnp.sum(kda_gate(g, A, b, lower_bound=-5.0) * f32(dy)),
                   argnums=(0, 1))(f32(g), f32(dt_bias))
  assert rel_err64(grads[0], dg_want) <= 1e-5
  assert rel_err64(grads[1], dg_want.sum(axis=(0, 1)).reshape(H * K)) <= 1e-5
  if with_A:
    dA = jax.grad(lambda a: jnp.sum(kda_gate(f32(g), a, f32(dt_bias), lower_bound=-5.0)
                                    * f32(dy)))(A)
    assert rel_err64(dA, np.sum(dg_want * x, axis=(0, 1, 3))) <= 1e-5


def test_bf16_projection_gives_float32():
  g, A_log, dt_bias, _ = _inputs(2)
  got = kda_gate(jnp.asarray(g, jnp.bfloat16), jnp.asarray(A_log), jnp.asarray(dt_bias))
  assert got.dtype == jnp.float32


def test_argument_errors():
  g, A_log, dt_bias, _ = _inputs()
  with pytest.raises(ValueError, match=r"`A_log` must have H = 3 elements"):
    kda_gate(g, A_log[:2])
  with pytest.raises(ValueError, match=r"`dt_bias` must have H \* K = 12 elements"):
    kda_gate(g, A_log, dt_bias[:K])
  with pytest.raises(ValueError, match="`A_log` is None, which needs `lower_bound`"):
    kda_gate(g, None)
  with pytest.raises(ValueError, match="`lower_bound` must be a negative number"):
    kda_gate(g, A_log, lower_bound=5.0)
  with pytest.raises(ValueError, match="`g` must be a floating array"):
    kda_gate(np.zeros((B, T, H, K), np.int32), A_log)
