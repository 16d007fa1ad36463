"""fused_recurrent_gla (zeco_jax.ops.gla.recurrent), the decoding op: against the spec
(recurrent_gla) and a float64 token loop with the value-side decay gv; a prompt through
chunk_gla with its final state, then the next tokens through fused_recurrent_gla, equals
chunk_gla over the whole sequence (documents and an initial state too); jit and eager.
Bars (relative norm, float32): 1e-5."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import gla_inputs, rel_err
from zeco_jax import chunk_gla, fused_recurrent_gla, recurrent_gla


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("T,K,V", [(1, 64, 64), (37, 16, 32), (5, 128, 128)])
def test_equals_the_spec(T, K, V, jit):
  q, k, v, g, h0 = gla_inputs(0, B=2, T=T, H=2, K=K, V=V)
  op = jax.jit(fused_recurrent_gla, static_argnames="output_final_state") if jit else \
      fused_recurrent_gla
  o, s = op(q, k, v, g, initial_state=h0, output_final_state=True)
  o_r, s_r = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
  assert rel_err(o, o_r) <= 1e-5 and rel_err(s, s_r) <= 1e-5


def test_value_side_decay_against_float64():
  q, k, v, g, h0 = gla_inputs(1, B=1, T=9, H=2, K=8, V=16)
  gv = jnp.asarray(np.log(np.random.default_rng(2).uniform(0.5, 1.0, v.shape)), jnp.float32)
  o, s = fused_recurrent_gla(q, k, v, g, gv, scale=0.3, initial_state=h0,
                             output_final_state=True)
  f64 = lambda x: np.asarray(x, np.float64)
  S = f64(h0)
  want = np.zeros(v.shape)
  for t in range(q.shape[1]):
    S = np.exp(f64(g[:, t]))[..., :, None] * S * np.exp(f64(gv[:, t]))[..., None, :]
    S = S + f64(k[:, t])[..., :, None] * f64(v[:, t])[..., None, :]
    want[:, t] = 0.3 * np.einsum("bhk,bhkv->bhv", f64(q[:, t]), S)
  assert rel_err(o, want) <= 1e-5 and rel_err(s, S) <= 1e-5


@pytest.mark.parametrize("documents", [False, True], ids=["one-sequence", "documents"])
def test_prefill_then_decode_equals_chunk_gla(documents):
  T0, T1 = 70, 6
  q, k, v, g, h0 = gla_inputs(3, B=2, T=T0 + T1, H=2, K=64, V=64)
  ids = None
  if documents:     # row 0: a document ends inside the prompt; row 1: leading padding
    ids = np.zeros((2, T0 + T1), np.int32)
    ids[0, 30:] = 1
    ids[1, :12] = -1
    ids = jnp.asarray(ids)
  o_all, s_all = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True,
                           segment_ids=ids)
  cut = lambda x, a, b: x[:, a:b]
  o0, s = chunk_gla(*(cut(x, 0, T0) for x in (q, k, v, g)), initial_state=h0,
                    output_final_state=True,
                    segment_ids=None if ids is None else ids[:, :T0])
  step = jax.jit(fused_recurrent_gla, static_argnames="output_final_state")
  outs = [o0]
  for t in range(T0, T0 + T1):
    o_t, s = step(*(cut(x, t, t + 1) for x in (q, k, v, g)), initial_state=s,
                  output_final_state=True)
    outs.append(o_t)
  assert rel_err(jnp.concatenate(outs, 1), o_all) <= 1e-5
  assert rel_err(jnp.concatenate(outs[1:], 1), o_all[:, T0:]) <= 1e-5
  assert rel_err(s, s_all) <= 1e-5


def test_bad_decay_shapes_name_the_argument():
  q, k, v, g, _ = gla_inputs(0, B=1, T=3, H=2, K=8, V=16)
  with pytest.raises(ValueError, match="`gk` must be"):
    fused_recurrent_gla(q, k, v, g[..., 0])
  with pytest.raises(ValueError, match="`gv` must be"):
    fused_recurrent_gla(q, k, v, g, g)
