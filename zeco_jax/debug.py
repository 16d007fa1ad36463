"""Debug checks that cost a pass over the inputs, off the default path.

The ops assume inputs inside their contract, as FLA's do, and do not check values on the
fast path:

* every op: ``g <= 0`` (the log of a decay in (0, 1]); a positive ``g`` makes ``exp`` of a
  cumulative sum overflow to Inf;
* the delta-rule ops (Gated DeltaNet): ``beta`` in [0, 1], and unit-norm keys unless
  ``use_qk_l2norm=True``: the transition ``I - beta k k^T`` contracts only then, and an
  unnormalised k makes the state grow without bound (1e27 outputs after a few hundred
  tokens).

:func:`checked` wraps an op with ``jax.experimental.checkify`` so that input outside the
contract is reported instead::

    err, (o, state) = zeco_jax.debug.checked(zeco_jax.chunk_gla)(q, k, v, g)
    err.throw()   # JaxRuntimeError naming the argument and the worst value
    err, (o, state) = zeco_jax.debug.checked(zeco_jax.chunk_gated_delta_rule)(
        q, k, v, g, beta)

It works under ``jax.jit`` (checkify functionalizes the check).
"""
from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp
from jax.experimental import checkify

KEY_NORM_TOLERANCE = 1e-2   # |‖k‖ - 1| allowed for "unit-norm" keys (bf16 keys round)


def check_log_decay(g, *, name="g"):
  """Records a checkify error if ``g`` has a positive or non-finite entry."""
  if g is None:
    return
  checkify.check(jnp.all(g <= 0), f"`{name}` (log-decay) must be <= 0 everywhere; got a "
                 "maximum of {max}. Pass log(decay), e.g. jax.nn.log_sigmoid(x).",
                 max=jnp.max(g))
  checkify.check(jnp.all(jnp.isfinite(g)), f"`{name}` (log-decay) has NaN or Inf entries.")


def check_beta(beta, *, name="beta"):
  """Records a checkify error unless every ``beta`` is in [0, 1] (and finite)."""
  checkify.check(jnp.all((beta >= 0) & (beta <= 1)),
                 f"`{name}` (write strength) must be in [0, 1]; got values from {{lo}} to "
                 "{hi}. Pass jax.nn.sigmoid(x).", lo=jnp.min(beta), hi=jnp.max(beta))


def check_unit_keys(k, *, name="k"):
  """Records a checkify error unless every key has norm 1 (to :data:`KEY_NORM_TOLERANCE`)."""
  norms = jnp.sqrt(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1))
  checkify.check(jnp.all(jnp.abs(norms - 1) <= KEY_NORM_TOLERANCE),
                 f"`{name}` must be unit-norm over K for the delta rule (the state grows "
                 "without bound otherwise); norms range from {lo} to {hi}. Normalise k, or "
                 "pass use_qk_l2norm=True.", lo=jnp.min(norms), hi=jnp.max(norms))


def checked(op):
  """``checkify``-wrapped ``op`` that first validates its inputs against the contract
  above: ``g`` for every op; for an op with a ``beta`` argument (the delta rule) also
  ``beta`` and, unless ``use_qk_l2norm=True``, the keys' norms."""
  signature = inspect.signature(op)

  @functools.wraps(op)
  def wrapped(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    given = bound.arguments
    check_log_decay(given.get("g"))
    if "beta" in signature.parameters:
      check_beta(given["beta"])
      if not given.get("use_qk_l2norm", False):
        check_unit_keys(given["k"])
    return op(*args, **kwargs)

  return checkify.checkify(wrapped)
