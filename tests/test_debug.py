"""zeco_jax.debug.checked: an op wrapped to report, under jit, inputs outside its contract
(a positive GLA log-decay; a Gated DeltaNet key that is not unit-norm, a positive
log-decay, a write strength outside [0, 1]) and nothing for valid inputs."""
import jax
import pytest

import zeco_jax
from helpers import gdn_inputs, gla_inputs
from zeco_jax import chunk_gated_delta_rule, chunk_gla


def test_checked_reports_positive_log_decay():
  q, k, v, g, _ = gla_inputs(17, T=32)
  checked = jax.jit(zeco_jax.debug.checked(chunk_gla))
  err, _ = checked(q, k, v, g)
  err.throw()                                   # valid input: no error
  err, _ = checked(q, k, v, g.at[0, 3, 1, 2].set(0.5))
  with pytest.raises(Exception, match="must be <= 0"):
    err.throw()


def test_debug_checked_reports_inputs_outside_the_contract():
  (q, k, v, g, beta, _), _ = gdn_inputs(6, 1, 16, 1, 8, 16, initial=False)
  checked = jax.jit(zeco_jax.debug.checked(chunk_gated_delta_rule),
                    static_argnames="use_qk_l2norm")
  assert checked(q, k, v, g, beta)[0].get() is None
  err = checked(q, 3 * k, v, g, beta)[0].get()
  assert "`k` must be unit-norm" in err and "use_qk_l2norm=True" in err
  assert checked(q, 3 * k, v, g, beta, use_qk_l2norm=True)[0].get() is None
  assert "`g` (log-decay) must be <= 0" in checked(q, k, v, -g, beta)[0].get()
  assert "`beta` (write strength) must be in [0, 1]" in checked(q, k, v, g, 2 * beta)[0].get()
