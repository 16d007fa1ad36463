"""Small numerical helpers every family shares: the matmul precision (and the fix-ups'),
einsum, FLA's l2norm (the delta-rule families' ``use_qk_l2norm``), and the guard that
keeps a possibly constant state out of XLA:CPU's YNN fusions.

What it does not hold: anything family-specific (decays live with the family; the
delta-rule families' chunk layout and recurrence are ``zeco_jax._chunks``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

HI = lax.Precision.HIGHEST
"""float32 matmuls at full precision (no TF32 / bf16 passes): the references and the jnp
paths are tested to 1e-5 against float64."""


def output_precision(dtype):
  """The precision of a sequence-parallel fix-up GEMM (``o += R X`` after the scan) whose
  output is rounded to ``dtype``: :data:`HI` for float32; for a narrower dtype jax's
  default (``default_matmul_precision``: TF32 tensor cores on a GPU, one bf16 pass on a
  TPU, instead of float32 FMAs or six passes), whose rounding is below the output's."""
  return HI if jnp.dtype(dtype) == jnp.float32 else None


def ein(eq, *xs):
  """``jnp.einsum`` at :data:`HI` with float32 accumulation."""
  return jnp.einsum(eq, *xs, precision=HI, preferred_element_type=jnp.float32)


L2NORM_EPS = 1e-6      # FLA's l2norm: x / sqrt(sum x^2 + eps)


@jax.checkpoint
def l2norm(x):
  """FLA's ``l2norm`` over the last axis, in float32, returned in x's dtype. Under
  ``jax.checkpoint``: its backward recomputes the norm from x rather than keeping float32
  copies of x per token (12 KB a token of Gated DeltaNet-340M's q and k per layer)."""
  x32 = x.astype(jnp.float32)
  return (x32 * lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + L2NORM_EPS)).astype(x.dtype)


def opaque(x):
  """``x`` behind an ``optimization_barrier``: the compiler cannot see that it is constant.

  Why: XLA:CPU (jax 0.10.2 and 0.11.2) miscompiles a YNN fusion that holds a dot whose
  operand is a broadcast scalar (``jnp.zeros``, ``jnp.full``, or a broadcast runtime
  scalar) together with a reduce: the result is garbage (1e20..1e38, inf, NaN) that changes
  from run to run (``docs/xla_cpu_ynn.md`` has a four-line reproduction). A linear-attention
  state walk hands the compiler exactly that whenever its initial state (or the backward's
  final-state cotangent) is zero and the walk has one step, since the loop is then inlined.
  Every state that may be such a constant passes through here before it meets a dot; the
  cost is one copy of one state, on any backend.
  """
  return lax.optimization_barrier(x)
