"""Pallas kernels for chunked GLA (``docs/design.md`` §2), plugged into :func:`zeco_jax.chunk_gla`.

``backend(platform)`` returns the module whose ``fwd`` / ``bwd`` follow the contract of
:mod:`zeco_jax.chunked` (padded, validated inputs, layout ``[B, T, H, D]``), with one more
keyword, ``config``: a :class:`KernelConfig`, the frozen launch configuration
(``default_config(platform, B, T, H, K, V, dtype)`` gives the defaults; ``docs/design.md``
§8 and ``docs/kernels.md`` say how they are chosen).

* ``"gpu"``: :mod:`pallas_kernels.triton_backend`, pallas_call lowered through Triton.
* ``"cpu"``: the same kernels in the Pallas interpreter (tests).
* ``"tpu"``: :mod:`pallas_kernels.tpu_backend` (Mosaic TPU), what ``backend="auto"`` picks
  for a TPU target. libtpu compiles it ahead of time for v5e / v5p / v6e and it is checked
  in the interpreter; it has not run on a TPU chip here.

Modules: ``config`` (:class:`KernelConfig`, :func:`default_config`), ``state`` (chunk
cumsums and the decayed q, k; sequential state pass and state-gradient pass, also in one
launch), ``intra`` (intra-chunk scores by tensor-core dots, the 16 x 16 diagonal blocks
too where the decay allows, else exact in log space; output), ``grads`` (dv; dq, dk, dg,
with dA formed inside and the diagonal terms exact in log space where the decay is too
strong for dots),
``triton_backend`` (composition), ``tpu_backend`` (the Mosaic TPU variant), ``_common``
(helpers, the launch).
"""
from pallas_kernels.config import KernelConfig
from pallas_kernels.config import PLATFORMS
from pallas_kernels.config import default_config


def backend(platform: str):
  """The kernel module for a target platform (``"cpu"``, ``"gpu"`` or ``"tpu"``).

  Imports it, so a broken kernel package raises here (ImportError, AttributeError), never
  silently falls back.
  """
  if platform == "tpu":
    from pallas_kernels import tpu_backend
    return tpu_backend
  if platform in ("gpu", "cpu"):
    from pallas_kernels import triton_backend
    return triton_backend
  raise ValueError(f"pallas_kernels.backend: unknown `platform` {platform!r}; choose one of "
                   f"{', '.join(map(repr, PLATFORMS))}.")


__all__ = ["KernelConfig", "PLATFORMS", "backend", "default_config"]
