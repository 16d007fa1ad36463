"""What the delta-rule families' Mosaic TPU kernels share (Gated DeltaNet's
:mod:`pallas_kernels.gated_delta.tpu`, Kimi Delta Attention's :mod:`pallas_kernels.kda.tpu`):
exact float32 products, row / column moves of ``[1, C]`` and ``[C, 1]`` tiles, the rows of an
``[ROWS, C]`` block picked and written by a traced index, the float32 UT inverse by 16 x 16
blocks, the per-chunk rows of g and beta, and the launch (Mosaic or the interpreter, with
shard_map's varying axes). Nothing about either family's maths.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _delta
from pallas_kernels._config import state_store_dtype
from pallas_kernels._delta import Residual
from pallas_kernels._launch import F32, HI, from_head_major, head_major, iota, with_varying

S = 16                       # rows of a diagonal block of the UT inverse
ROWS = 8                     # chunks per block of the g / beta rows (a sublane tile)


def exact(a, b):
  """float32 a @ b at HIGHEST: segment sums and the UT inverse."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HI,
                         preferred_element_type=F32)


def to_col(row):
  """``[1, C]`` -> ``[C, 1]`` (a masked reduction, exact)."""
  C = row.shape[1]
  return jnp.sum(jnp.where(iota((C, C), 0) == iota((C, C), 1), row, 0.0), axis=1,
                 keepdims=True)


def to_row(col):
  """``[C, 1]`` -> ``[1, C]``."""
  C = col.shape[0]
  return jnp.sum(jnp.where(iota((C, C), 0) == iota((C, C), 1), col, 0.0), axis=0,
                 keepdims=True)


def pick(ref, j):
  """Row j (traced) of an ``[ROWS, C]`` block: ``[1, C]`` float32."""
  x = ref[...].astype(F32)
  return jnp.sum(jnp.where(iota(x.shape, 0) == j, x, 0.0), axis=0, keepdims=True)


def put(ref, j, row):
  """Row j (traced) of an ``[ROWS, C]`` output block := row."""
  ref[...] = jnp.where(iota(ref.shape, 0) == j, row, ref[...])


def ut_inverse(A):
  """``(I + A)^{-1}`` of a strictly lower ``[C, C]`` float32 A (C a power of two >= 16).

  The 16 x 16 diagonal blocks by forward substitution (row step s fills row s of every
  block from the rows above it), then neighbouring blocks merged,
  ``[[X11, 0], [A21, X22]]^{-1} = [[X11, 0], [-X22 A21 X11, X22]]``, as one full-chunk
  product per level on the blocks' lower-left quadrants.
  """
  C = A.shape[0]
  r, c = iota((C, C), 0), iota((C, C), 1)
  eye = (r == c).astype(F32)
  diag = jnp.where(r // S == c // S, A, 0.0)
  off = r % S
  X = eye
  for s in range(1, S):
    X = jnp.where(off == s, eye - exact(diag, X), X)
  size = S
  while size < C:
    lower_left = (r // (2 * size) == c // (2 * size)) & (r // size != c // size)
    X = X - exact(X, exact(jnp.where(lower_left, A, 0.0), X))
    size *= 2
  return X


def chunk_rows(x, C):
  """``[B, T, H]`` -> float32 ``[B*H, N8, C]``: one row per chunk, N padded to ROWS."""
  B, T, H = x.shape
  N = T // C
  x = x.astype(F32).transpose(0, 2, 1).reshape(B * H, N, C)
  return jnp.pad(x, ((0, 0), (0, -N % ROWS), (0, 0)))


def from_chunk_rows(x, B, H, T):
  C = x.shape[-1]
  return x[:, :T // C].reshape(B, H, T).transpose(0, 2, 1)


def params(config):
  if config.interpret:
    return None
  return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def call(kernel, *, out_shape, in_specs, out_specs, grid, scratch, config, name, cost):
  """pallas_call on Mosaic (or the interpreter); inside ``shard_map(check_vma=True)`` the
  inputs are cast to the union of their varying axes and the outputs declared so."""
  fn = functools.partial(pl.pallas_call, kernel, grid=grid, in_specs=in_specs,
                         out_specs=out_specs, scratch_shapes=scratch,
                         compiler_params=params(config), interpret=config.interpret,
                         name=name, cost_estimate=None if config.interpret else cost)
  return lambda *args: with_varying(fn, out_shape, args)


# --- a family's forward / backward pair ---------------------------------------------------

def _specs(C, K, V, N, reverse):
  at = (lambda n: N - 1 - n) if reverse else (lambda n: n)
  tile = lambda D: pl.BlockSpec((None, C, D), lambda i, n: (i, at(n), 0))
  rows = pl.BlockSpec((None, ROWS, C), lambda i, n: (i, at(n) // ROWS, 0))
  state = pl.BlockSpec((None, K, V), lambda i, n: (i, 0, 0))
  chunk_state = pl.BlockSpec((None, None, K, V), lambda i, n: (i, at(n), 0, 0))
  return tile, rows, state, chunk_state


class Kernels:
  """A delta-rule family's fused Mosaic forward and reverse backward, launched alike: grid
  ``(B*H, N)`` with the chunk axis sequential, q, k, v (and do) head-major ``[B*H, T, D]``,
  beta one row of C per chunk, the ``K x V`` state in a float32 VMEM scratch, the chunk
  states h ``[B, H, N, K, V]`` the residual.

  The family gives its kernels (``fwd_kernel(q, k, v, g, beta, h0, o, ht, [h], *, scale,
  dt, N)``, ``bwd_kernel(q, k, v, g, beta, do, h, dht, dq, dk, dv, dg, dbeta, dh0, dh
  scratch, *, scale, dt, N)``), their names ``<prefix>_tpu_fwd`` / ``_bwd``, how g is laid
  out (``g_per_key``: ``[B, T, H, K]`` head-major like k; else ``[B, T, H]`` one row per
  chunk like beta), its ``check_dims``, and the cost it declares per chunk
  (``flops(C, K, V, backward)``, ``transcendentals(C, K, V, backward)``).
  """

  def __init__(self, *, prefix, fwd_kernel, bwd_kernel, g_per_key, check_dims, flops,
               transcendentals):
    self.prefix, self.g_per_key, self.check_dims = prefix, g_per_key, check_dims
    self.fwd_kernel, self.bwd_kernel = fwd_kernel, bwd_kernel
    self.flops, self.transcendentals = flops, transcendentals

  def _cost(self, BH, N, C, K, V, args, outs, backward):
    nbytes = sum(x.size * x.dtype.itemsize for x in (*args, *jax.tree.leaves(outs)))
    return pl.CostEstimate(flops=int(BH * N * self.flops(C, K, V, backward)),
                           transcendentals=int(BH * N * self.transcendentals(C, K, V, backward)),
                           bytes_accessed=int(nbytes))

  def _widened(self, v, initial_state):
    """v with zero columns up to the state's (a state wider than v: the GPU walk reads
    none; the kernel here takes the state's width from v's tiles)."""
    _delta.check_state_columns(v, initial_state, family=self.prefix)
    return jnp.pad(v, ((0, 0),) * 3 + ((0, initial_state.shape[-1] - v.shape[-1]),))

  def _inputs(self, q, k, v, g, beta, initial_state, C):
    B, T, H, K = q.shape
    V = v.shape[-1]
    g = head_major(g.astype(F32)) if self.g_per_key else chunk_rows(g, C)
    return (*map(head_major, (q, k, v)), g, chunk_rows(beta, C),
            initial_state.reshape(B * H, K, V).astype(F32))

  def _forward(self, q, k, v, g, beta, h0, *, scale, C, store, config):
    """Head-major forward: (o [BH, T, V], final [BH, K, V], h [BH, N, K, V] or None)."""
    BH, T, K = q.shape
    V = v.shape[-1]
    N = T // C
    tile, rows, state, chunk_state = _specs(C, K, V, N, reverse=False)
    gspec = tile(K) if self.g_per_key else rows
    out_shape = [jax.ShapeDtypeStruct((BH, T, V), v.dtype),
                 jax.ShapeDtypeStruct((BH, K, V), F32)]
    out_specs = [tile(V), state]
    if store is not None:
      out_shape.append(jax.ShapeDtypeStruct((BH, N, K, V), store))
      out_specs.append(chunk_state)
    args = (q, k, v, g, beta, h0)
    outs = call(functools.partial(self.fwd_kernel, scale=scale, dt=q.dtype, N=N),
                out_shape=tuple(out_shape),
                in_specs=[tile(K), tile(K), tile(V), gspec, rows, state],
                out_specs=tuple(out_specs), grid=(BH, N), scratch=[pltpu.VMEM((K, V), F32)],
                config=config, name=f"{self.prefix}_tpu_fwd",
                cost=self._cost(BH, N, C, K, V, args, out_shape, False))(*args)
    return outs[0], outs[1], (outs[2] if store is not None else None)

  def fwd_res(self, q, k, v, g, beta, *, scale, initial_state, chunk_size, config):
    """((o [B, T, H, V] in v's dtype, final_state float32), :class:`~pallas_kernels._delta.
    Residual`: the chunk states h ``[B, H, N, K, V]``)."""
    B, T, H, K = q.shape
    self.check_dims(K, v.shape[-1], chunk_size)
    v = self._widened(v, initial_state)
    V = v.shape[-1]
    o, final, h = self._forward(*self._inputs(q, k, v, g, beta, initial_state, chunk_size),
                                scale=scale, C=chunk_size,
                                store=state_store_dtype(config, k.dtype), config=config)
    N = T // chunk_size
    return ((from_head_major(o, B, H), final.reshape(B, H, K, V)),
            Residual(h.reshape(B, H, N, K, V)))

  def fwd(self, q, k, v, g, beta, *, scale, initial_state, chunk_size, config):
    """(o [B, T, H, V] in v's dtype, final_state float32); keeps no chunk states."""
    B, T, H, K = q.shape
    self.check_dims(K, v.shape[-1], chunk_size)
    v = self._widened(v, initial_state)
    V = v.shape[-1]
    o, final, _ = self._forward(*self._inputs(q, k, v, g, beta, initial_state, chunk_size),
                                scale=scale, C=chunk_size, store=None, config=config)
    return from_head_major(o, B, H), final.reshape(B, H, K, V)

  def bwd_res(self, res, q, k, v, g, beta, do, dht, *, scale, initial_state, chunk_size,
              config):
    """(dq, dk, dv [B, T, H, D] in q's, k's, v's dtype, dg float32 in g's shape, dbeta
    float32 [B, T, H], dh0 float32); ``res`` is ``fwd_res``'s residual, or None (a forward
    run emits the chunk states)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = T // C
    self.check_dims(K, V, C)
    qh, kh, vh, gh, br, h0 = self._inputs(q, k, v, g, beta, initial_state, C)
    if res is None:
      _, _, hs = self._forward(qh, kh, vh, gh, br, h0, scale=scale, C=C,
                               store=state_store_dtype(config, k.dtype), config=config)
    else:
      hs = res.h.reshape(B * H, N, K, V)
    doh = head_major(do.astype(v.dtype))
    tile, rows, state, chunk_state = _specs(C, K, V, N, reverse=True)
    gspec = tile(K) if self.g_per_key else rows
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    out_shape = (like(qh), like(kh), like(vh), like(gh), like(br), like(h0))
    args = (qh, kh, vh, gh, br, doh, hs, dht.reshape(B * H, K, V).astype(F32))
    dq, dk, dv, dg, dbeta, dh0 = call(
        functools.partial(self.bwd_kernel, scale=scale, dt=q.dtype, N=N), out_shape=out_shape,
        in_specs=[tile(K), tile(K), tile(V), gspec, rows, tile(V), chunk_state, state],
        out_specs=(tile(K), tile(K), tile(V), gspec, rows, state), grid=(B * H, N),
        scratch=[pltpu.VMEM((K, V), F32)], config=config, name=f"{self.prefix}_tpu_bwd",
        cost=self._cost(B * H, N, C, K, V, args, out_shape, True))(*args)
    back = lambda x: from_head_major(x, B, H)
    dg = back(dg) if self.g_per_key else from_chunk_rows(dg, B, H, T)
    return (back(dq), back(dk), back(dv), dg, from_chunk_rows(dbeta, B, H, T),
            dh0.reshape(B, H, K, V))

  def bwd(self, q, k, v, g, beta, do, dht, *, scale, initial_state, chunk_size, config):
    """:meth:`bwd_res` without a residual (the forward kernel emits the chunk states)."""
    return self.bwd_res(None, q, k, v, g, beta, do, dht, scale=scale,
                        initial_state=initial_state, chunk_size=chunk_size, config=config)
