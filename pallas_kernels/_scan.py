"""Sums along a tile's rows (axis 0) as one Triton scan, in either direction, inclusive or
exclusive:

  ``rows_sum(x)``                              out[i] = sum_{m <= i} x[m]
  ``rows_sum(x, reverse=True)``                out[i] = sum_{m >= i} x[m]
  ``rows_sum(x, exclusive=True)``              out[i] = sum_{m < i} x[m]   (0 on the first row)
  ``rows_sum(x, reverse=True, exclusive=True)`` out[i] = sum_{m > i} x[m]   (0 on the last row)

Each output is a sum of exactly the elements it names, never the difference of two sums
(what the delta-rule kernels' exactness rule asks of their log-decay spans). An exclusive
sum is one scan of the pairs ``(t, e)``, t a segment's total and e its total less the
element nearest the output (the segment's last element going forward, its first going
backward), started at ``(x[m], 0)`` and combined as ``(t_a + t_b, t_a + e_b)`` with a the
segment the scan has already passed: e is added up, never subtracted.

``jax.lax.cumsum`` lowers to Triton's scan only forward (``reverse=True`` raises in JAX's
Triton lowering), and a cumulative sum cannot be exclusive; Triton's scan op itself takes
a direction and several operands. :data:`rows_sum_p` is a primitive with an XLA lowering
(a ``jnp.cumsum`` form, on any backend, so also in the Pallas interpreter) and a Triton
lowering rule; it has no Mosaic rule, and the TPU kernels do not use it. The Triton rule
is registered through JAX's private Pallas Triton lowering table
(``jax._src.pallas.triton.lowering.register_lowering``; no public API registers a Triton
lowering rule). :func:`triton_rule_registered` says whether that took effect;
``tests/kernels/test_rows_sum.py`` asserts it, so that a JAX upgrade that moves the private
name fails CI instead of failing the GPU kernels at trace time.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

rows_sum_p = Primitive("zeco_rows_sum")


def rows_sum(x, *, reverse: bool = False, exclusive: bool = False):
  """Sums along axis 0 of a 2-D tile (module docstring), in x's dtype."""
  if x.ndim != 2:
    raise ValueError(f"rows_sum: `x` must be a 2-D tile, got shape {x.shape}; sum along "
                     "the rows of a [rows, columns] tile.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"rows_sum: `x` must be a floating-point tile, got {x.dtype}; cast "
                     "it to float32 first.")
  return rows_sum_p.bind(x, reverse=bool(reverse), exclusive=bool(exclusive))


def _reference(x, *, reverse, exclusive):
  """The jnp form (the default lowering): a cumulative sum of x, shifted by one row first
  when exclusive."""
  if exclusive:
    zero = jnp.zeros_like(x[:1])
    x = jnp.concatenate([x[1:], zero] if reverse else [zero, x[:-1]], axis=0)
  return jax.lax.cumsum(x, axis=0, reverse=reverse)


rows_sum_p.def_impl(_reference)
rows_sum_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(rows_sum_p, mlir.lower_fun(_reference, multiple_results=False))


def _triton_rule(ctx, x, *, reverse, exclusive):
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax._src.lib.triton import dialect as tt

  elem = ir.RankedTensorType(x.type).element_type
  operands = [x]
  if exclusive:
    operands.append(tt.splat(x.type, arith.constant(elem, 0.0)))
  scan = tt.ScanOp(operands, 0, reverse)
  block = scan.regions[0].blocks.append(*([elem] * (2 * len(operands))))
  with ir.InsertionPoint.at_block_begin(block):
    if exclusive:
      t_a, e_a, t_b, e_b = block.arguments
      del e_a
      tt.scan_return([arith.addf(t_a, t_b), arith.addf(t_a, e_b)])
    else:
      a, b = block.arguments
      tt.scan_return([arith.addf(a, b)])
  scan.verify()
  return list(scan.result)[-1]


def _register_triton_rule() -> bool:
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
    triton_lowering.register_lowering(rows_sum_p)(_triton_rule)
  except (ImportError, AttributeError):
    return False
  return True


_TRITON_RULE = _register_triton_rule()


def triton_rule_registered() -> bool:
  """Whether :data:`rows_sum_p` has its Triton lowering rule (module docstring)."""
  return _TRITON_RULE
