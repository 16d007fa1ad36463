"""Gated DeltaNet on one device: chunk_gated_delta_rule and the float32 token loop against
the float64 numpy token loop (forward and a hand-written vjp,
zeco_jax.ops.gated_delta.reference), on single rows and on packed documents; strong
decay, what the backward keeps, the UT inverse, no LAPACK call, and argument errors.

Tolerances are relative norms: forward 1e-5, gradients 1e-4 in float32, 2e-2 in bf16.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import check_gdn_against_float64, check_gdn_documents, gdn_inputs, rel_err
from zeco_jax import chunk_gated_delta_rule, recurrent_gated_delta_rule
from zeco_jax.ops.gated_delta.op import l2norm

B, H, K, V = 2, 2, 8, 16


def test_recurrent_matches_float64():
  check_gdn_against_float64(recurrent_gated_delta_rule, *gdn_inputs(0, B, 40, H, K, V))


# T = 72 and 50 with chunk 16: the tail chunk is padded; with and without an initial state.
@pytest.mark.parametrize("T,initial", [(72, True), (50, False)])
def test_chunk_matches_float64(T, initial):
  op = functools.partial(chunk_gated_delta_rule, chunk_size=16)
  check_gdn_against_float64(op, *gdn_inputs(1, B, T, H, K, V, initial=initial))


def test_chunk_strong_decay_and_beta_near_one():
  # g down to -5 per token: the cumulative log-decay over a 64-token chunk reaches about
  # -160 (-320 at worst); beta up to 0.9999. Exponents are segment sums, never exp(+cumsum).
  inputs, weights = gdn_inputs(2, 1, 128, H, K, V, g_low=-5.0, beta_low=0.9,
                               beta_high=0.9999)
  check_gdn_against_float64(functools.partial(chunk_gated_delta_rule, chunk_size=64), inputs,
                            weights)


def test_chunk_bf16():
  op = functools.partial(chunk_gated_delta_rule, chunk_size=16)
  inputs, weights = gdn_inputs(3, B, 64, H, K, V, dtype=jnp.bfloat16)
  check_gdn_against_float64(op, inputs, weights, fwd_tol=2e-2, grad_tol=2e-2)


def test_use_qk_l2norm_normalises_inside():
  (q, k, v, g, beta, h0), _ = gdn_inputs(4, B, 32, H, K, V)
  raw_k = 3.0 * k + 0.5
  o1, s1 = jax.jit(lambda *a: chunk_gated_delta_rule(
      *a, initial_state=h0, chunk_size=16, output_final_state=True, use_qk_l2norm=True))(
          q, raw_k, v, g, beta)
  o2, s2 = jax.jit(lambda *a: recurrent_gated_delta_rule(
      *a, initial_state=h0, output_final_state=True))(l2norm(q), l2norm(raw_k), v, g, beta)
  assert rel_err(o1, o2) <= 1e-5 and rel_err(s1, s2) <= 1e-5


def test_backward_keeps_inputs_and_one_state_per_chunk():
  # The custom_vjp keeps the inputs and the state entering each chunk: nothing per token
  # beyond the inputs (a [B, T, H, K, V] state per token would be T / C times more).
  T, C = 256, 16
  (q, k, v, g, beta, h0), _ = gdn_inputs(5, 1, T, H, K, V)
  f = lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], chunk_size=C)[0]
  # Traced, not run: the residual's shapes (jax.eval_shape of the vjp's pytree).
  leaves = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], q, k, v, g, beta, h0))
  inputs = sum(x.size for x in (q, k, v, g, beta, h0))
  beyond = sum(x.size for x in leaves) - inputs
  assert beyond <= (T // C) * H * K * V, (beyond, [x.shape for x in leaves])
  assert not any(x.size >= T * H * K * V for x in leaves), [x.shape for x in leaves]


# Documents of 1-30 tokens, a start inside and on chunk boundaries, padding (-1) in the
# middle and at the end; T = 72, chunk 16 (a padded tail chunk).
DOC_IDS = np.array([[0] * 5 + [1] * 11 + [2] * 16 + [-1] * 3 + [3] * 30 + [4] + [-1] * 6,
                    [7] * 20 + [8] * 12 + [9] * 30 + [10] * 10])


@pytest.mark.parametrize("op", [recurrent_gated_delta_rule,
                                functools.partial(chunk_gated_delta_rule, chunk_size=16)],
                         ids=["recurrent", "chunk"])
def test_segment_ids_match_per_document_float64(op):
  check_gdn_documents(op, *gdn_inputs(7, B, 72, H, K, V), DOC_IDS)


def test_argument_errors():
  (q, k, v, g, beta, h0), _ = gdn_inputs(6, B, 32, H, K, V)
  with pytest.raises(ValueError, match=r"`g` \(log-decay per head"):
    chunk_gated_delta_rule(q, k, v, jnp.zeros((B, 32, H, K)), beta)
  with pytest.raises(ValueError, match=r"`beta` must be \[B, T, H\]"):
    chunk_gated_delta_rule(q, k, v, g, beta[..., None])
  with pytest.raises(ValueError, match="chunk_size"):
    chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)
  with pytest.raises(ValueError, match="initial_state"):
    chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0[..., :4])


@pytest.mark.parametrize("C", [16, 48, 64])
def test_ut_inverse_matches_float64(C):
  from zeco_jax._chunks import unit_lower_inverse
  A = np.tril(np.random.default_rng(C).uniform(-1, 1, (3, C, C)), -1)
  X = jax.jit(unit_lower_inverse)(jnp.asarray(A, jnp.float32))
  assert rel_err(X, np.linalg.inv(np.eye(C) + A)) <= 1e-5


def test_chunked_form_has_no_lapack_call():
  """No triangular solve (a LAPACK call on CPU, which waited on the thread pool the
  simulated devices' collectives hold, and hung zeco_gated_delta_rule on jax 0.10.2)."""
  (q, k, v, g, beta, h0), _ = gdn_inputs(5, 1, 64, 1, K, V)
  fn = jax.grad(lambda *a: jnp.sum(chunk_gated_delta_rule(*a, initial_state=h0)[0]),
                argnums=(0, 1, 2, 3, 4))
  text = jax.jit(fn).lower(q, k, v, g, beta).as_text()
  assert "triangular_solve" not in text and "custom_call" not in text
