"""What every family's launch configuration shares: the target platforms, one kernel's
:class:`Launch`, the checks of a family's frozen ``KernelConfig`` (:func:`check_config`),
its ``replace`` by flat names (:func:`replace_config`) and the stored states' dtype
(:func:`state_store_dtype`). Each family's stages, flags and defaults are in its own
``config`` module."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp

from pallas_kernels._launch import block

PLATFORMS = ("cpu", "gpu", "tpu")
# Streaming multiprocessors assumed when the target GPU is not known (an H100 / H200, the
# GPU the defaults were measured on).
DEFAULT_SM_COUNT = 132


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel's launch (jax's flash-attention ``BlockSizes`` is the model): tile caps and
  Triton options, None where the kernel takes none.

  ``kd``: the K slice of a kernel that works on one; ``bk`` / ``bv``: K and V tiles of the
  state-shaped kernels; ``bh``: the heads of one program of a kernel that runs a program
  per token; ``both_bv``: the V tile of the state walks when the backward runs
  both in one launch (twice the programs). A tile is a cap: a kernel uses the largest power
  of two <= the cap that divides the dimension. ``warps`` / ``stages``: Triton's
  ``num_warps`` / ``num_stages`` (ignored by the interpreter and the TPU kernels).
  """
  kd: Optional[int] = None
  bk: Optional[int] = None
  bv: Optional[int] = None
  both_bv: Optional[int] = None
  bh: Optional[int] = None
  warps: Optional[int] = None
  stages: Optional[int] = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                or value < 1):
        raise ValueError(f"Launch: `{field.name}` must be a positive int or None, got "
                         f"{value!r}.")

  def set(self) -> dict:
    """The fields this launch sets (not None)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None}


def check_config(cfg, *, stage_defaults: dict, flags: tuple, label: str) -> None:
  """A family's ``KernelConfig`` checked field by field (``__post_init__``): the platform,
  the flags (bools), every stage a :class:`Launch` setting what its default sets, and the
  interpreter for ``"cpu"``. ``label`` opens every message."""
  if cfg.platform not in PLATFORMS:
    raise ValueError(f"{label}: unknown `platform` {cfg.platform!r}; choose one of "
                     f"{', '.join(map(repr, PLATFORMS))}.")
  for name in flags:
    if not isinstance(getattr(cfg, name), bool):
      raise ValueError(f"{label}: `{name}` must be True or False, got "
                       f"{getattr(cfg, name)!r}.")
  for stage, default in stage_defaults.items():
    launch = getattr(cfg, stage)
    if not isinstance(launch, Launch):
      raise ValueError(f"{label}: `{stage}` must be a pallas_kernels.Launch, got "
                       f"{launch!r}.")
    missing = [f for f in default.set() if getattr(launch, f) is None]
    if missing:
      raise ValueError(f"{label}: stage `{stage}` needs {', '.join(missing)} (its default "
                       f"is {default}).")
  if cfg.platform == "cpu" and not cfg.interpret:
    raise ValueError(f"{label}: platform 'cpu' has no compiled kernels, only the Pallas "
                     "interpreter; set interpret=True (default_config('cpu', ...) does).")


def check_dot_tiles(cfg, *, stage_defaults: dict, label: str) -> None:
  """Every stage's ``kd``, ``bk`` and ``bv`` a power of two >= 16 (a tile that feeds a
  dot; ``bh``, heads per program, may be any power of two): the delta-rule families'
  check, at construction, before any kernel is traced."""
  for stage in stage_defaults:
    launch = getattr(cfg, stage)
    for field in ("kd", "bk", "bv"):
      value = getattr(launch, field)
      if value is not None and (value < 16 or value & (value - 1)):
        raise ValueError(f"{label}: `{stage}_{field}` must be a power of two >= 16 (a tile "
                         f"that feeds a dot), got {value}.")


def split_flat(name: str, stage_defaults: dict, flags: tuple, label: str) -> tuple:
  """``"dqdk_diag_bk"`` -> ``("dqdk_diag", "bk")`` (the longest stage name first, a field
  its default sets); ValueError naming the choices."""
  for stage in sorted(stage_defaults, key=len, reverse=True):
    field = name[len(stage) + 1:] if name.startswith(stage + "_") else None
    if field and field in stage_defaults[stage].set():
      return stage, field
  names = [f"{s}_{f}" for s, d in stage_defaults.items() for f in d.set()]
  raise ValueError(f"{label}: unknown setting {name!r}; the stage fields are "
                   f"{', '.join(names)}; the flags {', '.join(flags)}.")


def replace_config(cfg, changes: dict, *, stage_defaults: dict, flags: tuple, label: str):
  """A copy of a family's ``KernelConfig`` with ``changes``: the platform, flags, whole
  stages (``out=Launch(...)``) or stage fields by their flat names ``<stage>_<field>``
  (``out_warps=8``)."""
  top, stages = {}, {}
  for name, value in changes.items():
    if name in ("platform", *flags, *stage_defaults):
      top[name] = value
      continue
    stage, field = split_flat(name, stage_defaults, flags, label)
    stages.setdefault(stage, {})[field] = value
  for stage, fields in stages.items():
    top[stage] = dataclasses.replace(top.get(stage, getattr(cfg, stage)), **fields)
  return dataclasses.replace(cfg, **top)


def state_store_dtype(config, input_dtype):
  """dtype of the stored chunk states h[n] and their cotangents dH[n]: the input dtype
  with ``config.states_in_input_dtype``, else float32."""
  return input_dtype if config.states_in_input_dtype else jnp.float32


# Shared memory one thread block may take on sm_90 (the H100 / H200), 227 KB; no NVIDIA
# GPU offers more.
SHARED_MEMORY_BYTES = 232448
# What the walks' defaults leave free of it beyond their pipelined operands (Triton's
# scratch for layout changes: 8 KB to 24 KB in the launches that overflowed on an H100).
_WALK_SCRATCH_BYTES = 16384


def walk_stage_bytes(C: int, K: int, BV: int, itemsize: int, *, grad: bool) -> int:
  """Bytes of one pipeline stage of a delta-rule walk: the operands one chunk loads, the
  forward walk w and kd ``[C, K]`` and u ``[C, BV]``, the grad walk qb, w, kd ``[C, K]``
  and do, dv_local ``[C, BV]``. Times ``num_stages``, a lower bound of the shared memory
  Triton takes (measured on an H100: the grad walk at K = 128, tile 64, 4 stages asked
  262144 bytes, this 262144; at K = 256, tile 32, 3 stages 327680, this 319488)."""
  n_k, n_v = (3, 2) if grad else (2, 1)
  return (n_k * C * K + n_v * C * BV) * itemsize


def delta_walk_launch(B: int, H: int, K: int, V: int, *, sm_count: Optional[int],
                      itemsize: int = 2, chunk_size: int = 64, grad: bool = True) -> Launch:
  """The delta-rule walks' launch (both families; ``grad``: the backward's state-gradient
  walk, else the forward walk; a program per ``[K, bv]`` state tile, ``B * H * V / bv``
  programs). The V tile: 32 at K >= 256; else the largest of 64 and 32 that still gives
  every SM a program, 16 when none does. 8 warps with a tile of 64, else 4. Stages: the
  most of 3, 2, 1 whose operands (:func:`walk_stage_bytes` of the grad walk) leave
  :data:`_WALK_SCRATCH_BYTES` of :data:`SHARED_MEMORY_BYTES` (bf16: 3 at K = 128, 2 at
  K = 256 with tile 32). The forward walk at a tile of 64 (more programs than SMs) takes 4
  warps and the most of 2, 1 stages whose forward operands let two programs share an SM
  (half of :data:`SHARED_MEMORY_BYTES` each, the scratch included): 256 programs at B8 H16
  then run in one wave instead of two.
  Measured on an H100 (``benchmarks/results/gdn_h200.md``, 2026-12-05), forward / forward +
  backward ms of Gated DeltaNet's op: B1 T16384 H16 K=V=128 (tile 16, 4 warps) 0.822 /
  3.024 with 3 stages against 0.867 / 3.246 for the form that carried the next chunk's
  operands in registers (2 stages); B8 T4096 H16 (tile 64, 8 warps) 1.311 / 5.328 against
  1.355 / 5.509 (4 stages overflow shared memory); Gated DeltaNet-340M's heads, B1 T16384
  H6 K=256 V=512: tile 32 with 4 warps, 2 stages, 1.310 / 5.811 against 2.211 / 8.008 for
  tile 16 with 8 warps and the register prefetch (with 8 warps 1.425 / 5.978; 3 stages or
  a tile of 64 overflow). KDA's op at K=V=128: 1.389 / 6.831 against 1.472 / 7.059 (B1),
  2.505 / 13.132 against 2.563 / 13.254 (B8). The forward walk at B8 T4096 H16 K=V=128
  bf16 (2026-12-06, an H100): 0.349 ms with tile 64, 4 warps, 2 stages against 0.416 with
  8 warps, 3 stages (4 warps, 3 stages: 0.429; 8 warps, 1 stage: 0.534; tile 32: 0.476 at
  best), the op's forward 1.276 -> 1.209 ms (Gated DeltaNet; 8 warps, 2 stages: 1.356),
  2.497 -> 2.411 (KDA). The grad walk there keeps 8 warps and 3 stages (0.592 ms; 4 warps,
  2 stages: 0.643)."""
  programs = sm_count or DEFAULT_SM_COUNT
  if K >= 256 and V % 32 == 0:
    bv = 32
  else:
    bv = next((t for t in (64, 32) if V % t == 0 and B * H * (V // t) >= programs), 16)
  tile = block(V, bv)
  if not grad and bv == 64:
    per_stage = walk_stage_bytes(chunk_size, K, tile, itemsize, grad=False)
    two = 2 * per_stage + _WALK_SCRATCH_BYTES <= SHARED_MEMORY_BYTES // 2
    return Launch(bv=bv, warps=4, stages=2 if two else 1)
  per_stage = walk_stage_bytes(chunk_size, K, tile, itemsize, grad=True)
  stages = next((s for s in (3, 2) if s * per_stage + _WALK_SCRATCH_BYTES
                 <= SHARED_MEMORY_BYTES), 1)
  return Launch(bv=bv, warps=8 if bv == 64 else 4, stages=stages)


def with_delta_walks(config, B: int, H: int, K: int, V: int, *, sm_count: Optional[int],
                     itemsize: int = 2, chunk_size: int = 64):
  """A delta-rule family's ``KernelConfig`` with its ``walk`` and ``dwalk`` launches from
  :func:`delta_walk_launch` (``sm_count`` read on a GPU target only)."""
  sms = sm_count if config.platform == "gpu" else None
  launch = functools.partial(delta_walk_launch, B, H, K, V, sm_count=sms, itemsize=itemsize,
                             chunk_size=chunk_size)
  return config.replace(walk=launch(grad=False), dwalk=launch(grad=True))
