"""Shared helpers for the GLA Pallas kernels: dots, decay masks, launch options.

Every kernel here takes whole-array refs (no BlockSpecs) and indexes them itself with
``program_id``: the public layout ``[B, T, H, D]`` is read in place (strided tiles of
``[C, D]`` rows), so no transpose of q, k, v, g or do is ever materialised.

Triton-lowering constraints this code respects (see /work/shared/jax_notes.md): tile
sizes are powers of two and at least 16 where they feed a dot; a loaded value is never
sliced (sub-chunks are loaded from the ref); no reverse cumsum (``rev = total - cumsum
+ x``); float32 dots ask for ``precision=HIGHEST`` (IEEE, not TF32).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

SUB = 16                     # sub-chunk rows: the unit of the exact log-space diagonal
F32 = jnp.float32

# Launch parameters, read at trace time (benchmarks/kernels.py sweeps them; re-jit after a
# change). Block sizes are caps: the kernel takes the largest power of two <= cap dividing D.
TUNE = {
    "cumsum_kd": 64, "cumsum_warps": 4,
    # state_bv None: chosen per shape (state.walk_tiles), about one walk program per SM;
    # state_programs None: the device's SM count.
    "state_bk": 64, "state_bv": None, "state_programs": None, "state_warps": 4,
    "state_stages": 3,
    "scores_kd": 64, "scores_warps": 4, "scores_stages": 1,
    "diag_kd": 32, "diag_warps": 2, "diag_stages": 1,
    "da_bv": 128, "da_warps": 4, "da_stages": 2,
    "out_bk": 64, "out_bv": 128, "out_warps": 4, "out_stages": 3,
    "dv_bk": 128, "dv_bv": 128, "dv_warps": 4, "dv_stages": 2,
    "dqdk_bk": 32, "dqdk_bv": 64, "dqdk_warps": 4, "dqdk_stages": 3,
    "dqdk_diag_bk": 64, "dqdk_diag_warps": 2, "dqdk_diag_stages": 1,
    # Store the chunk states h[n] and their cotangents dH[n] in the input dtype (bf16 when
    # the inputs are; float32 inputs keep float32 states). Every dot that reads them casts
    # them to the input dtype anyway, so only the float32 sum_v h[n] dH[n] of dg sees the
    # rounding; it halves the traffic of the largest arrays (FLA's forward does the same).
    # The walks always carry the state in float32 registers.
    "states_in_input_dtype": True,
    # The diagonal-block partial dq / dk (written by one kernel, read by the next) in the
    # input dtype instead of float32. Off: mixed on the H200 (run 9: 3.61 against 3.51 ms
    # at the first benchmark shape, 2.09 against 2.15 at the second) and less accurate.
    "diag_grads_in_input_dtype": False,
    # chunk_gla's forward keeps the chunk states h for the backward (custom_vjp residual,
    # N K V per head in the state dtype) instead of recomputing them there, so the backward
    # walks only the state gradients. Off: recomputing them in the same launch as the
    # gradient walk measured faster on the H200 (run 8: 3.25 against 3.69 ms forward +
    # backward at B1 T16384 H16 K128 V128) and keeps less memory.
    "keep_states": False,
    # Backward: the state pass and the state-gradient pass in one launch, side by side.
    "fuse_state_passes": True,
    # Run the sequential state pass(es) (few programs) in the same launch as a chunk-
    # parallel stage that does not need them, so the idle SMs work: forward with the
    # off-diagonal scores, backward with the diagonal dq/dk terms. Both off: with the
    # per-shape walk tiles they measured slower on the H200 (runs 8-10: forward + backward
    # 3.50 against 3.10 ms at B1 T16384 H16 K128 V128 with overlap_fwd; overlap_bwd's
    # diagonal programs get the walk's launch parameters and registers).
    "overlap_fwd": False,
    "overlap_bwd": False,
}


def state_store_dtype(input_dtype):
  return input_dtype if TUNE["states_in_input_dtype"] else F32


def diag_grads_dtype(input_dtype):
  return input_dtype if TUNE["diag_grads_in_input_dtype"] else F32


def sm_count() -> int:
  """Streaming multiprocessors of the default device (132, an H100/H200, when unknown)."""
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except Exception:  # noqa: BLE001  (no devices / attribute missing)
    return 132


def interpret_mode() -> bool:
  """True when kernels must run in the Pallas interpreter.

  ``ZECO_PALLAS_INTERPRET=1`` forces it, ``=0`` forbids it; otherwise it is on whenever
  the default backend is neither GPU nor TPU (CPU tests).
  """
  env = os.environ.get("ZECO_PALLAS_INTERPRET")
  if env is not None and env != "":
    return env not in ("0", "false", "False")
  return jax.default_backend() not in ("gpu", "cuda", "rocm", "tpu")


def compiler_params(num_warps: int = 4, num_stages: int = 2):
  if interpret_mode():
    return None
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _varying_axes(x):
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def _check_vma_on() -> bool:
  try:
    from jax._src import config as jax_config
    return bool(jax_config._check_vma.value)
  except (ImportError, AttributeError):
    return False


def call(kernel, out_shape, grid, *, num_warps=4, num_stages=2, name=None, aliases=None):
  """pallas_call over whole-array refs with this package's launch options.

  Inside ``shard_map(check_vma=True)`` (zeco_gla's local pass) pallas_call needs to know
  how its outputs vary over the manual mesh axes: every input is cast to the union of
  the inputs' varying axes, and the outputs are declared varying over the same axes.
  """
  fn = functools.partial(pl.pallas_call, kernel, grid=grid, interpret=interpret_mode(),
                         compiler_params=compiler_params(num_warps, num_stages), name=name,
                         input_output_aliases=aliases or {})

  def run(*args):
    if not _check_vma_on():
      return fn(out_shape=out_shape)(*args)
    axes = frozenset().union(*(_varying_axes(a) for a in args))
    if axes:
      args = [a if _varying_axes(a) == axes else
              jax.lax.pcast(a, tuple(sorted(axes - _varying_axes(a))), to="varying")
              for a in args]
    mat = jax.typeof(args[0]).manual_axis_type
    outs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat),
                        out_shape)
    # Note: the Pallas *interpreter* still fails here (its dynamic_slice mixes varying refs
    # with invariant constants); call zeco_gla with check_vma=False to interpret on CPU.
    return fn(out_shape=outs)(*args)

  return run


def prod(sizes) -> int:
  out = 1
  for size in sizes:
    out *= size
  return out


def unravel(p, sizes):
  """Grid indices (last fastest) of flat program number ``p`` in a grid of ``sizes``: for
  kernels that run two stages side by side in one launch (one flat grid)."""
  ids = []
  for size in reversed(sizes[1:]):
    ids.append(p % size)
    p = p // size
  return [p] + ids[::-1]


def dot(a, b, dtype, *, ta=False, tb=False):
  """a @ b (a^T when ``ta``, b^T when ``tb``) with float32 accumulation.

  ``dtype`` is the operand dtype: bfloat16/float16 operands use the tensor cores at full
  rate; float32 operands use IEEE float32 (precision HIGHEST), never silent TF32.
  """
  dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
  if dtype == F32:
    return lax.dot_general(a.astype(F32), b.astype(F32), dims, precision=lax.Precision.HIGHEST,
                           preferred_element_type=F32)
  return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=F32)


def iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def masked_exp(mask, x):
  """exp(x) where mask, 0 elsewhere; the exponent is masked first, so no inf * 0."""
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


def rev_cumsum(x):
  """Reverse cumulative sum along axis 0 (Triton has only the forward scan)."""
  return jnp.sum(x, axis=0, keepdims=True) - jnp.cumsum(x, axis=0) + x


def block(n: int, cap: int) -> int:
  """Largest power of two <= cap dividing n (n itself if n <= cap and a power of two)."""
  b = 1
  while b * 2 <= min(n, cap) and n % (b * 2) == 0:
    b *= 2
  return b


def check_dims(K: int, V: int, C: int) -> None:
  for name, d in (("K", K), ("V", V), ("chunk_size", C)):
    if d < 16 or d & (d - 1):
      raise ValueError(f"pallas_kernels: {name} must be a power of two >= 16 for the Pallas "
                       f"kernels, got {d}; use backend='jax' for other sizes.")
