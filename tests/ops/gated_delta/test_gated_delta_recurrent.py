"""fused_recurrent_gated_delta_rule (zeco_jax.ops.gated_delta.recurrent), the decoding op:
against the float64 token loop; a prompt through chunk_gated_delta_rule with its final
state, then the next tokens one at a time, equals the chunked op over the whole sequence
(documents, an initial state, l2-normalised q and k in the op). Bars (relative norm,
float32): 1e-5."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import gdn_inputs, rel_err
from zeco_jax import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from zeco_jax.ops.gated_delta.reference import gdn_float64


@pytest.mark.parametrize("T,K,V", [(1, 64, 64), (29, 32, 16), (4, 128, 128)])
def test_equals_float64(T, K, V):
  inputs, weights = gdn_inputs(0, 2, T, 2, K, V)
  o64, s64, _ = gdn_float64(*inputs, *weights)
  q, k, v, g, beta, h0 = inputs
  o, s = jax.jit(fused_recurrent_gated_delta_rule, static_argnames="output_final_state")(
      q, k, v, g, beta, initial_state=h0, output_final_state=True)
  assert rel_err(o, o64) <= 1e-5 and rel_err(s, s64) <= 1e-5


@pytest.mark.parametrize("documents", [False, True], ids=["one-sequence", "documents"])
def test_prefill_then_decode_equals_the_chunked_op(documents):
  T0, T1 = 66, 5
  (q, k, v, g, beta, h0), _ = gdn_inputs(1, 2, T0 + T1, 2, 64, 64)
  q, k = q * 3.0, k * 2.0                 # not unit-norm: the ops normalise them
  ids = None
  if documents:
    ids = np.zeros((2, T0 + T1), np.int32)
    ids[0, 40:] = 1
    ids[1, :7] = -1
    ids = jnp.asarray(ids)
  kw = dict(use_qk_l2norm=True, output_final_state=True)
  o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, segment_ids=ids,
                                        **kw)
  cut = lambda a, b: [x[:, a:b] for x in (q, k, v, g, beta)]
  o0, s = chunk_gated_delta_rule(*cut(0, T0), initial_state=h0,
                                 segment_ids=None if ids is None else ids[:, :T0], **kw)
  outs = [o0]
  for t in range(T0, T0 + T1):
    o_t, s = fused_recurrent_gated_delta_rule(*cut(t, t + 1), initial_state=s, **kw)
    outs.append(o_t)
  assert rel_err(jnp.concatenate(outs, 1), o_all) <= 1e-5
  assert rel_err(jnp.concatenate(outs[1:], 1), o_all[:, T0:]) <= 1e-5
  assert rel_err(s, s_all) <= 1e-5


def test_bad_beta_names_the_argument():
  (q, k, v, g, beta, _), _ = gdn_inputs(0, 1, 3, 2, 8, 8)
  with pytest.raises(ValueError, match="beta"):
    fused_recurrent_gated_delta_rule(q, k, v, g, beta[..., None])
