"""GLA's two reference forms (zeco_jax.ops.gla.reference): the float32 token-by-token
recurrence, which is the definition, and the exact chunked form, each against the
recurrence in float64 (``gla_float64``, what ``check_gla_against_recurrence`` holds every
GLA op to)."""
import jax.numpy as jnp
import pytest

from helpers import check_gla_against_recurrence, gla_inputs, rel_err
from zeco_jax import chunk_gla_reference, recurrent_gla


@pytest.mark.parametrize("decay", ["dim", "scalar", None])
def test_chunked_reference_matches_recurrence(decay):
  # T = 50 is not a multiple of the chunk size 16: padding must not change the state.
  check_gla_against_recurrence(chunk_gla_reference, 0, 2, 50, 2, 8, 16, decay=decay,
                               chunk_size=16)


@pytest.mark.parametrize("decay,initial", [("dim", True), ("scalar", True), (None, False)])
def test_float32_recurrence_matches_float64(decay, initial):
  # recurrent_gla: the definition, and the reference some tests compare with directly.
  check_gla_against_recurrence(recurrent_gla, 1, 2, 50, 2, 8, 16, decay=decay,
                               initial=initial)


def test_recurrence_is_the_definition():
  # One token by hand: S_1 = diag(e^g) h0 + k v^T, o_1 = scale * S_1^T q.
  q, k, v, g, h0 = gla_inputs(1, B=1, T=1, H=1, K=4, V=3)
  o, s = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
  S = jnp.exp(g[0, 0, 0])[:, None] * h0[0, 0] + jnp.outer(k[0, 0, 0], v[0, 0, 0])
  assert rel_err(s[0, 0], S) <= 1e-6
  assert rel_err(o[0, 0, 0], 0.5 * S.T @ q[0, 0, 0]) <= 1e-6


def test_final_state_is_none_unless_asked():
  q, k, v, g, _ = gla_inputs(2, T=8)
  for op in (recurrent_gla, chunk_gla_reference):
    assert op(q, k, v, g)[1] is None
