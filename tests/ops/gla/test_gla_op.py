"""chunk_gla (backend="jax") against the token-by-token reference: float32 and bf16, strong
decay, what its backward keeps, the backend contract (g reaches the chunked backend as
given), and its argument errors."""
import jax
import jax.numpy as jnp
import pytest

from helpers import check_gla_against_recurrence, cotangents, gla_inputs, loss_and_grads, rel_err
from zeco_jax import chunk_gla, recurrent_gla
from zeco_jax.ops.gla import chunked


@pytest.mark.parametrize("decay,initial", [("dim", True), ("scalar", True), (None, False)])
def test_chunk_gla_matches_recurrence(decay, initial):
  # T = 100 with chunk 32: a partial last chunk; K != V. Float32: forward 1e-5, grads 1e-4.
  check_gla_against_recurrence(chunk_gla, 10, 2, 100, 2, 8, 16, decay=decay, initial=initial,
                               chunk_size=32, backend="jax")


def test_chunk_gla_bf16():
  B, T, H, K, V = 1, 64, 2, 16, 16
  q, k, v, g, h0 = gla_inputs(11, B, T, H, K, V, dtype=jnp.bfloat16)
  w_o, w_s = cotangents(11, B, T, H, K, V)
  o_r, s_r, g_r = loss_and_grads(recurrent_gla, q, k, v, g, h0, w_o, w_s)
  o_c, s_c, g_c = loss_and_grads(chunk_gla, q, k, v, g, h0, w_o, w_s, backend="jax")
  assert o_c.dtype == jnp.bfloat16 and s_c.dtype == jnp.float32
  assert rel_err(o_c, o_r) <= 2e-2
  for name in g_r:
    assert g_c[name].dtype == g_r[name].dtype
    assert rel_err(g_c[name], g_r[name]) <= 2e-2, name


def test_strong_decay_stays_finite():
  # log-decay -5 per token over 4096 tokens: exp(-b) would overflow inside one chunk.
  B, T, H, K, V = 1, 4096, 1, 16, 16
  q, k, v, _, _ = gla_inputs(12, B, T, H, K, V)
  g = jnp.full((B, T, H, K), -5.0)

  def loss(q, k, v, g):
    o, s = chunk_gla(q, k, v, g, output_final_state=True, backend="jax")
    return jnp.sum(o) + jnp.sum(s), (o, s)

  (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, g)
  for x in (o, s, *grads):
    assert bool(jnp.all(jnp.isfinite(x)))
  o_ref, _ = recurrent_gla(q, k, v, g)
  assert rel_err(o, o_ref) <= 1e-5


def test_backward_keeps_no_per_token_states():
  # What the backward keeps from the forward (the vjp's residuals) is O(T (K + V)),
  # never a [T, K, V] stack of per-token states.
  B, T, H, K, V = 1, 256, 2, 16, 32
  q, k, v, g, h0 = gla_inputs(13, B, T, H, K, V)
  f = lambda *a: chunk_gla(*a[:4], initial_state=a[4], backend="jax")[0]
  # Traced, not run: the residual's shapes (jax.eval_shape of the vjp's pytree).
  residual = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], q, k, v, g, h0)
  residual_elems = sum(x.size for x in jax.tree.leaves(residual))
  inputs_elems = sum(x.size for x in (q, k, v, g, h0))
  assert residual_elems <= 2 * inputs_elems, (residual_elems, inputs_elems)
  assert residual_elems < B * T * H * K * V


@pytest.mark.parametrize("decay", ["dim", "scalar", None])
def test_backends_receive_g_as_given(monkeypatch, decay):
  """The backend contract: g reaches fwd / bwd per-dim, per-head scalar or None, not
  broadcast; the custom_vjp's dg has g's own shape. Shapes only: traced
  (``jax.eval_shape``), not run."""
  seen = []
  fwd, bwd = chunked.fwd, chunked.bwd

  def spy_fwd(q, k, v, g, **kw):
    seen.append(None if g is None else g.shape)
    return fwd(q, k, v, g, **kw)

  def spy_bwd(q, k, v, g, *rest, **kw):
    out = bwd(q, k, v, g, *rest, **kw)
    seen.append(None if out[3] is None else out[3].shape)
    return out

  monkeypatch.setattr(chunked, "fwd", spy_fwd)
  monkeypatch.setattr(chunked, "bwd", spy_bwd)
  q, k, v, g, _ = gla_inputs(18, 1, 32, 2, 8, 16, decay=decay)

  def dg_of(q, k, v, g):
    (o, _), vjp = jax.vjp(lambda *a: chunk_gla(*a, chunk_size=32, backend="jax"), q, k, v, g)
    return vjp((jnp.ones_like(o), None))[3]

  dg = jax.eval_shape(dg_of, q, k, v, g)
  expected = None if g is None else g.shape
  assert seen == [expected, expected]
  assert (dg is None) if g is None else (dg.shape == g.shape)


@pytest.mark.parametrize("make_args,match", [
    (lambda q, k, v, g: (q[..., :4], k, v, g), "`q` and `k` must have the same shape"),
    (lambda q, k, v, g: (q, k, v[:, :5], g), "`v` must be"),
    (lambda q, k, v, g: (q, k, v.astype(jnp.bfloat16), g), "share one dtype"),
    (lambda q, k, v, g: (q[0], k[0], v[0], g), "must be 4-D"),
    (lambda q, k, v, g: (q, k, v, g[..., :3]), "`g` \\(log-decay\\) must be"),
])
def test_bad_shapes_raise_value_error(make_args, match):
  q, k, v, g, _ = gla_inputs(14, T=32)
  with pytest.raises(ValueError, match=match):
    chunk_gla(*make_args(q, k, v, g))


def test_bad_options_raise_value_error():
  q, k, v, g, h0 = gla_inputs(15, T=32)
  with pytest.raises(ValueError, match="initial_state"):
    chunk_gla(q, k, v, g, initial_state=h0[:, :1])
  with pytest.raises(ValueError, match="chunk_size"):
    chunk_gla(q, k, v, g, chunk_size=20)
  with pytest.raises(ValueError, match="backend"):
    chunk_gla(q, k, v, g, backend="cuda")
  with pytest.raises(ValueError, match="kernel_config"):
    chunk_gla(q, k, v, g, kernel_config="fast")
  with pytest.raises(ValueError, match="scale"):
    chunk_gla(q, k, v, g, scale="0.5")


def test_errors_are_raised_at_trace_time():
  q, k, v, g, _ = gla_inputs(16, T=32)
  with pytest.raises(ValueError, match="chunk_size"):
    jax.jit(lambda q: chunk_gla(q, k, v, g, chunk_size=20)[0]).lower(q)
