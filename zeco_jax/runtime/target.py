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

Platforms are reported as ``"cpu"``, ``"gpu"`` (CUDA or ROCm) or ``"tpu"``;
:func:`target_of` also gives a device's core count where the source knows it (the Pallas
kernels size their state walks by a GPU's SMs).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


@dataclasses.dataclass(frozen=True)
class Target:
  """What a computation is compiled for: the platform, and the cores of one device where
  known (streaming multiprocessors of a GPU, TensorCores of a TPU; None otherwise)."""
  platform: str
  num_cores: Optional[int] = None


def normal_platform(platform) -> Optional[str]:
  """``"cpu"``, ``"gpu"`` or ``"tpu"`` for a JAX platform name (``"cuda"``, ``"rocm"``, ...);
  None for anything else."""
  if not platform:
    return None
  return _ALIASES.get(str(platform).lower())


def _device_target(device) -> Optional[Target]:
  platform = normal_platform(getattr(device, "platform", None))
  if not platform:
    return None
  # jax's own AbstractDevice reads a GPU's SMs from ``core_count``, a TPU's from ``num_cores``.
  cores = getattr(device, "core_count" if platform == "gpu" else "num_cores", None)
  return Target(platform, cores if isinstance(cores, int) and cores > 0 else None)


def _mesh_target(mesh) -> Optional[Target]:
  """Target of a concrete ``Mesh`` or an ``AbstractMesh`` that knows its device kind."""
  if mesh is None or getattr(mesh, "empty", False):
    return None
  abstract = getattr(mesh, "abstract_device", None)
  platform = normal_platform(getattr(abstract, "platform", None))
  if platform:
    cores = getattr(abstract, "num_cores", None)
    return Target(platform, cores if isinstance(cores, int) and cores > 0 else None)
  devices = getattr(mesh, "devices", None)
  if devices is not None and getattr(devices, "size", 0):
    return _device_target(devices.flat[0])
  return None


def _array_target(x) -> Optional[Target]:
  try:
    sharding = getattr(jax.typeof(x), "sharding", None)
  except TypeError:            # not a JAX type (a Python scalar, None)
    return None
  found = _mesh_target(getattr(sharding, "mesh", None))
  if found:
    return found
  try:                          # a concrete array outside jit
    devices = x.devices()
  except (AttributeError, RuntimeError, TypeError):
    return None
  return _device_target(next(iter(devices))) if devices else None


def _default_target() -> Target:
  """The last resort: the default backend, and its first local device's cores."""
  platform = normal_platform(jax.default_backend()) or "cpu"
  try:
    found = _device_target(jax.local_devices()[0])
  except (IndexError, RuntimeError):
    found = None
  return found if found and found.platform == platform else Target(platform)


def target_of(*arrays, mesh=None) -> Target:
  """The :class:`Target` the computation on ``arrays`` (over ``mesh``) is compiled for,
  found in the order of the module docstring."""
  found = _mesh_target(mesh)
  for x in arrays:
    if found:
      break
    if x is not None:
      found = _array_target(x)
  if not found:
    found = _mesh_target(jax.sharding.get_abstract_mesh())
  return found or _default_target()


def platform_of(*arrays, mesh=None) -> str:
  """The platform the computation on ``arrays`` (over ``mesh``) is compiled for."""
  return target_of(*arrays, mesh=mesh).platform
