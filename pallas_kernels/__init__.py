"""Pallas kernels for chunked GLA (spec section 2), plugged into :func:`zeco_jax.chunk_gla`.

``backend()`` returns the module whose ``fwd`` / ``bwd`` follow the contract of
:mod:`zeco_jax.chunked` (padded, validated inputs, layout ``[B, T, H, D]``):

* GPU: :mod:`pallas_kernels.triton_backend`, pallas_call lowered through Triton.
* CPU: the same kernels in the Pallas interpreter (tests). ``ZECO_PALLAS_INTERPRET=1``
  forces the interpreter on any platform, ``=0`` forbids it.
* TPU: :mod:`pallas_kernels.tpu_backend` (Mosaic TPU) exists, lowers and is tested in the
  interpreter, but has never run on a TPU, so it is opt-in: ``ZECO_PALLAS_TPU=1``.
  Without it ``backend()`` raises ImportError on TPU and ``chunk_gla(backend="auto")``
  stays on the jnp path there.

Modules: ``state`` (chunk cumsum; sequential state pass and state-gradient pass, also in
one launch), ``intra`` (intra-chunk scores: off-diagonal blocks by tensor-core dots,
16 x 16 diagonal blocks exact in log space; dA; output), ``grads`` (dv; diagonal dq/dk
terms; dq, dk, dg), ``overlap`` (state walks in the same launch as chunk-parallel stages,
an option), ``triton_backend`` (composition), ``tpu_backend`` (the Mosaic TPU variant),
``_common`` (helpers, launch parameters ``TUNE``).
"""
import os

import jax


def _flag(name):
  return os.environ.get(name, "") not in ("", "0", "false", "False")


def backend():
  if jax.default_backend() == "tpu" and not _flag("ZECO_PALLAS_INTERPRET"):
    if _flag("ZECO_PALLAS_TPU"):
      from pallas_kernels import tpu_backend
      return tpu_backend
    raise ImportError("pallas_kernels: the Mosaic TPU variant has not run on a TPU yet; set "
                      "ZECO_PALLAS_TPU=1 to use it, or use backend='jax'.")
  from pallas_kernels import triton_backend
  return triton_backend


__all__ = ["backend"]
