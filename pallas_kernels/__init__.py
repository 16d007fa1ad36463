"""Pallas kernels for the chunked linear-attention ops, one folder per family.

``backend(family, platform)`` returns the family's kernels for a target platform: an
object satisfying :class:`ChunkKernels` (``fwd`` / ``bwd`` and their ``*_res`` forms, each
with ``config=``, the family's frozen launch configuration). :data:`FAMILIES` lists the
families that have kernels.

* ``"gla"`` (:mod:`pallas_kernels.gla`): ``"gpu"`` Triton-lowered kernels
  (:mod:`pallas_kernels.gla.gpu`), ``"tpu"`` Mosaic TPU kernels (:mod:`pallas_kernels.gla.tpu`,
  compiled ahead of time for v5e / v5p / v6e and checked in the interpreter; not yet run on
  a TPU chip), ``"cpu"`` the GPU kernels in the Pallas interpreter (tests). Its launch
  configuration: :class:`KernelConfig` and :func:`default_config` (``docs/kernels.md``).

Shared by every family: :mod:`pallas_kernels._launch` (the launch, dots, tiles) and
:mod:`pallas_kernels.protocol`. This package never imports ``zeco_jax``.
"""
from pallas_kernels.gla.config import PLATFORMS, KernelConfig, Launch, default_config
from pallas_kernels.protocol import ChunkKernels

FAMILIES = ("gla",)


def backend(family: str, platform: str) -> ChunkKernels:
  """The kernels of ``family`` for a target ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``).

  Imports them, so a broken kernel package raises here (ImportError, AttributeError), never
  silently falls back.
  """
  if family not in FAMILIES:
    raise ValueError(f"pallas_kernels.backend: no kernels for family {family!r}; the families "
                     f"with kernels are {', '.join(map(repr, FAMILIES))}.")
  if platform == "tpu":
    from pallas_kernels.gla import tpu
    return tpu
  if platform in ("gpu", "cpu"):
    from pallas_kernels.gla import gpu
    return gpu
  raise ValueError(f"pallas_kernels.backend: unknown `platform` {platform!r}; choose one of "
                   f"{', '.join(map(repr, PLATFORMS))}.")


__all__ = ["ChunkKernels", "FAMILIES", "KernelConfig", "Launch", "PLATFORMS", "backend",
           "default_config"]
