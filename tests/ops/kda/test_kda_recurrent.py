"""fused_recurrent_kda (zeco_jax.ops.kda.recurrent), the decoding op: against the float64
token loop; a prompt through chunk_kda with its final state, then the next tokens one at
a time, equals the chunked op over the whole sequence (packed documents in one row, an
initial state, l2-normalised q and k in the op). Bars (relative norm, float32): 1e-5."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import kda_inputs, rel_err, rel_err64
from zeco_jax import chunk_kda, fused_recurrent_kda
from zeco_jax.ops.kda.reference import kda_float64

STATIC = ("output_final_state", "use_qk_l2norm")


@pytest.mark.parametrize("T,K,V", [(1, 64, 64), (29, 32, 16), (4, 128, 128)])
def test_equals_float64(T, K, V):
  inputs, weights = kda_inputs(0, 2, T, 2, K, V)
  o64, s64, _ = kda_float64(*inputs, *weights)
  q, k, v, g, beta, h0 = inputs
  o, s = jax.jit(fused_recurrent_kda, static_argnames=STATIC)(
      q, k, v, g, beta, initial_state=h0, output_final_state=True)
  assert rel_err64(o, o64) <= 1e-5 and rel_err64(s, s64) <= 1e-5


def test_prefill_then_decode_equals_the_chunked_op():
  # Row 0: a document starts at t = 40 of the prompt; row 1: 7 padding tokens, then one
  # document (the initial state is dropped at its start). Both continue into the decode.
  T0, T1 = 66, 5
  (q, k, v, g, beta, h0), _ = kda_inputs(1, 2, T0 + T1, 2, 64, 64)
  q, k = q * 3.0, k * 2.0                 # not unit-norm: the ops normalise them
  ids = np.zeros((2, T0 + T1), np.int32)
  ids[0, 40:] = 1
  ids[1, :7] = -1
  ids = jnp.asarray(ids)
  chunked = jax.jit(functools.partial(chunk_kda, use_qk_l2norm=True, output_final_state=True))
  step = jax.jit(functools.partial(fused_recurrent_kda, use_qk_l2norm=True,
                                   output_final_state=True))
  o_all, s_all = chunked(q, k, v, g, beta, initial_state=h0, segment_ids=ids)
  cut = lambda a, b: [x[:, a:b] for x in (q, k, v, g, beta)]
  o0, s = chunked(*cut(0, T0), initial_state=h0, segment_ids=ids[:, :T0])
  outs = [o0]
  for t in range(T0, T0 + T1):
    o_t, s = step(*cut(t, t + 1), initial_state=s)
    outs.append(o_t)
  assert rel_err(jnp.concatenate(outs, 1), o_all) <= 1e-5
  assert rel_err(jnp.concatenate(outs[1:], 1), o_all[:, T0:]) <= 1e-5
  assert rel_err(s, s_all) <= 1e-5


def test_bad_arguments_name_the_argument():
  (q, k, v, g, beta, _), _ = kda_inputs(0, 1, 3, 2, 8, 8)
  with pytest.raises(ValueError, match="beta"):
    fused_recurrent_kda(q, k, v, g, beta[..., None])
  with pytest.raises(ValueError, match=r"`g` \(log-decay per key channel"):
    fused_recurrent_kda(q, k, v, g[..., 0], beta)
