"""Launch configuration of the Gated DeltaNet Pallas kernels: one frozen, hashable value.

:class:`KernelConfig` says which platform's kernels run, whether in the Pallas
interpreter, and each GPU kernel's launch (a :class:`pallas_kernels.Launch` per stage,
the GLA kernels' launch type). ``zeco_jax.chunk_gated_delta_rule`` passes it to its
custom_vjp as a static argument, so two configurations are two programs and nothing else
is read while tracing. :func:`default_config` is the one place defaults are chosen
(the measurements behind them: ``benchmarks/results/gdn_h200.md``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from pallas_kernels._config import (PLATFORMS, Launch, check_config, check_dot_tiles,
                                     replace_config, with_delta_walks)

# Every kernel's launch, by stage (module docstring of pallas_kernels.gated_delta.gpu).
STAGE_DEFAULTS = {
    "inv": Launch(kd=128, warps=2, stages=1),   # A and its UT inverse per chunk (kd: the
                                                # K slice of k k^T)
    "wu": Launch(bv=64, warps=4, stages=1),     # w, u, kd per chunk (bv: the K / V tile)
    "wy": Launch(kd=128, bv=64, warps=2, stages=1),   # forward: inv and wu in one program
                                                # (kd as inv's, bv as wu's)
    "walk": Launch(bv=16, warps=4, stages=3),   # forward walk (h, v_new); the launch by shape
    "out": Launch(bv=128, warps=4, stages=2),   # the output per chunk and V tile
    "vnew": Launch(bv=128, warps=4, stages=2),  # backward: v_new and the local dv per V tile
    "dwalk": Launch(bv=16, warps=4, stages=3),  # backward walk; the launch by shape
    "dqk": Launch(kd=32, bv=64, warps=4, stages=1),   # backward: dq, dk, dw, dg per chunk
                                                # (kd: K per program; 64 with K > 128)
    "dwy": Launch(bv=64, warps=4, stages=1),    # backward: through w, u and A per chunk
}
FLAGS = ("interpret", "states_in_input_dtype", "save_states")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Which Gated DeltaNet kernels run and how: one frozen, hashable value.

  ``platform``: ``"gpu"`` (Triton lowering), ``"tpu"`` (Mosaic), ``"cpu"`` (the GPU
  kernels in the Pallas interpreter). ``interpret``: run in the interpreter (required for
  ``"cpu"``). One :class:`~pallas_kernels.Launch` per GPU stage (:data:`STAGE_DEFAULTS`);
  ``bv`` is a cap on the V tile. ``states_in_input_dtype``: the chunk states kept for the
  backward and their cotangents are stored in the input dtype (the dots read them so),
  else float32. ``save_states`` (the default): the forward keeps the chunk states h ``[B,
  H, T / C, K, V]`` that its walk writes for the output anyway (one state per chunk, K / C
  times v's size), and the backward reads them; off, the backward walks them
  again (a second forward walk, as FLA's ops do; GPU, the TPU kernels always keep them).
  On an H100 (2026-12-07, o live) forward + backward 1.471 against 1.689 ms at B1 T16384
  H4 K=128 V=256 (GLA-340M's heads), the forward unchanged (0.394 against 0.399); the
  Gated DeltaNet step at that shape 125-126k against 121k tokens/s for 1.5 GiB more
  (``benchmarks/results/gdn_h200.md``). Off had measured faster on 2026-12-05, when the
  benchmark's forward + backward left the forward dead unless states were kept.
  The walks' ``stages`` are shared-memory buffers of a chunk's operands: a launch whose
  operands alone overflow a GPU's shared memory is refused while tracing
  (:func:`pallas_kernels._delta.check_walk_stages`).

  Change one with :meth:`replace` (``cfg.replace(walk_bv=32, dqk_warps=4)``).
  """
  platform: str = "gpu"
  interpret: bool = False
  inv: Launch = STAGE_DEFAULTS["inv"]
  wu: Launch = STAGE_DEFAULTS["wu"]
  wy: Launch = STAGE_DEFAULTS["wy"]
  walk: Launch = STAGE_DEFAULTS["walk"]
  out: Launch = STAGE_DEFAULTS["out"]
  vnew: Launch = STAGE_DEFAULTS["vnew"]
  dwalk: Launch = STAGE_DEFAULTS["dwalk"]
  dqk: Launch = STAGE_DEFAULTS["dqk"]
  dwy: Launch = STAGE_DEFAULTS["dwy"]
  states_in_input_dtype: bool = True
  save_states: bool = True

  def __post_init__(self):
    check_config(self, stage_defaults=STAGE_DEFAULTS, flags=FLAGS,
                 label="gated_delta KernelConfig")
    check_dot_tiles(self, stage_defaults=STAGE_DEFAULTS, label="gated_delta KernelConfig")

  def replace(self, **changes) -> "KernelConfig":
    """A copy with ``changes``: flags, whole stages or ``<stage>_<field>`` names."""
    return replace_config(self, changes, stage_defaults=STAGE_DEFAULTS, flags=FLAGS,
                          label="gated_delta KernelConfig")


def default_config(platform: str, B: int, T: int, H: int, K: int, V: int, dtype, *,
                   sm_count: Optional[int] = None, chunk_size: int = 64) -> KernelConfig:
  """The default :class:`KernelConfig` for a target: the stages' measured defaults
  (:data:`STAGE_DEFAULTS`, chosen at B1 T16384 H16 K=V=128 bf16 on an H200), and the
  walks' launch by shape, dtype and ``chunk_size``
  (:func:`pallas_kernels._config.delta_walk_launch`; ``sm_count`` None: 132). ``gdn_dqk``
  takes K slices of 32 up to K = 128 (measured at K = V = 128: forward + backward 3.26 ->
  3.15 ms at B1 T16384 H16, 5.54 -> 5.19 at B8 T4096; no register spills for sm_90, where
  the whole K spilled 1164 bytes) and of 64 above (Gated DeltaNet-340M's heads, B1 T16384
  H6 K=256 V=512, on an H100 with the walks' defaults: forward + backward 4.927 ms against
  5.811 with slices of 128; with the walks of before, slices of 32: 7.847 against 8.008).
  T changes no default yet."""
  del T
  if platform not in PLATFORMS:
    raise ValueError(f"gated_delta default_config: unknown `platform` {platform!r}; choose "
                     f"one of {', '.join(map(repr, PLATFORMS))}.")
  config = KernelConfig(platform=platform, interpret=platform == "cpu")
  if K > 128:
    config = config.replace(dqk_kd=64)
  return with_delta_walks(config, B, H, K, V, sm_count=sm_count,
                          itemsize=jnp.dtype(dtype).itemsize, chunk_size=chunk_size)
