"""Launch configuration of the GLA Pallas kernels: one frozen, hashable value per call.

:class:`KernelConfig` says which platform's kernels run, whether in the Pallas
interpreter, and every launch parameter, grouped per stage (:class:`Launch`: tile caps,
warps, pipeline stages), with the storage and fusion flags. ``zeco_jax.chunk_gla`` passes
it to its custom_vjp as a static argument, so it is part of the compiled program's
identity: two configurations are two programs, and nothing else (no module-level table, no environment variable, no default
device) is read while tracing. :func:`default_config` is the one place defaults are chosen,
per target platform and shape (``docs/design.md`` §8; the measurements behind each default
are in ``docs/kernels.md`` and ``benchmarks/results/kernels_h200.md``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pallas_kernels._config import (DEFAULT_SM_COUNT, PLATFORMS, Launch, check_config,
                                     replace_config)
from pallas_kernels._launch import block


# Every kernel's launch, by stage: the defaults (measured on an H200, docs/kernels.md).
STAGE_DEFAULTS = {
    "cumsum": Launch(kd=64, warps=4),           # the chunk cumsums of g (its warps: decays too)
    "decays": Launch(kd=128),                   # chunk_decays: the decay folded into q and k
    "state": Launch(bk=64, bv=64, both_bv=64, warps=4, stages=3),   # the state walks
    "scores": Launch(kd=64, warps=4, stages=1),  # off-diagonal blocks of the scores
    "diag": Launch(kd=32, warps=2, stages=1),   # the exact 16 x 16 diagonal blocks
    "out": Launch(bk=64, bv=128, warps=4, stages=3),
    "dv": Launch(bk=128, bv=128, warps=4, stages=2),
    "dqdk": Launch(bk=32, bv=64, warps=4, stages=3),   # dq, dk, dg (and dA) per chunk
    "dqdk_diag": Launch(bk=64, warps=2, stages=1),     # their exact diagonal-block terms
}
FLAGS = ("interpret", "diag_dots", "states_in_input_dtype", "fuse_state_passes",
         "save_states")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Which GLA kernels run and how they are launched: one frozen, hashable value.

  ``platform``: whose kernels: ``"gpu"`` the kernels of :mod:`pallas_kernels.gla.gpu`
  lowered through Triton, ``"tpu"`` the Mosaic TPU kernels of :mod:`pallas_kernels.gla.tpu`,
  ``"cpu"`` the GPU kernels in the Pallas interpreter. ``interpret``: run in the Pallas
  interpreter (required for ``"cpu"``; allowed for the others, to run their kernels on a
  CPU).

  One :class:`Launch` per stage (``cumsum``, ``decays``, ``state``, ``scores``, ``diag``,
  ``out``, ``dv``, ``dqdk``, ``dqdk_diag``; :data:`STAGE_DEFAULTS` says what each is), read
  by the GPU kernels (the Mosaic TPU kernels take none of them yet). Flags:

  ``states_in_input_dtype``: store the chunk states h[n] and their cotangents dH[n] in the
  input dtype (every dot that reads them casts them to it anyway; the walks carry float32),
  else float32. ``fuse_state_passes``: the backward runs the state pass and the
  state-gradient pass side by side in one launch (``state.both_bv``), else one after the
  other. ``save_states``: the forward keeps its chunk states h[n] as a residual of the
  op's custom_vjp, so the backward runs only the state-gradient walk (over ``scale q
  e^{bc}`` and ``e^{b_last}``, which its cumsum kernel writes); else the backward
  recomputes h with a second walk. Keeping h costs ``B * H * (T / C) * K * V`` elements
  (K / C times v's size) from the forward to the backward: on by default (the GLA-340M step
  3% faster for 1.5 GiB at 16384 tokens on an H200, ``docs/kernels.md``); off for a
  memory-bound run without remat. ``diag_dots``: the 16 x 16 diagonal blocks of the scores
  inside ``gla_scores`` as tensor-core dots where a chunk's sub-chunk totals are all >= -16
  (the exact loops elsewhere), else the separate exact kernel (``diag``). The backward's
  diagonal dq / dk terms always take the dots where a K column's totals fit.

  Build one with :func:`default_config`; change it with :meth:`replace`, by stage field
  (``cfg.replace(out_warps=8, state_bv=32)``), whole stage (``out=Launch(...)``) or flag.
  """
  platform: str = "gpu"
  interpret: bool = False
  cumsum: Launch = STAGE_DEFAULTS["cumsum"]
  decays: Launch = STAGE_DEFAULTS["decays"]
  state: Launch = STAGE_DEFAULTS["state"]
  scores: Launch = STAGE_DEFAULTS["scores"]
  diag: Launch = STAGE_DEFAULTS["diag"]
  out: Launch = STAGE_DEFAULTS["out"]
  dv: Launch = STAGE_DEFAULTS["dv"]
  dqdk: Launch = STAGE_DEFAULTS["dqdk"]
  dqdk_diag: Launch = STAGE_DEFAULTS["dqdk_diag"]
  diag_dots: bool = True
  states_in_input_dtype: bool = True
  fuse_state_passes: bool = True
  save_states: bool = True

  def __post_init__(self):
    check_config(self, stage_defaults=STAGE_DEFAULTS, flags=FLAGS, label="KernelConfig")

  def replace(self, **changes) -> "KernelConfig":
    """A copy with ``changes``: flags, whole stages (``out=Launch(...)``) or stage fields by
    their flat names ``<stage>_<field>`` (``out_warps=8``, ``state_both_bv=128``)."""
    return replace_config(self, changes, stage_defaults=STAGE_DEFAULTS, flags=FLAGS,
                          label="KernelConfig")

  def flat(self) -> dict:
    """Every setting by flat name (``out_warps``: 4, ..., ``save_states``: True)."""
    out = {"platform": self.platform, **{f: getattr(self, f) for f in FLAGS}}
    for stage in STAGE_DEFAULTS:
      out.update({f"{stage}_{f}": v for f, v in getattr(self, stage).set().items()})
    return out


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
                   sm_count: Optional[int] = None, chunk_size: int = 64) -> KernelConfig:
  """The default :class:`KernelConfig` for a target platform and problem shape.

  ``platform``: ``"gpu"``, ``"tpu"`` or ``"cpu"`` (what :func:`zeco_jax.runtime.target.platform_of`
  reports); ``"cpu"`` gets the GPU kernels in the interpreter. ``sm_count``: the target
  GPU's streaming multiprocessors, for the state-walk tiles (about one walk program per
  SM); None, or a platform other than ``"gpu"``: 132, the H100 / H200 the defaults were
  measured on. Today the choice depends
  on B, H, K and V only; T, dtype and ``chunk_size`` are part of the signature (as in the
  delta-rule families', whose walks' stages depend on them) so that per-length or
  per-dtype defaults need no change to callers.
  """
  del T, dtype, chunk_size      # no default depends on them yet (see the docstring)
  if platform not in PLATFORMS:
    raise ValueError(f"default_config: unknown `platform` {platform!r}; choose one of "
                     f"{', '.join(map(repr, PLATFORMS))}.")
  programs = (sm_count if platform == "gpu" else None) or DEFAULT_SM_COUNT
  base = KernelConfig(platform=platform, interpret=platform == "cpu")
  tile = lambda walks: walk_tile_v(B, H, K, V, walks=walks, programs=programs,
                                   bk=base.state.bk)
  return base.replace(state_bv=tile(1), state_both_bv=tile(2))
