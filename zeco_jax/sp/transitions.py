"""Transitions: the linear map a rank applies to the state it receives (docs/design.md §7).

A segment of the sequence maps the state entering it to the state leaving it as
``X -> A(X) + S``: ``S`` is the segment's own state (its local pass from zero), ``A`` its
transition. The All-Scan (:mod:`zeco_jax.sp.scan`) is written against the few operations
below, so a new family brings its transition here and leaves the collective alone:

* :class:`Identity`: no decay (``A(X) = X``);
* :class:`ScalarDecay`: one decay per head, ``value [...]`` (simple GLA, Mamba2, RetNet);
  it stays ``[...]`` all the way through the collective, never broadcast to K;
* :class:`DiagonalDecay`: one decay per key dimension, ``value [..., K]`` (GLA);
* :class:`DenseTransition`: a ``K x K`` matrix, ``matrix [..., K, K]``, ``A(X) = M @ X``
  (the delta-rule family, Gated DeltaNet: docs/design.md §7).

States are ``[..., K, V]`` and every transition acts on K only, so a block of V columns
of a state is mapped on its own: that is what lets the pipelined All-Scan split the state
along V. Transitions are pytrees (their arrays are the leaves), so they pass through
``ppermute``, ``all_gather``, ``jnp.where`` (via ``jax.tree.map``) and custom_vjp.

This module holds the algebra only; what a family's local pass and output correction do
with the received state lives with the family (``zeco_jax/ops/<family>/parallel.py``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from zeco_jax._linalg import HI as _HI


class Transition:
  """The operations the All-Scan needs of a transition ``A`` (a linear map on ``[..., K, V]``).

  Subclasses are frozen dataclasses registered as pytrees; their array fields share the
  state's leading dimensions ``[...]``.
  """

  def apply(self, X):
    """``A(X)`` for a state or any block of its V columns, ``X [..., K, Vb]``."""
    raise NotImplementedError

  def transpose(self) -> "Transition":
    """``A^T``: the reverse scan of the backward maps cotangents by it (docs/design.md §5)."""
    raise NotImplementedError

  def compose(self, first: "Transition") -> "Transition":
    """``self o first``: apply ``first``, then ``self`` (the tree's combine of a pair)."""
    raise NotImplementedError

  def cotangent(self, X, E) -> "Transition":
    """The cotangent of ``A`` in ``<E, A(X)>``: a transition of the same kind and shapes."""
    raise NotImplementedError

  def expected_shape(self, state_shape) -> tuple:
    """The shape this kind's array must have for a state of ``state_shape``."""
    raise NotImplementedError

  def check(self, state_shape, *, name: str) -> None:
    for leaf in jax.tree.leaves(self):
      if jnp.shape(leaf) != self.expected_shape(state_shape):
        raise ValueError(
            f"{name}: a {type(self).__name__} for state {tuple(state_shape)} must be "
            f"{self.expected_shape(state_shape)}, got {jnp.shape(leaf)}.")

  def astype(self, dtype) -> "Transition":
    return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), self)

  def nbytes(self, state_shape, itemsize: int = 4) -> int:
    """Bytes of this kind's array for a state of ``state_shape`` (the cost model's m_A)."""
    return 0 if not jax.tree.leaves(self) else int(
        itemsize * _prod(self.expected_shape(state_shape)))


def _prod(shape) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n


def _pytree(*fields):
  """Class decorator: a frozen dataclass whose ``fields`` are its pytree leaves."""
  def register(cls):
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    return jax.tree_util.register_dataclass(cls, data_fields=list(fields), meta_fields=[])
  return register


def _same_kind(a, b):
  if type(a) is not type(b):
    raise TypeError(f"compose: {type(a).__name__} with {type(b).__name__}; a scan composes "
                    "transitions of one kind.")


@_pytree()
class Identity(Transition):
  """No decay: ``A(X) = X``. Nothing to send, nothing to differentiate."""

  def apply(self, X):
    return X

  def transpose(self):
    return self

  def compose(self, first):
    _same_kind(self, first)
    return self

  def cotangent(self, X, E):
    return self

  def expected_shape(self, state_shape):
    return ()


@_pytree("value")
class ScalarDecay(Transition):
  """One decay per head: ``A(X) = value[..., None, None] * X``, ``value [...]``."""
  value: jax.Array

  def apply(self, X):
    return self.value[..., None, None] * X

  def transpose(self):
    return self

  def compose(self, first):
    _same_kind(self, first)
    return ScalarDecay(self.value * first.value)

  def cotangent(self, X, E):
    return ScalarDecay(jnp.sum(X * E, axis=(-2, -1)))

  def expected_shape(self, state_shape):
    return tuple(state_shape[:-2])


@_pytree("value")
class DiagonalDecay(Transition):
  """One decay per key dimension: ``A(X) = value[..., None] * X``, ``value [..., K]``."""
  value: jax.Array

  def apply(self, X):
    return self.value[..., None] * X

  def transpose(self):
    return self

  def compose(self, first):
    _same_kind(self, first)
    return DiagonalDecay(self.value * first.value)

  def cotangent(self, X, E):
    return DiagonalDecay(jnp.sum(X * E, axis=-1))

  def expected_shape(self, state_shape):
    return tuple(state_shape[:-1])


@_pytree("matrix")
class DenseTransition(Transition):
  """A ``K x K`` matrix per head: ``A(X) = matrix @ X``, ``matrix [..., K, K]``."""
  matrix: jax.Array

  def apply(self, X):
    return jnp.einsum("...ij,...jv->...iv", self.matrix, X, precision=_HI)

  def transpose(self):
    return DenseTransition(jnp.swapaxes(self.matrix, -1, -2))

  def compose(self, first):
    _same_kind(self, first)
    return DenseTransition(jnp.einsum("...ij,...jk->...ik", self.matrix, first.matrix,
                                      precision=_HI))

  def cotangent(self, X, E):
    return DenseTransition(jnp.einsum("...iv,...jv->...ij", E, X, precision=_HI))

  def expected_shape(self, state_shape):
    return tuple(state_shape[:-1]) + (state_shape[-2],)


def as_transition(decay, state_shape, *, name: str) -> Transition:
  """``decay`` as a :class:`Transition` for a state of ``state_shape``, checked.

  Accepts a transition, None (:class:`Identity`), or a decay array as :func:`all_scan`
  always has: ``[..., K]`` (:class:`DiagonalDecay`) or ``[...]`` (:class:`ScalarDecay`).
  """
  state_shape = tuple(state_shape)
  if decay is None:
    return Identity()
  if isinstance(decay, Transition):
    decay.check(state_shape, name=name)
    return decay
  shape = tuple(getattr(decay, "shape", ()))
  if hasattr(decay, "shape") and shape == state_shape[:-1]:
    return DiagonalDecay(decay)
  if hasattr(decay, "shape") and shape == state_shape[:-2]:
    return ScalarDecay(decay)
  raise ValueError(
      f"{name}: `decay` must be [..., K] = {state_shape[:-1]} (per dimension), [...] = "
      f"{state_shape[:-2]} (per head), None (no decay) or a zeco_jax.transitions.Transition "
      f"(e.g. DenseTransition [..., K, K]) for state {state_shape}, got "
      f"{shape if hasattr(decay, 'shape') else type(decay).__name__}.")
