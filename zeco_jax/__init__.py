"""zeco-jax: ZeCO sequence parallelism for gated linear attention in JAX.

Public API:
  recurrent_gla, chunk_gla_reference   plain-jnp references (the spec)
  chunk_gla                            single-device chunked GLA (custom_vjp; jnp or Pallas)
  all_scan                             the exclusive state scan over a mesh axis (in shard_map)
  SCAN_METHODS, ScanMethod             the scan methods by name ("all_scan", "all_gather",
                                       "ring", "tree"): the one vocabulary of ``method=``
  Transition, Identity, ScalarDecay,   what a rank applies to the state it receives
  DiagonalDecay, DenseTransition       (zeco_jax.transitions)
  zeco_gla, zeco_gla_local             sequence-parallel GLA over a mesh axis
  recurrent_gated_delta_rule,          Gated DeltaNet (docs/design.md §9): the float32
  chunk_gated_delta_rule               token loop (the spec) and the chunked WY/UT op
  zeco_gated_delta_rule,               sequence-parallel Gated DeltaNet (All-Scan over
  zeco_gated_delta_rule_local          matrix transitions)
  debug.checked                        checkify wrapper that reports positive log-decays
  segments                             packed documents: segment_ids helpers, cu_seqlens
                                       -> segment_ids (every op takes ``segment_ids=``)
  losses.linear_cross_entropy          LM-head cross-entropy in token chunks (no [T, vocab]
                                       logits); losses.embedding_lookup (float32 scatter grad)

Submodules imported on their own: ``zeco_jax.nn`` (Flax NNX layers: GatedLinearAttention,
RMSNorm, ShortConvolution) and ``zeco_jax.nn_delta`` (GatedDeltaNet): not imported here,
so ``import zeco_jax`` needs no flax;
``zeco_jax.target`` (the platform a computation is compiled for), ``zeco_jax.scan`` (the
cost models), ``zeco_jax.hlo_stats``, ``zeco_jax.distributed``. Kernel configuration:
``pallas_kernels.KernelConfig`` and ``pallas_kernels.default_config``.
"""
from zeco_jax import debug
from zeco_jax import losses
from zeco_jax import segments
from zeco_jax import transitions
from zeco_jax.scan import SCAN_METHODS, ScanMethod, all_scan
from zeco_jax.ops import chunk_gla
from zeco_jax.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from zeco_jax.parallel_delta import zeco_gated_delta_rule, zeco_gated_delta_rule_local
from zeco_jax.parallel import zeco_gla, zeco_gla_local
from zeco_jax.reference import chunk_gla_reference, recurrent_gla
from zeco_jax.transitions import (DenseTransition, DiagonalDecay, Identity, ScalarDecay,
                                  Transition)

__all__ = ["DenseTransition", "DiagonalDecay", "Identity", "SCAN_METHODS", "ScalarDecay",
           "ScanMethod", "Transition", "all_scan", "chunk_gated_delta_rule", "chunk_gla",
           "chunk_gla_reference", "debug", "losses", "recurrent_gated_delta_rule", "recurrent_gla",
           "segments", "transitions", "zeco_gated_delta_rule", "zeco_gated_delta_rule_local",
           "zeco_gla", "zeco_gla_local"]
__version__ = "0.1.0"
