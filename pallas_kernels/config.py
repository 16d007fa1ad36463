"""Launch configuration of the Pallas kernels: one frozen, hashable value per call.

:class:`KernelConfig` says which platform's kernels run, whether in the Pallas
interpreter, and every launch parameter (tile caps, warps, pipeline stages, two storage
and fusion choices). :func:`zeco_jax.chunk_gla` passes it to its custom_vjp as a static
argument, so it is part of the compiled program's identity: two configurations are two
programs, and nothing else (no module-level table, no environment variable, no default
device) is read while tracing. :func:`default_config` is the one place defaults are chosen,
per target platform and shape (``docs/design.md`` §8; the measurements behind each default
are in ``docs/kernels.md`` and ``benchmarks/results/kernels_h200.md``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pallas_kernels._common import block

PLATFORMS = ("cpu", "gpu", "tpu")
# Streaming multiprocessors assumed when the target GPU is not known (an H100 / H200, the
# GPU the defaults were measured on).
DEFAULT_SM_COUNT = 132
_BOOL_FIELDS = ("interpret", "states_in_input_dtype", "fuse_state_passes", "diag_dots",
                "save_states")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Which kernels run and how they are launched.

  ``platform``: whose kernels: ``"gpu"`` the kernels of :mod:`pallas_kernels.triton_backend`
  lowered through Triton, ``"tpu"`` the Mosaic TPU kernels of
  :mod:`pallas_kernels.tpu_backend`, ``"cpu"`` the GPU kernels in the Pallas interpreter.
  ``interpret``: run in the Pallas interpreter (required for ``"cpu"``; allowed for the
  others, to run their kernels on a CPU).

  The remaining fields are the GPU kernels' launch parameters (the Mosaic TPU kernels take
  none of them yet). ``*_kd``, ``*_bk``, ``*_bv`` are tile caps: a kernel uses the largest
  power of two <= the cap that divides the dimension; ``*_warps`` and ``*_stages`` are
  Triton's ``num_warps`` and ``num_stages`` (ignored by the interpreter). Prefixes name the
  kernel: ``cumsum`` the chunk cumsums of g (``decays_kd``: the K tile of the forward's
  ``chunk_decays``, which folds the decay into q and k instead; its warps are
  ``cumsum_warps``), ``state`` the state walks (forward state pass, backward
  state-gradient pass), ``scores`` / ``diag`` the off-diagonal / 16 x 16 diagonal blocks
  of the intra-chunk scores, ``out`` the output, ``dv``, ``dqdk`` the chunk-wide dq / dk /
  dg kernel (which also forms the scores' cotangent dA) and ``dqdk_diag`` its
  diagonal-block terms where the decay is too strong for dots.

  ``state_bv``: the V tile of a state walk launched alone; ``state_both_bv``: the V tile
  when the state pass and the state-gradient pass share one launch (twice the programs).
  ``states_in_input_dtype``: store the chunk states h[n] and their cotangents dH[n] in the
  input dtype (every dot that reads them casts them to it anyway; the walks carry float32),
  else float32. ``fuse_state_passes``: the backward runs the state pass and the
  state-gradient pass side by side in one launch, else one after the other.
  ``save_states``: the forward keeps its chunk states h[n] (which its output kernel reads
  anyway) as a residual of :func:`zeco_jax.chunk_gla`'s custom_vjp, so the backward runs
  only the state-gradient walk, over ``scale q e^{bc}`` and ``e^{b_last}`` that its cumsum
  kernel writes (no exp in the walk's chain, as the forward's walk); else the backward
  recomputes h with a second walk beside the gradient walk, both unfolded. Keeping
  h costs ``B * H * (T / C) * K * V`` elements in the state storage dtype (K / C times
  v's size) held from the forward to the backward: on by default (measured on an H200:
  the GLA-340M step 3% faster for 1.5 GiB at 16384 tokens, ``docs/kernels.md``); off
  for a memory-bound run without remat.
  ``diag_dots``: the 16 x 16 diagonal blocks of the scores inside ``gla_scores``, one
  tensor-core dot per K slice of a chunk whose sub-chunk totals are all >= -16 (the
  exact column loop on the others), else the separate exact kernel ``gla_scores_diag``
  (``diag_*`` fields). On by default (measured on an H200, with the exponent error at
  most about 2e-6 where it applies: ``docs/kernels.md``). The backward's diagonal dq / dk
  terms always take the same dots where a K column's totals fit (inside ``gla_dqdk``),
  ``gla_dqdk_diag``'s exact loops on the other columns.

  Build one with :func:`default_config` and change fields with ``dataclasses.replace``;
  ``KernelConfig()`` alone has the GPU defaults with 64 x 64 walk tiles.
  """
  platform: str = "gpu"
  interpret: bool = False
  cumsum_kd: int = 64
  decays_kd: int = 128
  cumsum_warps: int = 4
  state_bk: int = 64
  state_bv: int = 64
  state_both_bv: int = 64
  state_warps: int = 4
  state_stages: int = 3
  scores_kd: int = 64
  scores_warps: int = 4
  scores_stages: int = 1
  diag_kd: int = 32
  diag_warps: int = 2
  diag_stages: int = 1
  diag_dots: bool = True
  out_bk: int = 64
  out_bv: int = 128
  out_warps: int = 4
  out_stages: int = 3
  dv_bk: int = 128
  dv_bv: int = 128
  dv_warps: int = 4
  dv_stages: int = 2
  dqdk_bk: int = 32
  dqdk_bv: int = 64
  dqdk_warps: int = 4
  dqdk_stages: int = 3
  dqdk_diag_bk: int = 64
  dqdk_diag_warps: int = 2
  dqdk_diag_stages: int = 1
  states_in_input_dtype: bool = True
  fuse_state_passes: bool = True
  save_states: bool = True

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(f"KernelConfig: unknown `platform` {self.platform!r}; choose one of "
                       f"{', '.join(map(repr, PLATFORMS))}.")
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in _BOOL_FIELDS:
        if not isinstance(value, bool):
          raise ValueError(f"KernelConfig: `{field.name}` must be True or False, got "
                           f"{value!r}.")
      elif field.name != "platform" and (not isinstance(value, int) or isinstance(value, bool)
                                         or value < 1):
        raise ValueError(f"KernelConfig: `{field.name}` must be a positive int, got "
                         f"{value!r}.")
    if self.platform == "cpu" and not self.interpret:
      raise ValueError("KernelConfig: platform 'cpu' has no compiled kernels, only the Pallas "
                       "interpreter; set interpret=True (default_config('cpu', ...) does).")


def walk_tile_v(B: int, H: int, K: int, V: int, *, walks: int, programs: int,
                bk: int = 64) -> int:
  """The V tile of a state walk: 32, 64 or 128 (capped by V), the one whose launch of
  ``walks * B * H * (K / BK) * (V / BV)`` programs comes closest to ``programs`` (the
  larger tile on a tie). A walk is a chain of dependent chunk steps, fastest with about
  one program per SM (docs/kernels.md has the measurements)."""
  BK = block(K, bk)
  options = sorted({block(V, cap) for cap in (32, 64, 128)}, reverse=True)
  count = lambda bv: walks * B * H * (K // BK) * (V // bv)
  return min(options, key=lambda bv: abs(math.log(count(bv) / programs)))


def default_config(platform: str, B: int, T: int, H: int, K: int, V: int, dtype, *,
                   sm_count: Optional[int] = None) -> KernelConfig:
  """The default :class:`KernelConfig` for a target platform and problem shape.

  ``platform``: ``"gpu"``, ``"tpu"`` or ``"cpu"`` (what :func:`zeco_jax.target.platform_of`
  reports); ``"cpu"`` gets the GPU kernels in the interpreter. ``sm_count``: the target
  GPU's streaming multiprocessors, for the state-walk tiles (about one walk program per
  SM); None, or a platform other than ``"gpu"``: 132, the H100 / H200 the defaults were
  measured on. Today the choice depends
  on B, H, K and V only; T and dtype are part of the signature so that per-length or
  per-dtype defaults need no change to callers.
  """
  del T, dtype      # no default depends on them yet (see the docstring)
  if platform not in PLATFORMS:
    raise ValueError(f"default_config: unknown `platform` {platform!r}; choose one of "
                     f"{', '.join(map(repr, PLATFORMS))}.")
  programs = (sm_count if platform == "gpu" else None) or DEFAULT_SM_COUNT
  base = KernelConfig(platform=platform, interpret=platform == "cpu")
  tile = lambda walks: walk_tile_v(B, H, K, V, walks=walks, programs=programs,
                                   bk=base.state_bk)
  return dataclasses.replace(base, state_bv=tile(1), state_both_bv=tile(2))
