"""Flax NNX layers: token mixers another model can drop in, one file per family.

    from zeco_jax.nn import (GatedAttention, GatedLinearAttention, GatedDeltaNet,
                             KimiDeltaAttention)
    attn = GatedLinearAttention(hidden_size=256, num_heads=4, rngs=nnx.Rngs(0))
    y_BxTxD = attn(x_BxTxD, mesh=mesh)       # [B, T, 256] -> [B, T, 256]

Each runs its family's sequence-parallel op over the mesh axis ``seq_axis`` when that axis
has size > 1 (the mesh from the call or ``jax.set_mesh``), else the one-device chunked op.
:mod:`zeco_jax.nn.common` holds what they share (RMSNorm, ShortConvolution, parameters
with logical axes, the q / k / v prologue, ``remat_call``, the decoding cache
``LayerCache`` and ``TokenMixer``, the layers' base). Each layer decodes: ``init_cache`` /
``prefill`` (the prompt, over the mesh) / ``decode`` (the next tokens, by the family's
``fused_recurrent`` op). :class:`GatedAttention` is the softmax mixer of hybrid models
(``zeco_jax.sp_attention`` over the same mesh; it decodes with a :class:`KVCache`, after
``reserve`` gives it free slots). Needs flax; ``import
zeco_jax`` does not import this package.
"""
from zeco_jax.nn.common import (LOGICAL_AXES_KEY, LayerCache, RMSNorm, ShortConvolution,
                                constant_param, normal_param, remat_call)
from zeco_jax.nn.attention import GatedAttention, KVCache
from zeco_jax.nn.gated_delta import GatedDeltaNet, gated_delta_op
from zeco_jax.nn.gla import GatedLinearAttention, check_gla_args, gla_op
from zeco_jax.nn.kda import KimiDeltaAttention, kda_op

__all__ = ["GatedAttention", "GatedDeltaNet", "GatedLinearAttention", "KVCache",
           "KimiDeltaAttention", "LOGICAL_AXES_KEY", "LayerCache", "RMSNorm",
           "ShortConvolution", "check_gla_args", "constant_param", "gated_delta_op", "gla_op",
           "kda_op", "normal_param", "remat_call"]
