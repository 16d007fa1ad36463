"""Which implementation of a family's chunked op runs: the jnp path or its Pallas kernels.

``backend=`` of every op is ``"auto"``, ``"jax"`` or ``"pallas"``. ``"auto"`` picks by the
platform the computation is compiled for (:func:`zeco_jax.runtime.target.platform_of`,
``docs/design.md`` §8): the kernels on GPU and TPU, the jnp path on CPU (and, said once per
process, when the kernel package is not installed or has no kernels for the family).
``"pallas"`` imports the platform's kernels here, so a broken kernel package raises instead
of falling back. :func:`kernels` returns the family's kernel implementation, checked
against ``pallas_kernels.ChunkKernels`` (a ``typing.Protocol``).

The kernel package is imported only when a Pallas backend is asked for or chosen:
``pallas_kernels`` never imports ``zeco_jax``, and ``zeco_jax`` imports it at run time only.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings

from zeco_jax import _checks
from zeco_jax.runtime import target

BACKENDS = ("auto", "jax", "pallas")
KERNEL_PACKAGE = "pallas_kernels"


def kernels_installed() -> bool:
  return importlib.util.find_spec(KERNEL_PACKAGE) is not None


def kernel_package():
  """pallas_kernels; any error inside it (a broken install) propagates."""
  return importlib.import_module(KERNEL_PACKAGE)


@functools.lru_cache(maxsize=None)
def say_jax_fallback(platform: str, reason: str) -> None:
  """Warns once per process, platform and reason that "auto" runs the jnp path."""
  warnings.warn(f"zeco_jax: backend='auto' on {platform} runs the jnp path: {reason}. Pass "
                "backend='jax' to choose it explicitly (and silence this), or "
                "backend='pallas' to use the kernels anyway.", stacklevel=3)


def resolve_backend(backend: str, *, family: str = "gla", name: str = "chunk_gla",
                    platform=None) -> str:
  """Maps ``backend`` to ``"jax"`` or ``"pallas"`` for ``family`` on the target ``platform``.

  ``platform``: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``platform_of(...)`` of the inputs or the
  mesh); None: :func:`zeco_jax.runtime.target.platform_of` of the context.
  """
  _checks.check_choice(backend, BACKENDS, arg="backend", name=name)
  if platform is None:
    platform = target.platform_of()
  _checks.check_choice(platform, target.PLATFORMS, arg="platform", name=name)
  if backend == "jax" or (backend == "auto" and platform == "cpu"):
    return "jax"
  if not kernels_installed():
    if backend == "auto":
      say_jax_fallback(platform, f"the kernel package `{KERNEL_PACKAGE}` is not installed")
      return "jax"
    raise ValueError(f"{name}: backend='pallas' needs the kernel package `{KERNEL_PACKAGE}`, "
                     "which is not installed; reinstall zeco-jax, or use backend='jax'.")
  package = kernel_package()
  if family not in package.FAMILIES:
    if backend == "auto":
      say_jax_fallback(platform, f"`{KERNEL_PACKAGE}` has no {family} kernels")
      return "jax"
    raise ValueError(f"{name}: backend='pallas': `{KERNEL_PACKAGE}` has no kernels for "
                     f"{family!r} (it has {', '.join(package.FAMILIES)}); use backend='jax'.")
  if platform not in package.KERNEL_PLATFORMS[family]:
    reason = (f"`{KERNEL_PACKAGE}` has no {platform} kernels for {family} (only "
              f"{', '.join(package.KERNEL_PLATFORMS[family])})")
    if backend == "auto":
      say_jax_fallback(platform, reason)
      return "jax"
    raise ValueError(f"{name}: backend='pallas': {reason}; use backend='jax'.")
  if backend == "auto" and (family, platform) in package.NOT_YET_AUTO:
    say_jax_fallback(platform, f"{family}: {package.NOT_YET_AUTO[family, platform]}")
    return "jax"
  kernels(family, platform)
  return "pallas"


def kernels(family: str, platform: str):
  """The family's kernels for ``platform``: an object with ``fwd`` / ``bwd`` (and
  ``fwd_res`` / ``bwd_res``), checked against ``pallas_kernels.ChunkKernels``."""
  package = kernel_package()
  impl = package.backend(family, platform)
  if not isinstance(impl, package.ChunkKernels):
    raise TypeError(f"pallas_kernels.backend({family!r}, {platform!r}) returned {impl!r}, "
                    "which lacks fwd / bwd / fwd_res / bwd_res (pallas_kernels.ChunkKernels).")
  return impl
