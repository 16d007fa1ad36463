"""shard_map's varying-manual-axes bookkeeping (check_vma=True), in one place.

Values built from constants inside shard_map (zeros, an initial state replicated over the
axis) are "invariant"; a loop carry must have the same type on entry and exit, so such
values are cast to "varying" before they enter a ``lax.scan`` whose body makes them vary.
Outside shard_map, or with check_vma=False, these are no-ops.
"""
from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)        # jax >= 0.10
  if manual is not None:
    return frozenset(getattr(manual, "varying", ()))
  return frozenset(getattr(aval, "vma", ()) or ())


def match_varying(x, *likes):
  """Casts ``x`` to vary over every manual axis that any of ``likes`` varies over."""
  missing = frozenset().union(*(varying_axes(y) for y in likes)) - varying_axes(x)
  if not missing:
    return x
  return lax.pcast(x, tuple(sorted(missing)), to="varying")


def make_varying(x, axis_name):
  """Casts ``x`` to vary over ``axis_name`` if it does not already."""
  if axis_name in varying_axes(x):
    return x
  return lax.pcast(x, axis_name, to="varying")
