"""What every family's Pallas kernels share: the launch (interpreter or Triton, with the
varying-axes bookkeeping shard_map needs), dots without silent TF32, and small loop and
tile helpers. Nothing about any family's maths.

Every kernel takes whole-array refs (no BlockSpecs) and indexes them itself with
``program_id``, so the public layout ``[B, T, H, D]`` is read in place. Triton-lowering
constraints (``../shared/jax_notes.md``): tile sizes are powers of two and at least 16 where
they feed a dot; a loaded value is never sliced; float32 dots ask for
``precision=HIGHEST`` (IEEE, not TF32).

This package never imports ``zeco_jax`` (the ops import it, at run time only).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

F32 = jnp.float32
HI = lax.Precision.HIGHEST      # float32 dots in IEEE float32, never TF32


def check_vma_enabled() -> bool:
  """Whether the enclosing ``jax.shard_map`` runs with ``check_vma=True``.

  No public API reads this (shard_map's trace-time context; ``zeco_jax._jax_private`` has
  the same lookup for the ops). False when the private name has moved: the kernels then
  declare no varying axes, which shard_map with ``check_vma=True`` reports at trace time.
  """
  try:
    from jax._src import config as jax_config
    return bool(jax_config._check_vma.value)
  except (ImportError, AttributeError):
    return False


def compiler_params(config, num_warps: int, num_stages: int):
  if config.interpret:
    return None
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def varying_axes(x):
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def with_varying(fn, out_shape, args):
  """``fn(out_shape=out_shape)(*args)`` for a ``pallas_call`` partial ``fn``.

  Inside ``shard_map(check_vma=True)`` (a sequence-parallel local pass) pallas_call needs
  to know how its outputs vary over the manual mesh axes: every input is cast to the union
  of the inputs' varying axes, and the outputs are declared varying over the same axes.
  """
  if not check_vma_enabled():
    return fn(out_shape=out_shape)(*args)
  axes = frozenset().union(*(varying_axes(a) for a in args))
  if axes:
    args = [a if varying_axes(a) == axes else
            jax.lax.pcast(a, tuple(sorted(axes - varying_axes(a))), to="varying")
            for a in args]
  mat = jax.typeof(args[0]).manual_axis_type
  outs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat),
                      out_shape)
  # Note: the Pallas *interpreter* still fails here (its dynamic_slice mixes varying refs
  # with invariant constants); call the ops with check_vma=False to interpret on CPU.
  return fn(out_shape=outs)(*args)


def call(kernel, out_shape, grid, *, config, num_warps, num_stages, name, aliases=None):
  """pallas_call over whole-array refs, launched as ``config`` says (the interpreter, or
  Triton with ``num_warps`` / ``num_stages``), under shard_map's varying-axes rule
  (:func:`with_varying`)."""
  fn = functools.partial(pl.pallas_call, kernel, grid=grid, interpret=config.interpret,
                         compiler_params=compiler_params(config, num_warps, num_stages),
                         name=name, input_output_aliases=aliases or {})
  return lambda *args: with_varying(fn, out_shape, args)


def program_barrier(config) -> None:
  """Make what one program's threads stored to memory visible to all its threads before
  they load it (Triton's ``debug_barrier``, a ``__syncthreads``). Nothing in the
  interpreter, which runs a program's operations in order."""
  if not config.interpret:
    from jax.experimental.pallas import triton as pltriton
    pltriton.debug_barrier()


def head_major(x):
  """``[B, T, H, D]`` -> ``[B*H, T, D]`` (the TPU kernels' dense ``[C, D]`` tiles)."""
  B, T, H, D = x.shape
  return x.transpose(0, 2, 1, 3).reshape(B * H, T, D)


def from_head_major(x, B, H):
  """``[B*H, T, D]`` -> ``[B, T, H, D]``."""
  _, T, D = x.shape
  return x.reshape(B, H, T, D).transpose(0, 2, 1, 3)


def dot(a, b, dtype, *, ta=False, tb=False):
  """a @ b (a^T when ``ta``, b^T when ``tb``) with float32 accumulation.

  ``dtype`` is the operand dtype: bfloat16/float16 operands use the tensor cores at full
  rate; float32 operands use IEEE float32 (precision HIGHEST), never silent TF32.
  """
  dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
  if dtype == F32:
    return lax.dot_general(a.astype(F32), b.astype(F32), dims, precision=HI,
                           preferred_element_type=F32)
  return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=F32)


def dot01(m, x):
  """``m @ x`` for a 0 / 1 float32 matrix ``m`` and a float32 tile ``x``, to float32
  rounding, on the tensor cores: x = hi + mid + lo in bfloat16 (each part the rounding of
  what the parts before leave, so the three carry x's 24 bits), every product with a 0 or
  1 exact, the three dots accumulated in float32. A masked sum along a tile's rows at
  bf16 dot speed (the KDA backward's form); an IEEE float32 dot runs on the CUDA cores.
  :func:`pallas_kernels._scan.rows_sum` is the same sum as one Triton scan, faster in the
  KDA forward's kernels and slower in its backward's (``benchmarks/results/kda_h200.md``)."""
  bf = jnp.bfloat16
  hi = x.astype(bf)
  rest = x - hi.astype(F32)
  mid = rest.astype(bf)
  lo = (rest - mid.astype(F32)).astype(bf)
  return dot(m, hi, bf) + dot(m, mid, bf) + dot(m, lo, bf)


def iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


LOG2E = 1.4426950408889634


def fast_exp(x):
  """e^x for the GPU kernels as 2^(x log2 e): a multiply and the special-function unit's
  ``ex2.approx`` under Triton (about 2 ulp, plus the product's rounding, 2^-24 |x log2 e|
  relative), where ``jnp.exp`` becomes libdevice's ``expf``, about nine instructions. The
  kernels' exponents are <= 0 (decays), so the product's rounding is largest where e^x is
  smallest."""
  return jnp.exp2(x * LOG2E)


def masked_exp(mask, x, exp=jnp.exp):
  """exp(x) where mask, 0 elsewhere; the exponent is masked first, so no inf * 0.
  ``exp``: ``jnp.exp``, or :func:`fast_exp` in the kernels that take it."""
  return exp(jnp.where(mask, x, -jnp.inf))


def unrolled(n, unroll, body, carry):
  """``carry = body(i, carry)`` for i in range(n), ``unroll`` steps per iteration of a
  fori_loop; ``unroll >= n``: a plain Python loop (i a Python int, unrolled at trace
  time, so Triton can issue loads that do not depend on the carry ahead of the chain).
  Kernels take ``unroll`` from :func:`unroll_for`."""
  if unroll >= n:
    for i in range(n):
      carry = body(i, carry)
    return carry

  def outer(o, c):
    for u in range(unroll):
      c = body(o * unroll + u, c)
    return c

  return jax.lax.fori_loop(0, n // unroll, outer, carry)


def unroll_for(config, unroll: int) -> int:
  """The steps per loop iteration a kernel is traced with (:func:`unrolled`): ``unroll``
  for Triton, whose load scheduling is why a loop is unrolled; 1 in the interpreter,
  which runs the same body in order either way and would otherwise lower and compile
  ``unroll`` copies of it (on the 2-core CPU machine, KDA's three slowest kernel tests
  took 22 s instead of 34). ``tests/kernels/test_unrolled_loops.py`` runs each family's
  kernels in the interpreter with the Triton unroll too, against the one-step form."""
  return 1 if config.interpret else unroll


def tiles(D: int, cap: int) -> list:
  """Slices of D in tiles of :func:`block` (D, cap)."""
  B = block(D, cap)
  return [pl.ds(i * B, B) for i in range(D // B)]


def block(n: int, cap: int) -> int:
  """Largest power of two <= cap dividing n (n itself if n <= cap and a power of two)."""
  b = 1
  while b * 2 <= min(n, cap) and n % (b * 2) == 0:
    b *= 2
  return b
