"""chunk_gla (backend="jax") against the token-by-token reference, and its contracts:
the backend contract (g as given), dispatch by the target platform."""
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeco_jax
from helpers import abstract_mesh, cotangents, gla_inputs, loss_and_grads, rel_err
from zeco_jax import chunk_gla, recurrent_gla
from zeco_jax.ops import _dispatch
from zeco_jax.ops.gla import chunked
from zeco_jax.runtime import target
from zeco_jax.ops.gla.op import resolve_backend


@pytest.mark.parametrize("decay,initial", [("dim", True), ("scalar", True), (None, False)])
def test_chunk_gla_matches_recurrence(decay, initial):
  # T = 100 with chunk 32: a partial last chunk; K != V.
  B, T, H, K, V = 2, 100, 2, 8, 16
  q, k, v, g, h0 = gla_inputs(10, B, T, H, K, V, decay=decay, initial_state=initial)
  w_o, w_s = cotangents(10, B, T, H, K, V)
  o_r, s_r, g_r = loss_and_grads(recurrent_gla, q, k, v, g, h0, w_o, w_s)
  o_c, s_c, g_c = loss_and_grads(chunk_gla, q, k, v, g, h0, w_o, w_s, chunk_size=32,
                                 backend="jax")
  assert rel_err(o_c, o_r) <= 1e-5          # float32 forward
  assert rel_err(s_c, s_r) <= 1e-5
  assert set(g_c) == set(g_r)
  for name in g_r:                          # float32 gradients
    assert g_c[name].shape == g_r[name].shape, name
    assert rel_err(g_c[name], g_r[name]) <= 1e-4, name


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
  _, vjp_fn = jax.vjp(lambda *a: chunk_gla(*a[:4], initial_state=a[4], backend="jax")[0],
                      q, k, v, g, h0)
  residual_elems = sum(x.size for x in jax.tree.leaves(vjp_fn))
  inputs_elems = sum(x.size for x in (q, k, v, g, h0))
  assert residual_elems <= 2 * inputs_elems, (residual_elems, inputs_elems)
  assert residual_elems < B * T * H * K * V


def test_auto_backend_is_jax_on_cpu():
  assert resolve_backend("auto") == "jax"
  assert resolve_backend("auto", platform="cpu") == "jax"


@pytest.mark.parametrize("decay", ["dim", "scalar", None])
def test_backends_receive_g_as_given(monkeypatch, decay):
  """The backend contract: g reaches fwd / bwd per-dim, per-head scalar or None, not
  broadcast; the custom_vjp's dg has g's own shape."""
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
  (o, _), vjp = jax.vjp(lambda *a: chunk_gla(*a, chunk_size=32, backend="jax"), q, k, v, g)
  dg = vjp((jnp.ones_like(o), None))[3]
  expected = None if g is None else g.shape
  assert seen == [expected, expected]
  assert (dg is None) if g is None else (dg.shape == g.shape)


def test_resolve_backend_follows_the_platform():
  """'auto' picks by the target platform given (no such device needed): Pallas on gpu and
  tpu, jnp on cpu, all silently; 'pallas' and 'jax' are honoured."""
  _dispatch.say_jax_fallback.cache_clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert resolve_backend("auto", platform="gpu") == "pallas"
    assert resolve_backend("auto", platform="cpu") == "jax"
    assert resolve_backend("auto", platform="tpu") == "pallas"
    assert resolve_backend("auto", platform="tpu", name="zeco_gla") == "pallas"
    assert not caught
  for platform in ("cpu", "gpu", "tpu"):
    assert resolve_backend("pallas", platform=platform) == "pallas"
    assert resolve_backend("jax", platform=platform) == "jax"
  with pytest.raises(ValueError, match="platform"):
    resolve_backend("auto", platform="cuda")


def test_platform_of_a_mesh():
  """The mesh decides the platform and the core count: a CPU mesh of the simulated
  devices, and a stand-in mesh of GPU devices (only its devices' attributes are read)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("seq",))
  q = jnp.ones((1, 16, 1, 8))
  assert target.platform_of(q, mesh=mesh) == "cpu"
  gpu = types.SimpleNamespace(platform="cuda", core_count=132)
  gpu_mesh = types.SimpleNamespace(devices=np.array([gpu, gpu], dtype=object))
  assert target.target_of(q, mesh=gpu_mesh) == target.Target("gpu", 132)
  assert resolve_backend("auto", platform=target.platform_of(q, mesh=gpu_mesh)) == "pallas"


def _traced(mesh, backend, **kw):
  """chunk_gla's forward + backward traced (not run) for the context ``mesh``'s target."""
  sd = jax.ShapeDtypeStruct
  args = [sd((1, 64, 1, 64), jnp.bfloat16)] * 2 + [sd((1, 64, 1, 64), jnp.bfloat16),
                                                   sd((1, 64, 1, 64), jnp.float32)]

  def loss(q, k, v, g):
    return jnp.sum(chunk_gla(q, k, v, g, backend=backend, **kw)[0].astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(mesh):
    return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args))


def test_chunk_gla_dispatches_by_the_target_mesh():
  """A program traced for a GPU or TPU target on this CPU host gets that target's
  kernels: compiled (not interpreted) Triton launches for the GPU with the state-walk
  tiles chosen for its SM count; the Mosaic TPU kernels for a TPU under 'auto' and
  'pallas', the jnp path under 'jax'."""
  gpu = _traced(abstract_mesh("gpu", "NVIDIA H200", 132), "auto")
  assert "pallas_call" in gpu and "interpret=True" not in gpu
  assert "num_warps=4" in gpu and "gla_state_grad_pass" in gpu
  tpu = abstract_mesh("tpu", "TPU v5 lite", 1)
  assert "gla_tpu_fwd" in _traced(tpu, "auto")
  assert "gla_tpu_fwd" in _traced(tpu, "pallas")
  assert "pallas_call" not in _traced(tpu, "jax")


def test_broken_kernel_package_raises(monkeypatch):
  """An ImportError inside pallas_kernels surfaces; it never turns into the jnp path."""
  kernels = pytest.importorskip("pallas_kernels")

  def broken(family, platform):
    raise ImportError(f"{family} kernels for {platform} failed to import")

  monkeypatch.setattr(kernels, "backend", broken)
  q, k, v, g, _ = gla_inputs(19, T=32)
  with pytest.raises(ImportError, match="failed to import"):
    chunk_gla(q, k, v, g, backend="pallas")
  with pytest.raises(ImportError, match="failed to import"):
    resolve_backend("auto", platform="gpu")
  chunk_gla(q, k, v, g, backend="jax")            # the jnp path does not need the kernels


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


def test_checked_reports_positive_log_decay():
  q, k, v, g, _ = gla_inputs(17, T=32)
  checked = jax.jit(zeco_jax.debug.checked(chunk_gla))
  err, _ = checked(q, k, v, g)
  err.throw()                                   # valid input: no error
  err, _ = checked(q, k, v, g.at[0, 3, 1, 2].set(0.5))
  with pytest.raises(Exception, match="must be <= 0"):
    err.throw()
