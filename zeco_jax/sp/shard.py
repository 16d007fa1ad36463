"""The mesh half of the sequence-parallel layer: how a call is split, and the one shard_map.

A sequence-parallel op takes global arrays whose T axis is split contiguously over the mesh
axis ``seq_axis`` and runs a per-shard body on each piece. Everything about the mesh lives
here, apart from any family and apart from the scan:

* :func:`shard_spec` checks the mesh and the arrays once, at trace time (the axis exists
  and divides T, ``batch_axes`` names real axes, the Pallas rule below) and returns a
  :class:`ShardSpec`: the one frozen, hashable object from which every PartitionSpec of
  the call is derived (recurrentgemma's ``ShardingSpec`` is the model);
* :func:`sharded` runs a family's per-shard body under ``jax.shard_map`` with that spec
  (one jitted program per shape and options) and replicates the last rank's state;
* per-shard helpers the bodies share: :func:`first_token_starts` (packed documents across
  a shard boundary), :func:`from_last_rank`; and :func:`seq_size` / :func:`mesh_size`,
  which the layers use to choose between the sequence-parallel and the one-device op.

Axes the arrays are split over besides the sequence: an Explicit split of B or H (read from
q's type) stays as the caller made it, by making the shard_map manual over those axes too;
Auto axes are left to the compiler, except with Pallas kernels, which the compiler cannot
partition, where every mesh axis must be manual (:func:`manual_axes`).

What it does not do: the scan of states (``zeco_jax.sp.scan``) or any family's maths.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def axes_in(entry) -> set:
  """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
  if entry is None:
    return set()
  return set(entry) if isinstance(entry, tuple) else {entry}


def mesh_or_context(mesh, *, name):
  """``mesh``, else the mesh set with ``jax.set_mesh``; ValueError naming the fix if none."""
  if mesh is not None:
    return mesh
  ctx = jax.sharding.get_abstract_mesh()
  if ctx is None or getattr(ctx, "empty", True) or not ctx.axis_names:
    raise ValueError(f"{name}: no mesh. Pass `mesh=` or call inside `with jax.set_mesh(mesh):`.")
  return ctx


def _context_or(mesh):
  return jax.sharding.get_abstract_mesh() if mesh is None else mesh


def seq_size(mesh, axis: str) -> int:
  """The size of mesh axis ``axis`` (1 without a mesh, or when the mesh lacks the axis);
  ``mesh`` None: the mesh set with ``jax.set_mesh``."""
  mesh = _context_or(mesh)
  if mesh is None or getattr(mesh, "empty", False):
    return 1
  return int(dict(mesh.shape).get(axis, 1))


def mesh_size(mesh) -> int:
  """Devices in ``mesh`` (or the context mesh); 1 without one."""
  mesh = _context_or(mesh)
  if mesh is None or getattr(mesh, "empty", False):
    return 1
  return int(np.prod(list(dict(mesh.shape).values()), dtype=np.int64))


def seq_axis_size(mesh, seq_axis, T, *, name) -> int:
  """The size of mesh axis ``seq_axis``, checked: the axis exists and divides T."""
  if seq_axis not in mesh.axis_names:
    raise ValueError(f"{name}: the mesh has no axis `seq_axis`={seq_axis!r}; its axes are "
                     f"{tuple(mesh.axis_names)}. Pass seq_axis= one of them.")
  P_size = mesh.shape[seq_axis]
  if T % P_size:
    raise ValueError(f"{name}: sequence length T = {T} is not divisible by the size "
                     f"{P_size} of mesh axis {seq_axis!r}; pad T to a multiple of {P_size}.")
  return P_size


def _axis_types(mesh) -> dict:
  return dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))


def explicit_entries(x, mesh, seq_axis, dims) -> tuple:
  """The entries of x's sharding spec at ``dims`` that split over Explicit mesh axes other
  than ``seq_axis`` (None for the rest, and when x's type carries no Explicit split)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  types_ = _axis_types(mesh)
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * x.ndim
  explicit = lambda e: e is not None and e != seq_axis and all(
      types_.get(a) == jax.sharding.AxisType.Explicit for a in axes_in(e))
  return tuple(spec[d] if explicit(spec[d]) else None for d in dims)


def batch_entry(batch_axes, batch_spec, head_spec, mesh, seq_axis, B, *, name):
  """The B entry of the specs: ``batch_axes`` checked against the mesh, else the
  Explicit split of B read from the inputs (``batch_spec``)."""
  if batch_axes is None:
    return batch_spec
  axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  shape = dict(mesh.shape)
  bad = [a for a in axes if not isinstance(a, str) or a not in shape or a == seq_axis
         or a in axes_in(head_spec)]
  if not axes or bad:
    raise ValueError(f"{name}: `batch_axes`={batch_axes!r} must name mesh axes other than "
                     f"seq_axis={seq_axis!r} (and the heads' axes); the mesh's axes are "
                     f"{tuple(mesh.axis_names)}.")
  if batch_spec is not None and set(axes) != axes_in(batch_spec):
    raise ValueError(f"{name}: `batch_axes`={batch_axes!r} disagrees with q's Explicit "
                     f"sharding of B over {batch_spec!r}; pass batch_axes={batch_spec!r} "
                     "or None.")
  size = 1
  for a in axes:
    size *= shape[a]
  if B % size:
    raise ValueError(f"{name}: batch size B = {B} is not divisible by the {size} shards of "
                     f"`batch_axes`={batch_axes!r}; use a batch that is a multiple of {size}.")
  return axes[0] if len(axes) == 1 else axes


def manual_axes(mesh, seq_axis, batch, heads, *, every_axis: bool, name) -> frozenset:
  """The mesh axes the shard_map is manual over: ``seq_axis`` and the axes B and H are
  split over; with ``every_axis`` (Pallas kernels, which the compiler cannot partition)
  every mesh axis, so an unnamed Auto axis of size > 1 is a ValueError there."""
  manual = {seq_axis} | axes_in(batch) | axes_in(heads)
  if not every_axis:
    return frozenset(manual)
  unnamed = [a for a in mesh.axis_names if a not in manual and dict(mesh.shape)[a] > 1]
  if unnamed:
    raise ValueError(
        f"{name}: the Pallas kernels run on whole shards, but mesh axes {tuple(unnamed)} "
        f"(size > 1) split neither the sequence ({seq_axis!r}) nor B nor H as {name} knows. "
        f"Pass batch_axes={unnamed[0]!r} if B is split over it (or shard B / H over "
        "Explicit mesh axes), or use backend='jax'.")
  return frozenset(mesh.axis_names)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
  """How one sequence-parallel call is split: every PartitionSpec derives from it.

  Attributes:
    mesh: the ``Mesh`` (or the abstract context mesh).
    seq_axis: the mesh axis T is split over, contiguously.
    batch, heads: the PartitionSpec entries of B and H (mesh axis names, a tuple of
      them, or None).
    manual: the mesh axes the shard_map is manual over.
    check_vma: shard_map's varying-axes check (off around Pallas calls, whose bodies do
      not carry those types).
  """
  mesh: object
  seq_axis: str
  batch: object = None
  heads: object = None
  manual: frozenset = frozenset()
  check_vma: bool = True

  @property
  def seq_axis_size(self) -> int:
    return int(self.mesh.shape[self.seq_axis])

  def tokens(self, ndim: int) -> P:
    """``[B, T]`` (ids), ``[B, T, H]`` (a per-head gate) or ``[B, T, H, D]`` (q, k, v)."""
    return P(self.batch, self.seq_axis, *((self.heads, None)[:ndim - 2]))

  def state(self) -> P:
    """``[B, H, K, V]``."""
    return P(self.batch, self.heads, None, None)

  def explicit(self) -> bool:
    """Whether B or H is split over Explicit mesh axes (inputs are resharded to the specs)."""
    types_ = _axis_types(self.mesh)
    return any(types_.get(a) == jax.sharding.AxisType.Explicit
               for a in axes_in(self.batch) | axes_in(self.heads))


def shard_spec(q, *, mesh, seq_axis: str, batch_axes=None, every_axis: bool = False,
               check_vma: bool = True, name: str) -> ShardSpec:
  """The :class:`ShardSpec` of a call on ``q`` (``[B, T, H, ...]``), every argument checked:
  the mesh (``mesh`` or the context's), ``seq_axis`` (exists, divides T), ``batch_axes``
  against q's Explicit split of B, and :func:`manual_axes`' rule for ``every_axis``."""
  mesh = mesh_or_context(mesh, name=name)
  seq_axis_size(mesh, seq_axis, q.shape[1], name=name)
  batch, heads = explicit_entries(q, mesh, seq_axis, (0, 2))
  batch = batch_entry(batch_axes, batch, heads, mesh, seq_axis, q.shape[0], name=name)
  manual = manual_axes(mesh, seq_axis, batch, heads, every_axis=every_axis, name=name)
  return ShardSpec(mesh, seq_axis, batch, heads, manual, check_vma)


def on(mesh, spec):
  """``spec`` on ``mesh``: a NamedSharding for a concrete mesh (it needs no context mesh),
  the bare spec for the abstract context mesh."""
  return NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec


def sharded(local: Callable, spec: ShardSpec, arrays: tuple, in_specs: tuple, *,
            options: dict, out_spec: P, final_state: bool = False):
  """``local`` per shard of ``spec``: ``(o, final_state or None)``.

  ``local(*arrays, axis_name=, **options)`` runs on this rank's pieces of ``arrays`` (each
  split by its entry of ``in_specs``, derived from ``spec``: :meth:`ShardSpec.tokens` for
  arrays split like q, :meth:`ShardSpec.state` for states the same on every rank, None
  for a None array) and returns ``(o, state_after_segment)``; ``o`` is split by
  ``out_spec``. ``local`` must be a module-level function and ``options`` hashable values
  (flags, numbers, frozen configs): both are part of the compiled program's identity (one
  program per shape and options, also for eager calls). With ``final_state`` the last
  rank's ``state_after_segment`` comes back replicated over ``seq_axis``; else None.
  """
  return _sharded(tuple(arrays), local=local, spec=spec, in_specs=tuple(in_specs),
                  out_spec=out_spec, options=tuple(sorted(options.items())),
                  final_state=final_state)


# Jitted so that an eager call compiles once per shape and options instead of running the
# shard_map body op by op (seconds for a tiny input); under an outer jit it is inlined.
@functools.partial(jax.jit, static_argnames=("local", "spec", "in_specs", "out_spec",
                                             "options", "final_state"))
def _sharded(arrays, *, local, spec, in_specs, out_spec, options, final_state):
  if spec.explicit():
    # Explicit mesh axes: B and H stay split as the caller split them (the shard_map is
    # manual over those axes too). A NamedSharding, not a bare spec: the caller may have
    # passed `mesh=` without setting it as the context mesh.
    arrays = tuple(None if x is None else jax.sharding.reshard(x, on(spec.mesh, s))
                   for x, s in zip(arrays, in_specs))

  def body(*pieces):
    o, after = local(*pieces, axis_name=spec.seq_axis, **dict(options))
    return (o, from_last_rank(after, spec.seq_axis)) if final_state else o

  run = jax.shard_map(body, mesh=spec.mesh, in_specs=in_specs,
                      out_specs=(out_spec, spec.state()) if final_state else out_spec,
                      axis_names=set(spec.manual), check_vma=spec.check_vma)
  out = run(*arrays)
  return out if final_state else (out, None)


def from_last_rank(after, axis_name):
  """The last rank's state on every rank of ``axis_name``: the final state, replicated.

  One all-reduce of one state in the forward (only the last rank contributes), so the
  shard_map's output needs no slicing of a seq-sharded array, which Explicit mesh axes
  refuse; its transpose sends nothing (the cotangent of a replicated output is already
  on every rank), so the backward's communication is the scan's alone.
  """
  last = lax.axis_index(axis_name) == lax.axis_size(axis_name) - 1
  return lax.psum(jnp.where(last, after, jnp.zeros_like(after)), axis_name)


def first_token_starts(segment_ids, axis_name):
  """bool ``[B]``: whether this rank's first token starts a document (packed documents,
  ``docs/design.md`` §10): its id differs from the previous rank's last id (one ppermute
  of B int32) and is not padding. Never on the first rank, whose first token continues
  the initial state."""
  n = lax.axis_size(axis_name)
  if n == 1:
    return jnp.zeros(segment_ids.shape[:1], bool)
  prev = lax.ppermute(segment_ids[:, -1], axis_name, [(i, i + 1) for i in range(n - 1)])
  first = segment_ids[:, 0]
  return (lax.axis_index(axis_name) > 0) & (first != prev) & (first >= 0)


def previous_shard_tail(x, width: int, axis_name):
  """The last ``width`` tokens (axis 1) of the previous rank's shard; zeros on the first
  rank. One ppermute: a halo (the short convolution's)."""
  n = lax.axis_size(axis_name)
  return lax.ppermute(x[:, x.shape[1] - width:], axis_name, [(i, i + 1) for i in range(n - 1)])


__all__ = ["ShardSpec", "axes_in", "batch_entry", "explicit_entries", "first_token_starts",
           "from_last_rank", "manual_axes", "mesh_or_context", "mesh_size", "on",
           "previous_shard_tail", "seq_axis_size", "seq_size", "shard_spec", "sharded"]
