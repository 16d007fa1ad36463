"""Pallas kernels for the chunked linear-attention ops, one folder per family.

``backend(family, platform)`` returns the family's kernels for a target platform: an
object satisfying :class:`ChunkKernels` (``fwd`` / ``bwd`` and their ``*_res`` forms, each
with ``config=``, the family's frozen launch configuration). :data:`FAMILIES` lists the
families that have kernels and :data:`KERNEL_PLATFORMS` the platforms each has them for.

* ``"gla"`` (:mod:`pallas_kernels.gla`): ``"gpu"`` Triton-lowered kernels
  (:mod:`pallas_kernels.gla.gpu`), ``"tpu"`` Mosaic TPU kernels (:mod:`pallas_kernels.gla.tpu`,
  compiled ahead of time for v5e / v5p / v6e and checked in the interpreter; not yet run on
  a TPU chip), ``"cpu"`` the GPU kernels in the Pallas interpreter (tests). Its launch
  configuration: :class:`KernelConfig` and :func:`default_config` (``docs/kernels.md``).
* ``"gated_delta"`` (:mod:`pallas_kernels.gated_delta`): Gated DeltaNet, ``"gpu"``
  Triton-lowered kernels (:mod:`pallas_kernels.gated_delta.gpu`), ``"tpu"`` Mosaic TPU
  kernels (:mod:`pallas_kernels.gated_delta.tpu`, compiled ahead of time for v5e / v5p /
  v6e and checked in the interpreter; not yet run on a TPU chip), ``"cpu"`` the GPU
  kernels in the interpreter. Its launch configuration: ``gated_delta.KernelConfig`` and
  ``gated_delta.default_config`` (:func:`config_type`, :func:`family_default_config`).
* ``"kda"`` (:mod:`pallas_kernels.kda`): Kimi Delta Attention, ``"gpu"`` Triton-lowered
  kernels (:mod:`pallas_kernels.kda.gpu`), ``"tpu"`` Mosaic TPU kernels
  (:mod:`pallas_kernels.kda.tpu`, compiled ahead of time for v5e / v5p / v6e and checked
  in the interpreter; not yet run on a TPU chip) and ``"cpu"`` the GPU kernels in the
  interpreter.

Shared by every family: :mod:`pallas_kernels._launch` (the launch, dots, tiles, layouts),
:mod:`pallas_kernels._config` (``Launch``, the config checks) and
:mod:`pallas_kernels.protocol`. This package never imports ``zeco_jax``.
"""
import importlib

from pallas_kernels._config import PLATFORMS, Launch
from pallas_kernels.gla.config import KernelConfig, default_config
from pallas_kernels.protocol import ChunkKernels

FAMILIES = ("gla", "gated_delta", "kda")
KERNEL_PLATFORMS = {"gla": ("cpu", "gpu", "tpu"), "gated_delta": ("cpu", "gpu", "tpu"),
                    "kda": ("cpu", "gpu", "tpu")}
# Kernels that have not been compiled for their platform end to end yet: backend="auto"
# does not pick them there (backend="pallas" does).
# {(family, platform): why}; empty now (KDA's GPU kernels left it once they had run on an
# H200).
NOT_YET_AUTO: dict = {}


def _check_family(family: str) -> None:
  if family not in FAMILIES:
    raise ValueError(f"pallas_kernels: no kernels for family {family!r}; the families "
                     f"with kernels are {', '.join(map(repr, FAMILIES))}.")


def backend(family: str, platform: str) -> ChunkKernels:
  """The kernels of ``family`` for a target ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``).

  Imports them, so a broken kernel package raises here (ImportError, AttributeError), never
  silently falls back.
  """
  _check_family(family)
  if platform not in PLATFORMS:
    raise ValueError(f"pallas_kernels.backend: unknown `platform` {platform!r}; choose one of "
                     f"{', '.join(map(repr, PLATFORMS))}.")
  if platform not in KERNEL_PLATFORMS[family]:
    raise ValueError(f"pallas_kernels.backend: {family!r} has no {platform} kernels (it has "
                     f"{', '.join(KERNEL_PLATFORMS[family])}).")
  module = "tpu" if platform == "tpu" else "gpu"
  return importlib.import_module(f"pallas_kernels.{family}.{module}")


def config_type(family: str):
  """The family's launch-configuration class (``KernelConfig`` of its folder)."""
  _check_family(family)
  return importlib.import_module(f"pallas_kernels.{family}.config").KernelConfig


def family_default_config(family: str, platform: str, B: int, T: int, H: int, K: int, V: int,
                          dtype, *, sm_count=None, chunk_size=64):
  """The family's :func:`default_config` for a target platform, shape and chunk size."""
  _check_family(family)
  module = importlib.import_module(f"pallas_kernels.{family}.config")
  return module.default_config(platform, B, T, H, K, V, dtype, sm_count=sm_count,
                               chunk_size=chunk_size)


__all__ = ["ChunkKernels", "FAMILIES", "KERNEL_PLATFORMS", "NOT_YET_AUTO", "KernelConfig",
           "Launch", "PLATFORMS", "backend", "config_type", "default_config",
           "family_default_config"]
