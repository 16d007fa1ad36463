"""Launch configuration of the Kimi Delta Attention Pallas kernels: one frozen, hashable
value.

:class:`KernelConfig` says which platform's kernels run, whether in the Pallas
interpreter, and each GPU kernel's launch (a :class:`pallas_kernels.Launch` per stage,
the GLA kernels' launch type). An op passes it to its custom_vjp as a static argument, so
two configurations are two programs and nothing else is read while tracing.
:func:`default_config` is the one place defaults are chosen. Measured for KDA (on an H200
at B1 T16384 H16 K=V=128, bf16, where not said; ``benchmarks/results/kda_h200.md``): ``kda_intra`` and
``kda_diag`` on one warp (FLA's autotuned launch of its two kernels of the same work), the
former on K slices of 32 and the latter with 2 heads a program (on an H100, 2026-12-07, one
process, the op's forward 2.166 against 2.290 ms on 4 warps with slices of 128 and 8 heads
at B8 T4096, 1.251 against 1.323 at B1 T16384, forward + backward 10.31 against 10.42 and
5.79 against 5.86. One stage changed at B8: ``kda_intra`` on 1 warp with slices of 32
2.188 ms against 2.284, on 2 warps with 32 2.403, with 64 2.335; ``kda_diag`` on 1 warp
with 2 heads 2.259, 4 heads 2.261, on 2 warps with 4 heads 2.281. On the new launch (2.165
in a second process): ``kda_intra``'s slices of 16 2.191, 64 2.751; ``kda_diag`` with 1
head 2.342; ``kda_intra`` on 2 / 3 stages 2.283 / 2.281 against 2.146, ``kda_diag`` on 3
the same, 2.148, the next session. On an H200 on 2026-12-05, on 4 warps, K slices of 128
had beaten 64 / 32 and 8 heads 16 / 4),
``kda_dpairs``'s warps (2:
2.65 ms against 3.33 with 4, 3.38 with 1, and on an H100 on 2026-12-07 the op's forward +
backward at B8 T4096 10.31 ms against 16.29 on 1 warp, 10.71 on 1 warp with K slices of 16;
K slice 64 with 4 warps 2.80; on an H100 with its
diagonal loops unrolled, 2026-12-06, the op's forward + backward 6.580 ms on 2 warps against
6.637 on 4 with 2 steps per loop iteration, the best 4-warp form; and 3 pipeline stages,
the loads of its loops over the earlier and later sub-chunks pipelined: on an H100,
2026-12-06, the op's forward + backward 11.645 ms at B8 T4096 against 12.270 on 1 stage,
11.803 on 2, 6.462 against 6.523 at B1 T16384; its gradients on 3 stages within 4.3e-7 of
the jnp path's in float32 on the GPU, ``benchmarks.delta_h200 --check``), and
``kda_dqk``'s
K per program (64: on an H200, 2026-12-06, the op's forward + backward 5.639 against
5.673 ms with 32 at B1 T16384, 9.659 against 9.704 / 9.744 at B8 T4096, one process; 32
had measured 8.11 against 8.64 ms with 128 on 2026-12-05's kernels), and
``kda_output``'s V tile (128, as Gated DeltaNet's: the op's forward 2.633 against 2.839 ms
with 64, forward + backward 12.530 against 12.469, with the kernels of e58f40b) and K tile
(128, the whole key: on an H100, 2026-12-06, the op's forward 2.296 against 2.307 ms with
64 at B8 T4096, 1.322 against 1.326 at B1 T16384, three rounds each), and
``kda_wu``'s K / V tile (128: on an H100 the kernel alone 0.240 ms against 0.244 / 0.273
with 64 / 32, with q 0.297 against 0.334 / 0.363; 4 warps: 0.291 on 8, 0.266 on 2 but
0.582 with q; on an H100, 2026-12-07, 2 warps with tiles of 32 the op's forward 1.318
against 1.251 ms at B1 T16384; on its form with one load of g and k, the next session, one
process, B1 / B8 T4096: 1.189 / 2.062 ms against 1.341 / 2.272 on 8 warps, 1.514 / 2.730
on 2, 1.230 / 2.135 with tiles of 64; and ``kda_output`` on that code 1.188 / 2.061
against 1.242 / 2.162 on 8 warps, 1.264 / 2.221 with V tiles of 64, the same on 1 or 3
stages). The other
stages follow Gated DeltaNet's measured defaults (``benchmarks/results/gdn_h200.md``),
with smaller K slices where a kernel holds several per-channel ``[16, kd]`` decay tiles at
once; not swept for KDA.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from pallas_kernels._config import (PLATFORMS, Launch, check_config, check_dot_tiles,
                                     replace_config, with_delta_walks)

# Every kernel's launch, by stage (module docstring of pallas_kernels.kda.gpu).
STAGE_DEFAULTS = {
    "intra": Launch(kd=32, warps=1, stages=1),   # A and P per chunk (kd: the K slice), T
    "diag": Launch(bh=2, warps=1, stages=2),     # A, P's diagonal blocks per token
    "wu": Launch(bv=128, warps=4, stages=1),     # w, u, kd, e^gamma per chunk (K / V tile)
    "walk": Launch(bv=16, warps=4, stages=3),    # forward walk (h, v_new); the launch by shape
    "out": Launch(bk=128, bv=128, warps=4, stages=2),  # the output per chunk and V tile
    "vnew": Launch(bv=128, warps=4, stages=2),   # backward: v_new and the local dv per V tile
    "dwalk": Launch(bv=16, warps=4, stages=3),   # backward walk; the launch by shape
    "dqk": Launch(kd=64, bv=64, warps=4, stages=1),   # backward: state terms of dq, dk,
                                                 # dg; dw, dP (kd: K per program)
    "dwy": Launch(bv=64, warps=4, stages=1),     # backward: through w, u and T; dA
    "dpairs": Launch(kd=32, warps=2, stages=3),  # backward: through A and P, per sub-chunk
                                                 # and K slice (kd)
}
FLAGS = ("interpret", "states_in_input_dtype", "save_states", "save_pairs")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Which KDA kernels run and how: one frozen, hashable value.

  ``platform``: ``"gpu"`` (Triton lowering), ``"tpu"`` (the Mosaic kernels of
  :mod:`pallas_kernels.kda.tpu`, which read only ``interpret`` and
  ``states_in_input_dtype``) or ``"cpu"`` (the GPU kernels in the Pallas interpreter).
  ``interpret``: run in the interpreter (required for ``"cpu"``). One
  :class:`~pallas_kernels.Launch` per GPU stage (:data:`STAGE_DEFAULTS`); ``bv`` caps the
  K / V tile, ``kd`` the K slice of the kernels that form per-channel pairwise decays.
  ``states_in_input_dtype``: the chunk states kept for the backward and their cotangents
  are stored in the input dtype (the dots read them so), else float32.
  ``save_states`` (the default): the forward keeps the chunk states h ``[B, H, T / C, K,
  V]`` that its walk writes for the output anyway (one state per chunk, K / C times v's
  size in bf16) and the backward reads them; off, the backward walks them again (a second
  forward walk; GPU, the TPU kernels always keep them). On an H100 (2026-12-07, o live,
  two alternating rounds) forward + backward 5.437 against 5.738 ms at B1 T16384 H16
  K=V=128 and 9.866 against 10.181 at B8 T4096 (FLA 6.507 / 10.623 in the same rounds),
  the forward unchanged; the KDA-340M step 0.61x GLA-340M's tokens/s against 0.58x, for
  1.5 GiB more (``benchmarks/results/kda_h200.md``). Off had measured faster on
  2026-12-05, when the benchmark's forward + backward left the forward dead unless states
  were kept.
  ``save_pairs``: the forward keeps T = (I + A)^{-1} and P ``[B, T, H, C]`` each, in k's
  dtype (2 C values a token and head, as FLA keeps its Aqk and Akk), so that the backward
  skips ``kda_diag`` and ``kda_intra``; off, it forms them again and the op keeps only its
  inputs (and the chunk states with ``save_states``). :func:`default_config` turns it on
  for ``"gpu"`` where the pairs take no more memory than one float32 K x V state per chunk
  (``2 C^2`` values of k's dtype against ``4 K V`` bytes a chunk and head; the issue that
  specified the op allowed the inputs and one state per chunk): at C = 64 in bf16 a quarter
  of it at K = V = 128, all of it at K = V = 64. GPU only; the sequence-parallel local
  pass forms them again in its backward. On an H100 (2026-12-06, o live, FLA 0.6.0 in the
  same process) forward + backward 5.961 against 6.523 ms at B1 T16384 H16 K=V=128 (FLA
  6.037) and 11.163 against 12.269 at B8 T4096 (FLA 10.929), for 67 MB kept at either
  shape.
  The walks' launches and their shared-memory check are Gated DeltaNet's (the same
  kernels).
  Change one with :meth:`replace` (``cfg.replace(walk_bv=32, dpairs_kd=64)``).
  """
  platform: str = "gpu"
  interpret: bool = False
  intra: Launch = STAGE_DEFAULTS["intra"]
  diag: Launch = STAGE_DEFAULTS["diag"]
  wu: Launch = STAGE_DEFAULTS["wu"]
  walk: Launch = STAGE_DEFAULTS["walk"]
  out: Launch = STAGE_DEFAULTS["out"]
  vnew: Launch = STAGE_DEFAULTS["vnew"]
  dwalk: Launch = STAGE_DEFAULTS["dwalk"]
  dqk: Launch = STAGE_DEFAULTS["dqk"]
  dwy: Launch = STAGE_DEFAULTS["dwy"]
  dpairs: Launch = STAGE_DEFAULTS["dpairs"]
  states_in_input_dtype: bool = True
  save_states: bool = True
  save_pairs: bool = False

  def __post_init__(self):
    check_config(self, stage_defaults=STAGE_DEFAULTS, flags=FLAGS, label="kda KernelConfig")
    check_dot_tiles(self, stage_defaults=STAGE_DEFAULTS, label="kda KernelConfig")

  def replace(self, **changes) -> "KernelConfig":
    """A copy with ``changes``: flags, whole stages or ``<stage>_<field>`` names."""
    return replace_config(self, changes, stage_defaults=STAGE_DEFAULTS, flags=FLAGS,
                          label="kda KernelConfig")


def default_config(platform: str, B: int, T: int, H: int, K: int, V: int, dtype, *,
                   sm_count: Optional[int] = None, chunk_size: int = 64) -> KernelConfig:
  """The default :class:`KernelConfig` for a target (:data:`STAGE_DEFAULTS`, module docstring;
  on ``"tpu"`` the stages are unused: the Mosaic kernels take whole-chunk blocks), with the
  walks' launch by shape, dtype and ``chunk_size``, the walks being Gated DeltaNet's
  (:func:`pallas_kernels._config.delta_walk_launch`; ``sm_count`` None: 132), and on
  ``"gpu"`` ``save_pairs`` on where T and P fit in one float32 state's bytes per chunk
  (:class:`KernelConfig`). T changes no default yet."""
  del T
  if platform not in PLATFORMS:
    raise ValueError(f"kda default_config: unknown `platform` {platform!r}; choose one of "
                     f"{', '.join(map(repr, PLATFORMS))}.")
  itemsize = jnp.dtype(dtype).itemsize
  keep_pairs = platform == "gpu" and 2 * chunk_size * chunk_size * itemsize <= 4 * K * V
  return with_delta_walks(KernelConfig(platform=platform, interpret=platform == "cpu",
                                       save_pairs=keep_pairs),
                          B, H, K, V, sm_count=sm_count, itemsize=itemsize,
                          chunk_size=chunk_size)
