"""Small numerical helpers every family shares: the matmul precision, einsum, and the guard
that keeps a possibly constant state out of XLA:CPU's YNN fusions.

What it does not hold: anything family-specific (decays, chunk layouts live with the
family).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

HI = lax.Precision.HIGHEST
"""float32 matmuls at full precision (no TF32 / bf16 passes): the references and the jnp
paths are tested to 1e-5 against float64."""


def ein(eq, *xs):
  """``jnp.einsum`` at :data:`HI` with float32 accumulation."""
  return jnp.einsum(eq, *xs, precision=HI, preferred_element_type=jnp.float32)


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
