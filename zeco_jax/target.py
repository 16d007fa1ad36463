"""Which platform a computation is compiled for: the devices of the mesh or of the inputs.

Kernels are picked by the target the program is lowered for, not by the host's
``jax.default_backend()``: a program compiled ahead of time for a TPU topology on a
CPU-only host (``jax.experimental.topologies``), or for a GPU mesh from a process whose
default backend is the CPU, must get that target's kernels. The answer comes, in order,
from

1. an explicit ``mesh`` (``zeco_gla(mesh=...)``): its devices' platform;
2. the shardings of the inputs: under ``jit`` with sharded arguments (or
   ``jax.ShapeDtypeStruct(..., sharding=...)`` arguments to ``.lower``), an input's type
   carries its mesh, and the mesh its abstract device;
3. the mesh set by ``jax.set_mesh`` / ``jax.sharding.use_abstract_mesh``;
4. the inputs' committed devices, outside jit;
5. ``jax.default_backend()``, the last resort.

Platforms are reported as ``"cpu"``, ``"gpu"`` (CUDA or ROCm) or ``"tpu"``.
"""
from __future__ import annotations

from typing import Optional

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


def _normal(platform) -> Optional[str]:
  if not platform:
    return None
  return _ALIASES.get(str(platform).lower())


def _mesh_platform(mesh) -> Optional[str]:
  """Platform of a concrete ``Mesh`` or an ``AbstractMesh`` that knows its device kind."""
  if mesh is None or getattr(mesh, "empty", False):
    return None
  abstract = getattr(mesh, "abstract_device", None)
  if abstract is not None and getattr(abstract, "platform", None):
    return _normal(abstract.platform)
  devices = getattr(mesh, "devices", None)
  if devices is not None and getattr(devices, "size", 0):
    return _normal(devices.flat[0].platform)
  return None


def _array_platform(x) -> Optional[str]:
  try:
    sharding = getattr(jax.typeof(x), "sharding", None)
  except TypeError:            # not a JAX type (a Python scalar, None)
    return None
  found = _mesh_platform(getattr(sharding, "mesh", None))
  if found:
    return found
  try:                          # a concrete array outside jit
    devices = x.devices()
  except (AttributeError, RuntimeError, TypeError):
    return None
  return _normal(next(iter(devices)).platform) if devices else None


def platform_of(*arrays, mesh=None) -> str:
  """The platform the computation on ``arrays`` (over ``mesh``) is compiled for."""
  found = _mesh_platform(mesh)
  for x in arrays:
    if found:
      break
    if x is not None:
      found = _array_platform(x)
  if not found:
    found = _mesh_platform(jax.sharding.get_abstract_mesh())
  return found or _normal(jax.default_backend()) or "cpu"
