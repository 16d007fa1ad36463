"""Shared test helpers: random GLA inputs (never zeros), the relative-norm error, the
sub-jaxprs of a jaxpr equation (to walk a traced program), and an abstract one-device mesh
of a GPU or TPU (to trace or lower for that target on this CPU host)."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def abstract_mesh(platform, kind, cores):
  """A one-device AbstractMesh (axis "x") of a ``platform`` device of ``kind`` with
  ``cores`` cores; skips the test on a jax without ``jax.sharding.AbstractDevice``."""
  device_cls = getattr(jax.sharding, "AbstractDevice", None)
  if device_cls is None:
    pytest.skip("this jax has no jax.sharding.AbstractDevice")
  device = device_cls(device_kind=kind, num_cores=cores, platform=platform)
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def sub_jaxprs(eqn):
  """The jaxprs inside one equation's parameters (jit, shard_map, custom_vjp, ...)."""
  for value in eqn.params.values():
    for item in (value if isinstance(value, (tuple, list)) else (value,)):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns"):
        yield inner


def rel_err(a, b):
  """||a - b|| / ||b||, in float64 on the host: the tolerance measure every test states."""
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  denom = np.linalg.norm(b)
  assert denom > 0, "reference is all zeros: the comparison would prove nothing"
  assert np.all(np.isfinite(a)), "result has NaN or Inf"
  return float(np.linalg.norm(a - b) / denom)


def gla_inputs(seed, B=2, T=64, H=2, K=8, V=16, decay="dim", dtype=jnp.float32,
               initial_state=True, low=0.6):
  """q, k, v, g, h0 drawn at random; g = log of a decay uniform in (low, 1)."""
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.standard_normal((B, T, H, K)), dtype)
  k = jnp.asarray(r.standard_normal((B, T, H, K)), dtype)
  v = jnp.asarray(r.standard_normal((B, T, H, V)), dtype)
  g_shape = {"dim": (B, T, H, K), "scalar": (B, T, H), None: None}[decay]
  g = None if g_shape is None else jnp.asarray(np.log(r.uniform(low, 1.0, g_shape)), jnp.float32)
  h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32) if initial_state else None
  return q, k, v, g, h0


def cotangents(seed, B, T, H, K, V):
  """Random weights for a scalar loss sum(o * w_o) + sum(final * w_s)."""
  r = np.random.default_rng(seed + 1000)
  return (jnp.asarray(r.standard_normal((B, T, H, V)), jnp.float32),
          jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32))


def loss_and_grads(op, q, k, v, g, h0, w_o, w_s, **kwargs):
  """Value and gradients of sum(o * w_o) + sum(final * w_s) w.r.t. every array input."""
  def loss(q, k, v, g, h0):
    o, final = op(q, k, v, g, initial_state=h0, output_final_state=True, **kwargs)
    return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(final * w_s), (o, final)

  argnums = tuple(i for i, x in enumerate((q, k, v, g, h0)) if x is not None)
  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
  (_, (o, final)), grads = grad_fn(q, k, v, g, h0)
  names = [n for n, x in zip("q k v g h0".split(), (q, k, v, g, h0)) if x is not None]
  return o, final, dict(zip(names, grads))


CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")


@contextlib.contextmanager
def persistent_compilation_cache(path):
  """JAX's persistent compilation cache in folder ``path`` (every program, however quick
  to compile), the previous settings restored afterwards. A later compile of a program
  already compiled (the same HLO, e.g. a second run of the same training program, or the
  same Pallas kernel traced again) loads it from ``path`` instead; subprocesses share it
  through :func:`persistent_cache_env`."""
  from jax.experimental.compilation_cache import compilation_cache
  before = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
  for name, value in zip(CACHE_OPTIONS, (str(path), 0.0, 0)):
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  try:
    yield str(path)
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()


def persistent_cache_env(path) -> dict:
  """Environment variables that give a subprocess the same persistent compilation cache."""
  return {"JAX_COMPILATION_CACHE_DIR": str(path),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
