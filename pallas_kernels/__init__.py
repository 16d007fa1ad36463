"""Pallas kernels for chunked GLA (spec section 2), plugged into :func:`zeco_jax.chunk_gla`.

``backend()`` returns the module whose ``fwd`` / ``bwd`` follow the contract of
:mod:`zeco_jax.chunked` (padded, validated inputs, layout ``[B, T, H, D]``):

* GPU: :mod:`pallas_kernels.triton_backend`, pallas_call lowered through Triton.
* CPU: the same kernels in the Pallas interpreter (tests). ``ZECO_PALLAS_INTERPRET=1``
  forces the interpreter on any platform, ``=0`` forbids it.
* TPU: no Mosaic TPU variant exists yet, so ``backend()`` raises ImportError there (unless
  the interpreter is forced) and ``chunk_gla(backend="auto")`` falls back to the jnp path
  instead of running Triton-specific kernels that cannot lower to Mosaic TPU.

Modules: ``state`` (sequential state pass and state-gradient pass), ``intra`` (intra-chunk
scores with 16-token sub-chunks and exact log-space diagonal blocks; output), ``grads``
(dv; dq, dk, dg), ``triton_backend`` (composition), ``_common`` (helpers, launch params).
"""
import os

import jax


def backend():
  forced = os.environ.get("ZECO_PALLAS_INTERPRET", "") not in ("", "0", "false", "False")
  if jax.default_backend() == "tpu" and not forced:
    raise ImportError("pallas_kernels: no Mosaic TPU variant yet (the kernels are written for "
                      "the Triton lowering); use backend='jax', or ZECO_PALLAS_INTERPRET=1.")
  from pallas_kernels import triton_backend
  return triton_backend


__all__ = ["backend"]
