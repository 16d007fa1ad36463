"""Logical axis names and the one rule table that maps them to mesh axes.

Parameters (of :mod:`models` and :mod:`zeco_jax.nn`) and activations name their dimensions
logically (``batch``, ``seq``, ``embed``, ...). Nothing in the model knows the mesh; this
table (or one passed in its place, e.g. from a config) is the only place where a logical
name becomes a mesh axis. Every PartitionSpec the trainer uses is derived here.

The default keeps parameters replicated (data x sequence parallelism): ``batch`` goes
to ``data`` and ``seq`` (the time axis of activations) to ``seq``. Mapping ``embed`` to
``data`` instead gives FSDP-style parameter sharding without touching the model.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from zeco_jax.nn import LOGICAL_AXES_KEY

# (logical name, mesh axis or None). The first rule for a name wins.
DEFAULT_RULES: tuple[tuple[str, Optional[str]], ...] = (
    ("batch", "data"),
    ("seq", "seq"),
    ("vocab", None),
    ("embed", None),
    ("heads", None),      # q/k/v/gate projection outputs (heads * head_dim)
    ("head_dim", None),   # per-head norm weights
    ("gate_rank", None),  # the low-rank gate bottleneck
    ("mlp", None),
)

def rules_from_config(overrides: Optional[Mapping[str, Optional[str]]] = None):
  """DEFAULT_RULES with some names remapped (``{"embed": "data"}``)."""
  overrides = dict(overrides or {})
  unknown = set(overrides) - {name for name, _ in DEFAULT_RULES}
  if unknown:
    raise ValueError(f"sharding rules: unknown logical axes {sorted(unknown)}; known: "
                     f"{[name for name, _ in DEFAULT_RULES]}")
  return tuple((name, overrides.get(name, axis)) for name, axis in DEFAULT_RULES)


def logical_to_spec(axes: Sequence[Optional[str]], rules=DEFAULT_RULES,
                    mesh: Optional[jax.sharding.Mesh] = None) -> PartitionSpec:
  """PartitionSpec for logically named dimensions.

  Mesh axes not in ``mesh`` (or of size 1 there) become None, so one table serves a
  one-device run and a pod. A mesh axis is used at most once per spec.
  """
  table = {}
  for name, axis in rules:
    table.setdefault(name, axis)
  used, out = set(), []
  for name in axes:
    if name is not None and name not in table:
      raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
    axis = None if name is None else table[name]
    if axis is not None and mesh is not None and mesh.shape.get(axis, 1) == 1:
      axis = None
    if axis in used:
      axis = None
    if axis is not None:
      used.add(axis)
    out.append(axis)
  return PartitionSpec(*out)


def logical_axes(model: nnx.Module) -> dict:
  """Nested dict (same structure as ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``)
  of every parameter's logical axis names."""
  out: dict[Any, Any] = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param):
      axes = node.get_metadata().get(LOGICAL_AXES_KEY)
      if axes is None or len(axes) != len(node.get_value().shape):
        raise ValueError(f"parameter {'/'.join(map(str, path))} has logical axes {axes} "
                         f"for shape {node.get_value().shape}")
      d = out
      for key in path[:-1]:
        d = d.setdefault(key, {})
      d[path[-1]] = tuple(axes)
  return out


def _is_axes(x):
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def param_specs(axes_tree: dict, rules=DEFAULT_RULES, mesh=None):
  """PartitionSpec tree for a tree of logical axes (from :func:`logical_axes`)."""
  return jax.tree.map(lambda a: logical_to_spec(a, rules, mesh), axes_tree, is_leaf=_is_axes)


def param_shardings(axes_tree: dict, mesh: jax.sharding.Mesh, rules=DEFAULT_RULES):
  return jax.tree.map(lambda s: NamedSharding(mesh, s),
                      param_specs(axes_tree, rules, mesh),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: jax.sharding.Mesh, rules=DEFAULT_RULES) -> NamedSharding:
  """Sharding of a ``[batch, seq]`` token array: B over ``data``, T over ``seq``."""
  return NamedSharding(mesh, logical_to_spec(("batch", "seq"), rules, mesh))
