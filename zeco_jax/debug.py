"""Debug checks that cost a pass over the inputs, off the default path.

The ops assume ``g <= 0`` (the log of a decay in (0, 1]); a positive ``g`` makes
``exp`` of a cumulative sum overflow to Inf. :func:`checked` wraps an op with
``jax.experimental.checkify`` so that such input is reported instead::

    err, (o, state) = zeco_jax.debug.checked(zeco_jax.chunk_gla)(q, k, v, g)
    err.throw()   # ValueError-like JaxRuntimeError naming the problem

It works under ``jax.jit`` (checkify functionalizes the check).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import checkify


def check_log_decay(g, *, name="g"):
  """Records a checkify error if ``g`` has a positive or non-finite entry."""
  if g is None:
    return
  checkify.check(jnp.all(g <= 0), f"`{name}` (log-decay) must be <= 0 everywhere; got a "
                 "maximum of {max}. Pass log(decay), e.g. jax.nn.log_sigmoid(x).",
                 max=jnp.max(g))
  checkify.check(jnp.all(jnp.isfinite(g)), f"`{name}` (log-decay) has NaN or Inf entries.")


def checked(op):
  """``checkify``-wrapped ``op`` that first validates its ``g`` argument (4th or ``g=``)."""

  @functools.wraps(op)
  def wrapped(q, k, v, g=None, **kwargs):
    check_log_decay(g)
    return op(q, k, v, g, **kwargs)

  return checkify.checkify(wrapped)
