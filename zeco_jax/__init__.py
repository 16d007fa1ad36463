"""zeco-jax: ZeCO sequence parallelism for linear attention in JAX.

Public API:
  recurrent_gla, chunk_gla_reference   GLA's plain-jnp references (the spec)
  chunk_gla                            single-device chunked GLA (custom_vjp; jnp or Pallas)
  fused_recurrent_gla,                 the token recurrences for decoding (FLA's names and
  fused_recurrent_gated_delta_rule     argument order; a decode step is T = 1)
  zeco_gla, zeco_gla_local             sequence-parallel GLA over a mesh axis
  recurrent_gated_delta_rule,          Gated DeltaNet: the float32 token loop (the spec) and
  chunk_gated_delta_rule               the chunked WY/UT op
  zeco_gated_delta_rule,               sequence-parallel Gated DeltaNet (All-Scan over
  zeco_gated_delta_rule_local          matrix transitions)
  recurrent_kda, chunk_kda,            Kimi Delta Attention (per-channel decay, delta rule):
  fused_recurrent_kda                  the float32 token loop (the spec), the chunked WY/UT
                                       op, the token recurrence for decoding
  zeco_kda, zeco_kda_local             sequence-parallel KDA (All-Scan over matrix transitions)
  kda_gate                             FLA's KDA gate: the per-channel log-decay from the
                                       layer's gate projection
  sp_attention, sp_attention_local     softmax attention over the same sequence mesh (hybrid
  ATTENTION_METHODS                    models): "ulysses", "all_gather" (zigzag), "ring"
  all_scan                             the exclusive state scan over a mesh axis (in shard_map)
  SCAN_METHODS, ScanMethod             the scan methods by name ("all_scan", "all_gather",
                                       "ring", "tree", "all_scan_2level"): the one
                                       vocabulary of ``method=``
  Transition, Identity, ScalarDecay,   what a rank applies to the state it receives
  DiagonalDecay, DenseTransition       (zeco_jax.transitions)
  debug.checked                        checkify wrapper that reports inputs outside an op's
                                       contract (positive log-decay; beta, key norms)
  segments                             packed documents: segment_ids helpers, cu_seqlens
                                       -> segment_ids (every op takes ``segment_ids=``)
  losses.linear_cross_entropy          LM-head cross-entropy in token chunks (no [T, vocab]
                                       logits); losses.embedding_lookup (float32 scatter grad)

The tree: ``zeco_jax.ops.<family>`` (reference, chunked, op, parallel per family),
``zeco_jax.sp`` (the sequence-parallel layer: scan, transitions, shard), ``zeco_jax.nn``
(Flax NNX layers: GatedLinearAttention, GatedDeltaNet, RMSNorm, ShortConvolution; not
imported here, so ``import zeco_jax`` needs no flax), ``zeco_jax.runtime`` (target,
distributed, launch, hlo_stats). Kernel configuration: ``pallas_kernels.KernelConfig`` and
``pallas_kernels.default_config``.
"""
from zeco_jax import debug
from zeco_jax import losses
from zeco_jax import segments
from zeco_jax.ops.attention.parallel import (ATTENTION_METHODS, sp_attention,
                                             sp_attention_local)
from zeco_jax.ops.gated_delta.op import chunk_gated_delta_rule
from zeco_jax.ops.gated_delta.parallel import (zeco_gated_delta_rule,
                                               zeco_gated_delta_rule_local)
from zeco_jax.ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule
from zeco_jax.ops.gated_delta.reference import recurrent_gated_delta_rule
from zeco_jax.ops.gla.op import chunk_gla
from zeco_jax.ops.gla.parallel import zeco_gla, zeco_gla_local
from zeco_jax.ops.gla.recurrent import fused_recurrent_gla
from zeco_jax.ops.gla.reference import chunk_gla_reference, recurrent_gla
from zeco_jax.ops.kda.gate import kda_gate
from zeco_jax.ops.kda.op import chunk_kda
from zeco_jax.ops.kda.parallel import zeco_kda, zeco_kda_local
from zeco_jax.ops.kda.recurrent import fused_recurrent_kda
from zeco_jax.ops.kda.reference import recurrent_kda
from zeco_jax.sp import transitions
from zeco_jax.sp.scan import SCAN_METHODS, ScanMethod, all_scan
from zeco_jax.sp.transitions import (DenseTransition, DiagonalDecay, Identity, ScalarDecay,
                                     Transition)

__all__ = ["ATTENTION_METHODS", "DenseTransition", "DiagonalDecay", "Identity", "SCAN_METHODS",
           "ScalarDecay", "ScanMethod", "Transition", "all_scan", "chunk_gated_delta_rule",
           "chunk_gla", "chunk_gla_reference", "chunk_kda", "debug",
           "fused_recurrent_gated_delta_rule", "fused_recurrent_gla", "fused_recurrent_kda",
           "kda_gate", "losses", "recurrent_gated_delta_rule", "recurrent_gla", "recurrent_kda",
           "segments", "sp_attention", "sp_attention_local", "transitions",
           "zeco_gated_delta_rule", "zeco_gated_delta_rule_local", "zeco_gla", "zeco_gla_local",
           "zeco_kda", "zeco_kda_local"]
__version__ = "0.1.0"
