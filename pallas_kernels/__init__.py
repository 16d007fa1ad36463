"""Pallas kernels for chunked GLA (spec section 2), plugged into :func:`zeco_jax.chunk_gla`.

``backend()`` returns the module whose ``fwd`` / ``bwd`` follow the contract of
:mod:`zeco_jax.chunked`. On GPU that is :mod:`pallas_kernels.triton_backend` (pallas_call
lowered through Triton). On CPU the same kernels run in the Pallas interpreter (tests);
``ZECO_PALLAS_INTERPRET=1`` forces the interpreter anywhere. There is no TPU-specific
(Mosaic TPU) variant yet: on TPU the interpreter path would be used, which is slow.
"""
from pallas_kernels import triton_backend


def backend():
  return triton_backend


__all__ = ["backend"]
