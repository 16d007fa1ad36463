"""Pallas kernels (interpret mode on CPU) against the reference GLA.

Tolerances (issue 3): float32 <= 1e-5 forward, <= 1e-4 gradients; bf16 <= 2e-2. Shapes
are tiny (the interpreter runs every grid point), but cover K != V, K and V of 64/128/256,
T not a multiple of 64, strong decay, scalar and no decay, initial and final states.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err
from zeco_jax import chunk_gla, recurrent_gla
from zeco_jax import ops

pallas_kernels = pytest.importorskip("pallas_kernels")


def _inputs(seed, B, T, H, K, V, *, decay="strong", dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  q = jax.random.normal(keys[0], (B, T, H, K), jnp.float32)
  k = jax.random.normal(keys[1], (B, T, H, K), jnp.float32)
  v = jax.random.normal(keys[2], (B, T, H, V), jnp.float32)
  x = jax.random.normal(keys[3], (B, T, H, K), jnp.float32)
  if decay == "strong":     # up to ~ -9 per token: exp(-b) overflows inside one chunk
    g = 4.0 * jax.nn.log_sigmoid(x) - 3.0 * jax.random.uniform(keys[4], x.shape)
  elif decay == "mild":     # the benchmark's logsigmoid / 16
    g = jax.nn.log_sigmoid(x) / 16
  elif decay == "scalar":
    g = jax.nn.log_sigmoid(x[..., 0]) * 2.0
  else:
    g = None
  h0 = jax.random.normal(keys[5], (B, H, K, V), jnp.float32)
  cast = lambda a: a.astype(dtype)
  return cast(q), cast(k), cast(v), g, h0, keys[6]


def _loss_terms(fn, q, k, v, g, h0, key):
  """Forward (o, final) and the vjp of a random cotangent w.r.t. q, k, v, g, h0."""
  def f(q, k, v, g, h0):
    return fn(q, k, v, g, initial_state=h0, output_final_state=True)

  (o, final), vjp = jax.vjp(f, q, k, v, g, h0)
  kd, kf = jax.random.split(key)
  do = jax.random.normal(kd, o.shape, jnp.float32).astype(o.dtype)
  dfinal = jax.random.normal(kf, final.shape, jnp.float32)
  return o, final, vjp((do, dfinal))


def _pallas(q, k, v, g, **kw):
  return chunk_gla(q, k, v, g, backend="pallas", **kw)


def _reference(q, k, v, g, **kw):
  return recurrent_gla(q, k, v, g, **kw)


@pytest.mark.parametrize("B,T,H,K,V,decay", [
    (1, 100, 1, 64, 128, "strong"),     # T not a multiple of 64, K != V
    (1, 80, 1, 128, 64, "strong"),
    (1, 64, 1, 256, 256, "mild"),
    (1, 48, 1, 64, 64, "scalar"),
    (1, 40, 1, 64, 64, None),
])
def test_pallas_float32_matches_reference(B, T, H, K, V, decay):
  q, k, v, g, h0, key = _inputs(0, B, T, H, K, V, decay=decay)
  o, fin, grads = _loss_terms(_pallas, q, k, v, g, h0, key)
  o_r, fin_r, grads_r = _loss_terms(_reference, q, k, v, g, h0, key)
  assert rel_err(o, o_r) <= 1e-5
  assert rel_err(fin, fin_r) <= 1e-5
  names = ("dq", "dk", "dv", "dg", "dh0")
  for name, a, b in zip(names, grads, grads_r):
    if b is None:
      continue
    assert np.all(np.isfinite(np.asarray(a))), name
    assert rel_err(a, b) <= 1e-4, (name, rel_err(a, b))


@pytest.mark.parametrize("tune", [{}, {"diag_grads_in_input_dtype": True, "overlap_bwd": True,
                                      "states_in_input_dtype": False, "keep_states": True,
                                      "overlap_fwd": False}])
def test_pallas_bf16_matches_reference(monkeypatch, tune):
  from pallas_kernels import _common
  for name, value in tune.items():
    monkeypatch.setitem(_common.TUNE, name, value)
  q, k, v, g, h0, key = _inputs(1, 1, 96, 2, 64, 128, decay="mild", dtype=jnp.bfloat16)
  o, fin, grads = _loss_terms(_pallas, q, k, v, g, h0, key)
  f32 = lambda a: a.astype(jnp.float32)
  o_r, fin_r, grads_r = _loss_terms(_reference, f32(q), f32(k), f32(v), g, h0, key)
  assert o.dtype == jnp.bfloat16
  assert rel_err(o, o_r) <= 2e-2
  assert rel_err(fin, fin_r) <= 2e-2
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), grads, grads_r):
    assert rel_err(a, b) <= 2e-2, (name, rel_err(a, b))


def test_backend_contract_and_dispatch():
  """The backend object has chunked.fwd / bwd's signatures; 'auto' stays on jnp on CPU."""
  be = pallas_kernels.backend()
  assert callable(be.fwd) and callable(be.bwd)
  assert ops.resolve_backend("pallas") == "pallas"
  assert ops.resolve_backend("auto") == ("jax" if jax.default_backend() == "cpu" else "pallas")


def test_interpret_mode_switch(monkeypatch):
  from pallas_kernels import _common
  monkeypatch.setenv("ZECO_PALLAS_INTERPRET", "1")
  assert _common.interpret_mode()
  monkeypatch.setenv("ZECO_PALLAS_INTERPRET", "0")
  assert not _common.interpret_mode()
  monkeypatch.delenv("ZECO_PALLAS_INTERPRET")
  assert _common.interpret_mode() == (jax.default_backend() == "cpu")


def test_rejects_non_power_of_two_dims():
  q, k, v, g, h0, _ = _inputs(0, 1, 32, 1, 48, 64)
  with pytest.raises(ValueError, match="power of two"):
    chunk_gla(q, k, v, g, backend="pallas")



# --- Mosaic TPU variant (interpret mode here; never run on TPU hardware) ----------------

def _backend_terms(be, q, k, v, g, h0, key, C):
  B, T, H, K = q.shape
  g = jnp.zeros(q.shape, jnp.float32) if g is None else g
  kd, kf = jax.random.split(key)
  do = jax.random.normal(kd, v.shape, jnp.float32).astype(v.dtype)
  dht = jax.random.normal(kf, h0.shape, jnp.float32)
  kw = dict(scale=K ** -0.5, initial_state=h0, chunk_size=C)
  o, fin = be.fwd(q, k, v, g, **kw)
  return o, fin, be.bwd(q, k, v, g, do, dht, **kw)


@pytest.mark.parametrize("B,T,H,K,V,decay,dtype", [
    (1, 128, 1, 64, 128, "strong", jnp.float32),
    (1, 64, 1, 128, 64, "mild", jnp.bfloat16),
])
def test_tpu_variant_matches_jnp_path(B, T, H, K, V, decay, dtype):
  from pallas_kernels import tpu_backend
  from zeco_jax import chunked
  q, k, v, g, h0, key = _inputs(2, B, T, H, K, V, decay=decay, dtype=dtype)
  o, fin, grads = _backend_terms(tpu_backend, q, k, v, g, h0, key, 64)
  f32 = lambda a: a.astype(jnp.float32)
  o_r, fin_r, grads_r = _backend_terms(chunked, f32(q), f32(k), f32(v), g, h0, key, 64)
  fwd_tol, grad_tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 2e-2)
  assert rel_err(o, o_r) <= fwd_tol
  assert rel_err(fin, fin_r) <= fwd_tol
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), grads, grads_r):
    assert rel_err(a, b) <= grad_tol, (name, rel_err(a, b))


def test_tpu_variant_lowers_to_mosaic(monkeypatch):
  """jax-side lowering to Mosaic TPU (catches unsupported primitives); libtpu not involved."""
  tpu_info = pytest.importorskip("jax._src.tpu_info")
  monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
  monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
  monkeypatch.setenv("ZECO_PALLAS_INTERPRET", "0")
  from pallas_kernels import tpu_backend
  B, T, H, K, V = 1, 128, 1, 128, 128
  sd = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (sd((B, T, H, K), bf), sd((B, T, H, K), bf), sd((B, T, H, V), bf), sd((B, T, H, K), f32),
          sd((B, T, H, V), bf), sd((B, H, K, V), f32), sd((B, H, K, V), f32))

  def both(q, k, v, g, do, dht, h0):
    kw = dict(scale=0.1, initial_state=h0, chunk_size=64)
    return tpu_backend.fwd(q, k, v, g, **kw), tpu_backend.bwd(q, k, v, g, do, dht, **kw)

  text = jax.jit(both).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text


@pytest.mark.parametrize("kept", [False, True])
def test_gpu_launch_options_keep_results(monkeypatch, kept):
  """Launch options the benchmark sweeps (float32 states, other tiles, the state walks
  overlapped with chunk-parallel stages) compute the same function, both in the
  recomputing backward (``bwd``) and through ``fwd_res`` / ``bwd_res`` (what chunk_gla
  uses) with the forward's A and h kept."""
  from pallas_kernels import _common
  from zeco_jax import chunked
  for key, value in {"states_in_input_dtype": False, "state_bk": 32, "state_bv": 32,
                     "scores_kd": 32, "dqdk_bk": 16, "cumsum_kd": 32, "da_bv": 64,
                     "out_bv": 64, "dv_bv": 64, "overlap_fwd": not kept, "overlap_bwd": True,
                     "diag_kd": 64, "dqdk_diag_bk": 32, "keep_states": kept}.items():
    monkeypatch.setitem(_common.TUNE, key, value)
  be = pallas_kernels.backend()
  if kept:      # fwd / bwd through the residual pair
    res, impl = {}, be

    def fwd(*a, **kw):
      out, res["r"] = impl.fwd_res(*a, **kw)
      assert res["r"][1] is not None          # h kept
      return out

    be = types.SimpleNamespace(fwd=fwd, bwd=lambda *a, **kw: impl.bwd_res(res["r"], *a, **kw))
  q, k, v, g, h0, key = _inputs(3, 1, 128, 1, 64, 128, decay="strong")
  o, fin, grads = _backend_terms(be, q, k, v, g, h0, key, 64)
  o_r, fin_r, grads_r = _backend_terms(chunked, q, k, v, g, h0, key, 64)
  assert rel_err(o, o_r) <= 1e-5
  assert rel_err(fin, fin_r) <= 1e-5
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), grads, grads_r):
    assert rel_err(a, b) <= 1e-4, (name, rel_err(a, b))


def test_states_stored_in_input_dtype(monkeypatch):
  """The chunk states kept for the backward are bf16 for bf16 inputs (default
  ``states_in_input_dtype``), float32 for float32 inputs; A is float32."""
  from pallas_kernels import _common
  monkeypatch.setitem(_common.TUNE, "keep_states", True)
  be = pallas_kernels.backend()
  q, k, v, g, h0, key = _inputs(4, 1, 64, 1, 64, 64, decay="mild")
  kw = dict(scale=0.125, initial_state=h0, chunk_size=64)
  for dtype in (jnp.bfloat16, jnp.float32):
    cast = lambda a: a.astype(dtype)
    _, (A, h) = be.fwd_res(cast(q), cast(k), cast(v), g, **kw)
    assert h.dtype == dtype and h.shape == (1, 1, 1, 64, 64) and A.dtype == jnp.float32


def test_walk_tiles_target_one_program_per_sm(monkeypatch):
  """State-walk tiles: about one program per SM for the launch (the benchmark shapes on a
  132-SM GPU), unless TUNE fixes the tile."""
  from pallas_kernels import _common, state
  monkeypatch.setattr(_common, "sm_count", lambda: 132)
  assert state.walk_tiles(1, 16, 128, 128) == (64, 32)            # 128 programs
  assert state.walk_tiles(8, 4, 128, 256) == (64, 128)            # 128 programs
  assert state.walk_tiles(1, 16, 128, 128, walks=2) == (64, 64)   # 2 x 64 programs
  assert state.walk_tiles(1, 1, 64, 16) == (64, 16)               # V below 32
  monkeypatch.setitem(_common.TUNE, "state_bv", 64)
  assert state.walk_tiles(1, 16, 128, 128) == (64, 64)
