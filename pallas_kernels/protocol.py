"""What a family's kernels give its op: the chunked forward and backward, on padded and
validated inputs (T a multiple of the chunk; the family's op says the rest of its
contract), each also as ``*_res``, which keeps (and takes back) a residual of its own."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ChunkKernels(Protocol):
  """``pallas_kernels.backend(family, platform)`` returns one (a module here).

  ``fwd(...) -> out``, ``bwd(...) -> grads``; ``fwd_res(...) -> (out, residual)`` and
  ``bwd_res(residual, ...) -> grads``, the residual (or None) being what the op's
  custom_vjp keeps between them. Every function takes ``config=`` (the family's
  ``KernelConfig``) besides the family's own arguments.
  """

  def fwd(self, *args: Any, **kwargs: Any) -> Any: ...

  def bwd(self, *args: Any, **kwargs: Any) -> Any: ...

  def fwd_res(self, *args: Any, **kwargs: Any) -> Any: ...

  def bwd_res(self, residual: Any, *args: Any, **kwargs: Any) -> Any: ...
