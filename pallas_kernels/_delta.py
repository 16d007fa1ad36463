"""What the delta-rule families' kernels share (Gated DeltaNet, Kimi Delta Attention): the
UT inverse ``T = (I + A)^{-1}`` of a chunk's strictly lower A by 16 x 16 blocks, the
kernels' shape contract, their residual, and the two sequential walks over chunks.

The walks, grid ``(B, H, V / BV)``: each program owns a ``[K, BV]`` tile of one head's
state (the delta rule's ``w h`` reads every key channel, so K is never split) and walks
the chunks in order, or in reverse:

  forward:  h[n] = the state entering chunk n;  v_new = u - w h;
            h <- D h + kd^T v_new                              (and the final state)
  backward: dH[n] = the cotangent of the state leaving chunk n;
            dv_new = dvl + kd dH[n];
            dh <- D dh + qb^T do - w^T dv_new                  (and dh0)

with a family's per-chunk operands (``w``, ``u``, ``kd``, ``qb = scale e^{b} q``) and its
chunk decay D = e^{gamma} given as ``decay``: Gated DeltaNet's ``[B, H, N]`` (one scalar a
chunk), or Kimi Delta Attention's ``[B, H, N, K]`` (a decay per key row). Each step loads
its chunk's operands, which Triton's software pipeliner stages through shared memory.
Gated DeltaNet passed its in-chunk decays b ``[B, T, H]`` before and each step summed out
gamma: the forward walk took 0.377 against 0.269 ms with the scalar (H100, B1 T16384 H16
K=V=128; ``benchmarks/results/gdn_h200.md``).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._config import SHARED_MEMORY_BYTES, walk_stage_bytes
from pallas_kernels._launch import (F32, block, call, dot, iota, program_barrier, unroll_for,
                                    unrolled)

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


def check_state_columns(v, initial_state, *, family: str) -> None:
  """The forward's state may be wider than v (``initial_state [B, H, K, V']``, V' >= V, a
  multiple of 16): its columns past v's get no values (u is zero there), as the
  sequence-parallel local pass's identity columns, whose zero columns of v are then never
  written to memory. The backward takes v as wide as the state."""
  V, Vs = v.shape[-1], initial_state.shape[-1]
  if Vs < V or Vs % 16:
    raise ValueError(f"the {family} kernels' forward: initial_state has {Vs} value columns "
                     f"for v's {V}; it needs at least v's, a multiple of 16.")


def _substitute_stacked(L, gather, roundtrip, unroll):
  """``(I + a)^{-1}`` of all L strictly lower diagonal ``[S, S]`` blocks at once, through
  memory: the blocks' inverses formed transposed and stacked, ``y [L * S, S]`` (block
  I's rows at I * S), column by column: ``y[:, i] = e_i - y a_i^T``, ``gather(i)`` giving
  ``[L * S, S]``, on each row row i of that row's own block (strictly lower, from
  memory). 16 steps for the chunk instead of 16 per block, every step's sum along a tile
  row (inside one warp in Triton's layout; the row-by-row form, one block at a time from
  register tiles, summed down the columns, across the warps, and measured slower:
  ``benchmarks/results/gdn_h200.md``). ``roundtrip(y)`` stores y, and after a barrier
  returns the blocks ``y_I^T``; ``unroll`` steps per loop iteration (``unrolled``: all 16
  under Triton, one in the interpreter)."""
  C = L * S
  pos, c = iota((C,), 0) % S, iota((C, S), 1)

  def column(i, y):
    new = jnp.where(pos == i, 1.0, 0.0) - jnp.sum(y * gather(i), axis=1)
    return jnp.where(c == i, new[:, None], y)

  return roundtrip(unrolled(S, unroll, column, jnp.zeros((C, S), F32)))


# The merges' products for inputs narrower than float32: three bfloat16 products of each
# operand's two-part split on the tensor cores (about 16 bits of each operand, float32
# accumulation), instead of IEEE float32 products on the CUDA cores.
NARROW_MERGE = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3


def merge_dot(a, b, input_dtype):
  """``a @ b`` of two float32 ``[S, S]`` tiles of the UT inverse's merges. float32 inputs:
  IEEE float32 (HIGHEST). Narrower inputs, whose T is stored in their dtype: the three
  bfloat16 products of :data:`NARROW_MERGE`, whose error (about 2^-17 of each product) is
  far below T's own rounding (2^-9 for bf16). Measured on an H100 (B8 T4096 H16 K=V=128
  bf16, ``benchmarks/results/gdn_h200.md``): Gated DeltaNet's forward 1.187 -> 1.160 ms,
  its output 2e-4 from the IEEE form's (relative norm; the bf16 output's own error is
  about 3e-3); one bf16 product (1.125 ms) or TF32 (1.141 ms) moved it 1.9e-3 and 1.3e-3."""
  if jnp.dtype(input_dtype) == F32:
    return dot(a, b, F32)
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=NARROW_MERGE,
                             preferred_element_type=F32)


def block_inverse(A, L, stacked, input_dtype):
  """The blocks ``X[I, J]`` (J <= I) of ``(I + A)^{-1}``, float32, from A's blocks below
  the diagonal (``A[I, J]``, J < I) and ``stacked = (gather, roundtrip, unroll)``
  (:func:`stacked_through`): the diagonal blocks all at once through memory
  (:func:`_substitute_stacked`), the blocks below by ``X_IJ = -X_II sum_{J <= M < I} A_IM
  X_MJ`` with the products of :func:`merge_dot` for the op's ``input_dtype``."""
  X = {(I, I): x for I, x in enumerate(_substitute_stacked(L, *stacked))}
  for d in range(1, L):
    for I in range(d, L):
      J = I - d
      acc = None
      for M in range(J, I):
        term = merge_dot(A[I, M], X[M, J], input_dtype)
        acc = term if acc is None else acc + term
      X[I, J] = -merge_dot(X[I, I], acc, input_dtype)
  return X


def stacked_through(scratch_ref, b, hd, n, C, config, row_of):
  """``block_inverse``'s ``stacked`` for one chunk: ``gather(i)`` is ``row_of(i,
  first)`` with ``first`` ``[C]`` each row's block start in the chunk; ``roundtrip`` stores
  the stacked transposed inverses to ``scratch_ref`` (``[B, T, H, 16]`` float32, free once
  the gathers are done) and reads the blocks back transposed; the substitution's steps
  per loop iteration (:func:`pallas_kernels._launch.unroll_for`)."""
  first = (iota((C,), 0) // S) * S
  rows = [pl.ds(n * C + I * S, S) for I in range(C // S)]

  def roundtrip(y):
    program_barrier(config)            # every gather of the scratch has been done
    scratch_ref[b, pl.ds(n * C, C), hd, :] = y
    program_barrier(config)
    return [scratch_ref[b, r, hd, :].T for r in rows]

  return (lambda i: row_of(i, first)), roundtrip, unroll_for(config, S)


class Residual(NamedTuple):
  """What a family's ``fwd_res`` keeps for ``bwd_res``: the state entering each chunk, or
  None (``config.save_states`` off: ``bwd_res`` walks them again)."""
  h: jax.Array


# --- the walks ----------------------------------------------------------------------------

def _load_decay(ref, b, hd, n, rows):
  return ref[b, hd, n, :] if rows else ref[b, hd, n]


def _apply_decay(d, x, rows):
  """D x: ``d`` per key row (``[K]``), or one scalar for the chunk."""
  return d[:, None] * x if rows else d * x


def _chunk_loop(N, step, load, init, *, reverse=False):
  """The walks' loop over the N chunks (last to first with ``reverse``): ``step(n, carry,
  load(n))``. Each step loads its own operands, which leaves Triton's software pipeliner
  to stage them through shared memory (``num_stages``: :func:`check_walk_stages`). The
  form that carried the next chunk's operands in registers lost (``docs/kernels.md``)."""
  at = (lambda i: N - 1 - i) if reverse else (lambda i: i)
  return jax.lax.fori_loop(0, N, lambda i, c: step(at(i), c, load(at(i))), init)


def check_walk_stages(*, stage, launch, C, K, BV, itemsize, grad):
  """ValueError when a walk's pipelined operands alone
  (:func:`pallas_kernels._config.walk_stage_bytes` times ``launch.stages``) exceed
  :data:`~pallas_kernels._config.SHARED_MEMORY_BYTES`: such a launch fails at run time
  (RESOURCE_EXHAUSTED), so it is refused while tracing. A lower bound of what Triton
  allocates, so nothing that fits is refused."""
  need = launch.stages * walk_stage_bytes(C, K, BV, itemsize, grad=grad)
  if need > SHARED_MEMORY_BYTES:
    raise ValueError(
        f"KernelConfig: `{stage}_stages`={launch.stages} with a V tile of {BV} at K = {K} "
        f"({itemsize}-byte inputs) pipelines at least {need} bytes of operands through "
        f"shared memory, more than a GPU's {SHARED_MEMORY_BYTES}; lower `{stage}_stages` "
        f"or `{stage}_bv` (the default config fits).")


def _load_values(u_ref, b, t, hd, iv, *, C, BV, NU):
  """u's ``[C, BV]`` tile ``iv`` of the state's columns; zeros for a tile at or past u's
  ``NU`` tiles (the state wider than u: a masked load, no bytes read)."""
  if NU is None:
    return u_ref[b, t, hd, pl.ds(iv * BV, BV)]
  from jax.experimental.pallas import triton as pltriton
  mask = iota((C, BV), 1) < (NU - iv) * BV           # all on below NU, all off from it
  return pltriton.load(u_ref.at[b, t, hd, pl.ds(jnp.minimum(iv, NU - 1) * BV, BV)],
                       mask=mask, other=0)


def _walk_kernel(w_ref, u_ref, kd_ref, d_ref, h0_ref, h_ref, vn_ref, ht_ref, *, C, N, BV, NU,
                 dt, rows):
  b, hd, iv = (pl.program_id(i) for i in range(3))
  vs = pl.ds(iv * BV, BV)

  def load(n):
    t = pl.ds(n * C, C)
    return (w_ref[b, t, hd, :], _load_values(u_ref, b, t, hd, iv, C=C, BV=BV, NU=NU),
            kd_ref[b, t, hd, :], _load_decay(d_ref, b, hd, n, rows))

  def step(n, h, operands):
    w, u, kd, d = operands
    h_ref[b, hd, n, :, vs] = h.astype(h_ref.dtype)
    vn = u.astype(F32) - dot(w, h, dt)
    vn_ref[b, pl.ds(n * C, C), hd, vs] = vn.astype(vn_ref.dtype)
    return _apply_decay(d, h, rows) + dot(kd, vn, dt, ta=True)

  h = _chunk_loop(N, step, load, h0_ref[b, hd, :, vs].astype(F32))
  ht_ref[b, hd, :, vs] = h


def state_walk(w, u, kd, decay, h0, *, chunk_size, config, store_dtype, prefix):
  """(h [B, H, N, K, V] in ``store_dtype``, v_new [B, T, H, V] in u's dtype, final state
  float32) with V the state's columns (h0's); the kernel is named ``<prefix>_state_walk``.
  u may have fewer columns than the state (:func:`check_state_columns`): the columns past
  u's take it as zero, so a state widened by columns that carry no values (the
  sequence-parallel local pass's K identity columns) needs no zero columns in memory."""
  B, T, H, K = w.shape
  U, V = u.shape[-1], h0.shape[-1]
  N = T // chunk_size
  BV = block(math.gcd(U, V), config.walk.bv)      # no tile straddles u's last column
  if not config.interpret:
    check_walk_stages(stage="walk", launch=config.walk, C=chunk_size, K=K, BV=BV,
                      itemsize=w.dtype.itemsize, grad=False)
  kern = functools.partial(_walk_kernel, C=chunk_size, N=N, BV=BV,
                           NU=None if U == V else U // BV, dt=w.dtype, rows=decay.ndim == 4)
  out = (jax.ShapeDtypeStruct((B, H, N, K, V), store_dtype),
         jax.ShapeDtypeStruct((B, T, H, V), u.dtype), jax.ShapeDtypeStruct((B, H, K, V), F32))
  return call(kern, out, (B, H, V // BV), config=config, num_warps=config.walk.warps,
              num_stages=config.walk.stages, name=f"{prefix}_state_walk")(w, u, kd, decay, h0)


def _dwalk_kernel(qb_ref, d_ref, w_ref, kd_ref, do_ref, dvl_ref, dht_ref, dh_ref, dvn_ref,
                  dh0_ref, *, C, N, BV, dt, rows):
  b, hd, iv = (pl.program_id(i) for i in range(3))
  vs = pl.ds(iv * BV, BV)

  def load(n):
    t = pl.ds(n * C, C)
    return (qb_ref[b, t, hd, :], _load_decay(d_ref, b, hd, n, rows), w_ref[b, t, hd, :],
            kd_ref[b, t, hd, :], do_ref[b, t, hd, vs], dvl_ref[b, t, hd, vs])

  def step(n, dh, operands):
    qb, d, w, kd, do, dvl = operands
    dh_ref[b, hd, n, :, vs] = dh.astype(dh_ref.dtype)
    dvn = dvl + dot(kd, dh, dt)
    dvn_ref[b, pl.ds(n * C, C), hd, vs] = dvn.astype(dvn_ref.dtype)
    return (_apply_decay(d, dh, rows) + dot(qb, do, dt, ta=True)
            - dot(w, dvn, dt, ta=True))

  dh = _chunk_loop(N, step, load, dht_ref[b, hd, :, vs].astype(F32), reverse=True)
  dh0_ref[b, hd, :, vs] = dh


def grad_walk(qb, decay, w, kd, do, dvl, dht, *, chunk_size, config, store_dtype, prefix):
  """(dH [B, H, N, K, V] in ``store_dtype``, dv_new [B, T, H, V] in qb's dtype, dh0
  float32); the kernel is named ``<prefix>_grad_walk``. dv_new's readers (the families'
  ``dqk`` and ``dwy``) take it only as a dot operand of that dtype, so storing it so
  rounds nothing they would not."""
  B, T, H, K = qb.shape
  V = do.shape[-1]
  N = T // chunk_size
  BV = block(V, config.dwalk.bv)
  if not config.interpret:
    check_walk_stages(stage="dwalk", launch=config.dwalk, C=chunk_size, K=K, BV=BV,
                      itemsize=qb.dtype.itemsize, grad=True)
  kern = functools.partial(_dwalk_kernel, C=chunk_size, N=N, BV=BV, dt=qb.dtype,
                           rows=decay.ndim == 4)
  out = (jax.ShapeDtypeStruct((B, H, N, K, V), store_dtype),
         jax.ShapeDtypeStruct(dvl.shape, qb.dtype), jax.ShapeDtypeStruct((B, H, K, V), F32))
  return call(kern, out, (B, H, V // BV), config=config, num_warps=config.dwalk.warps,
              num_stages=config.dwalk.stages, name=f"{prefix}_grad_walk")(
                  qb, decay, w, kd, do, dvl, dht)
