"""Which backend an op runs: ``backend="auto"`` resolved by the target platform (the mesh
or the inputs' devices, not the host's default backend), so that a program traced for a
GPU or TPU on this CPU host gets that target's kernels; a broken kernel package surfaces
as an error, never as a silent fall-back to the jnp path."""
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import abstract_mesh, gla_inputs, seq_mesh
from zeco_jax import chunk_gla
from zeco_jax.ops import _dispatch
from zeco_jax.ops.gla.op import resolve_backend
from zeco_jax.runtime import target


def test_auto_backend_is_jax_on_cpu():
  assert resolve_backend("auto") == "jax"
  assert resolve_backend("auto", platform="cpu") == "jax"


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
  q = jnp.ones((1, 16, 1, 8))
  assert target.platform_of(q, mesh=seq_mesh(2)) == "cpu"
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
  # The jnp path does not need the kernels (traced: where the kernels would be looked up).
  jax.eval_shape(lambda *a: chunk_gla(*a, backend="jax"), q, k, v, g)
