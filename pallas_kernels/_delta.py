"""What the delta-rule families' kernels share (Gated DeltaNet, Kimi Delta Attention): the
UT inverse ``T = (I + A)^{-1}`` of a chunk's strictly lower A by 16 x 16 blocks, and the
kernels' shape contract. Nothing about a family's decays."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._launch import F32, dot, iota

S = 16                       # rows of a block of the UT inverse


def check_dims(K: int, V: int, C: int, *, family: str) -> None:
  """K and the chunk are whole tiles (powers of two >= 16); V is tiled (a multiple of 16)."""
  for name, d in (("K", K), ("chunk_size", C)):
    if d < 16 or d & (d - 1):
      raise ValueError(f"pallas_kernels.{family}: {name} must be a power of two >= 16 for "
                       f"the Pallas kernels, got {d}; use backend='jax' for other sizes.")
  if V < 16 or V % 16:
    raise ValueError(f"pallas_kernels.{family}: V must be a multiple of 16 for the Pallas "
                     f"kernels, got {V}; use backend='jax' for other sizes.")


def _tile():
  return iota((S, S), 0), iota((S, S), 1)


def _substitute(a):
  """``(I + a)^{-1}`` of one strictly lower ``[S, S]`` block, row by row."""
  r, _ = _tile()
  x = jnp.zeros((S, S), F32)
  for i in range(S):
    row = jnp.sum(jnp.where(r == i, a, 0.0), axis=0)           # a[i, :] by column
    new = jnp.where(iota((S,), 0) == i, 1.0, 0.0) - jnp.sum(row[:, None] * x, axis=0)
    x = jnp.where(r == i, new[None, :], x)
  return x


def block_inverse(A, L):
  """The blocks ``X[I, J]`` (J <= I) of ``(I + A)^{-1}``, float32."""
  X = {(I, I): _substitute(A[I, I]) for I in range(L)}
  for d in range(1, L):
    for I in range(d, L):
      J = I - d
      acc = None
      for M in range(J, I):
        term = dot(A[I, M], X[M, J], F32)
        acc = term if acc is None else acc + term
      X[I, J] = -dot(X[I, I], acc, F32)
  return X
