"""Flax NNX layers for gated linear attention: a token mixer another model can drop in.

    from zeco_jax.nn import GatedLinearAttention
    attn = GatedLinearAttention(hidden_size=256, num_heads=4, rngs=nnx.Rngs(0))
    y_BxTxD = attn(x_BxTxD)                  # [B, T, 256] -> [B, T, 256]

:class:`GatedLinearAttention` is flash-linear-attention's ``GatedLinearAttention`` (chunk
mode): q/k/v projections (key dim ``hidden_size * expand_k``, value dim
``hidden_size * expand_v``), an optional causal short convolution on q, k and v, a low-rank
data-dependent log-decay ``g = logsigmoid(x W_down W_up + b) / gate_logit_normalizer``,
per-head RMSNorm of the output times a swish gate, and an output projection.

Sequence parallelism: the layer runs :func:`zeco_jax.zeco_gla` (ZeCO All-Scan) over the
mesh axis ``seq_axis`` when that axis has size > 1, else :func:`zeco_jax.chunk_gla`. The
mesh comes from the call (``attn(x, mesh=mesh)``) or from ``jax.set_mesh``; the layer holds
none, so without a mesh it is single-device GLA inside any jitted program.

Parameters are float32 and carry ``logical_axes`` metadata (``embed``, ``heads``,
``head_dim``, ``gate_rank`` or None per dimension) for a rule table that maps them to mesh
axes (the repository's ``models/sharding.py`` is one). For low-precision compute cast the
parameters (e.g. to bfloat16) before ``nnx.merge``: norms, gates, the GLA state and its
accumulation stay float32 inside.

Decoding: ``cache = attn.init_cache(B)`` or ``y, cache = attn.prefill(x, mesh=mesh,
segment_ids=ids)`` (the chunked or sequence-parallel op with its final state, and the short
convolutions' last inputs of each row's last document), then ``y, cache = attn.decode(x_t,
cache)`` for the next tokens (:func:`zeco_jax.fused_recurrent_gla`, O(1) per token in the
context length). Prefill then decode equals the layer over the whole sequence.

What it does not do: the rest of a block (MLP, residuals, embeddings).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from zeco_jax.nn.common import (LayerCache, RMSNorm, TokenMixer, constant_param, dot,
                                gated_output, init_qkv, init_short_convs, normal_param,
                                project_qkv_with_tails, step_qkv)
from zeco_jax.ops.gla.op import chunk_gla
from zeco_jax.ops.gla.parallel import zeco_gla
from zeco_jax.ops.gla.recurrent import fused_recurrent_gla
from zeco_jax.sp import shard
from zeco_jax.sp.scan import SCAN_METHODS, check_group_size


def gla_op(q, k, v, g, *, mesh=None, seq_axis: str = "seq", seq_method: str = "all_scan",
           num_blocks: Optional[int] = None, chunk_size: int = 64, backend: str = "auto",
           segment_ids=None, batch_axes=None, output_final_state: bool = False,
           group_size: Optional[int] = None):
  """GLA over ``[B, T, H, K/V]``: ``zeco_gla`` over ``seq_axis`` when that mesh axis has
  size > 1 (or when ``batch_axes`` names how B is split on a mesh of more than one
  device), else ``chunk_gla`` (on one seq shard, or with no mesh). Returns the output, and
  with ``output_final_state`` ``(o, final_state)``.
  ``segment_ids``: packed documents, as in :func:`zeco_jax.chunk_gla`. ``batch_axes``: the
  mesh axis (or axes) B is split over, as in :func:`zeco_jax.zeco_gla`: the kernels then
  run per shard of B too (the compiler cannot partition a kernel: without it a mesh with a
  data axis > 1 is refused on the Pallas backend)."""
  seg = {} if segment_ids is None else {"segment_ids": segment_ids}
  if shard.seq_size(mesh, seq_axis) > 1 or (batch_axes is not None and
                                               shard.mesh_size(mesh) > 1):
    kwargs = {} if num_blocks is None else {"num_blocks": num_blocks}
    kwargs.update(seg, group_size=group_size)
    o, final = zeco_gla(q, k, v, g, mesh=mesh, seq_axis=seq_axis, method=seq_method,
                        chunk_size=chunk_size, backend=backend, batch_axes=batch_axes,
                        output_final_state=output_final_state, **kwargs)
  else:
    o, final = chunk_gla(q, k, v, g, chunk_size=chunk_size, backend=backend,
                         output_final_state=output_final_state, **seg)
  return (o, final) if output_final_state else o


def check_gla_args(*, hidden_size: int, num_heads: int, expand_k: float = 0.5,
                   expand_v: float = 1.0, gate_low_rank_dim: int = 16, chunk_size: int = 64,
                   conv_size: int = 4, seq_method: str = "all_scan") -> None:
  """Raises ValueError naming the argument when a :class:`GatedLinearAttention` setting is bad."""
  for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                      ("gate_low_rank_dim", gate_low_rank_dim), ("chunk_size", chunk_size),
                      ("conv_size", conv_size)):
    if value <= 0:
      raise ValueError(f"{name} must be positive, got {value}")
  for name, ratio in (("key", expand_k), ("value", expand_v)):
    dim = int(hidden_size * ratio)
    if dim <= 0 or dim % num_heads:
      raise ValueError(f"{name} dim {dim} (hidden_size * expand_{name[0]}) must be positive "
                       f"and divisible by num_heads={num_heads}")
  if chunk_size % 16:
    raise ValueError(f"chunk_size must be a multiple of 16, got {chunk_size}")
  if seq_method not in SCAN_METHODS:
    raise ValueError(f"seq_method must be one of {tuple(SCAN_METHODS)} (zeco_jax.sp.scan."
                     f"SCAN_METHODS), got {seq_method!r}")


class GatedLinearAttention(TokenMixer):
  """The GLA token mixer: ``[B, T, hidden_size]`` -> ``[B, T, hidden_size]``.

  Args:
    hidden_size, num_heads: model width and heads; key dim ``hidden_size * expand_k`` and
      value dim ``hidden_size * expand_v`` are split evenly over the heads.
    gate_low_rank_dim: rank of the decay gate's ``x W_down W_up`` projection.
    gate_logit_normalizer: ``g = logsigmoid(...) / gate_logit_normalizer`` (fla: 16).
    gate_bias_init: initial gate bias; > 0 starts with slower decay (longer memory).
    use_short_conv, conv_size: fla's causal short convolution (+ SiLU) on q, k and v.
    norm_eps: the per-head output RMSNorm's epsilon.
    init_std: std of every projection; ``output_init_std`` of the output projection
      (default ``init_std``; a stack of L layers usually passes ``init_std / sqrt(2 L)``).
    chunk_size, backend: passed to ``chunk_gla`` / ``zeco_gla``.
    seq_axis, seq_method, num_blocks, group_size: the mesh axis the sequence is split over
      and ``zeco_gla``'s method, pipeline blocks and (``"all_scan_2level"``) group size
      (None: ``zeco_gla``'s choice).
    batch_axes: the mesh axis (or axes) the batch is split over, e.g. ``"data"`` (None:
      not split, or left to the compiler, which the Pallas kernels refuse): see
      :func:`gla_op`.
  """

  def __init__(self, hidden_size: int, num_heads: int, *, expand_k: float = 0.5,
               expand_v: float = 1.0, gate_low_rank_dim: int = 16,
               gate_logit_normalizer: float = 16.0, gate_bias_init: float = 0.0,
               use_short_conv: bool = False, conv_size: int = 4, norm_eps: float = 1e-6,
               init_std: float = 0.02, output_init_std: Optional[float] = None,
               chunk_size: int = 64, backend: str = "auto", seq_axis: str = "seq",
               seq_method: str = "all_scan", num_blocks: Optional[int] = None,
               group_size: Optional[int] = None, batch_axes=None, rngs: nnx.Rngs):
    try:
      check_gla_args(hidden_size=hidden_size, num_heads=num_heads, expand_k=expand_k,
                     expand_v=expand_v, gate_low_rank_dim=gate_low_rank_dim,
                     chunk_size=chunk_size, conv_size=conv_size, seq_method=seq_method)
    except ValueError as e:
      raise ValueError(f"GatedLinearAttention: {e}") from None
    check_group_size(group_size, seq_method, name="GatedLinearAttention")
    D, R = hidden_size, gate_low_rank_dim
    Kd, Vd = int(hidden_size * expand_k), int(hidden_size * expand_v)
    out_std = init_std if output_init_std is None else output_init_std
    self.num_heads, self.gate_logit_normalizer = num_heads, gate_logit_normalizer
    self.use_short_conv, self.chunk_size, self.backend = use_short_conv, chunk_size, backend
    self.conv_size = conv_size
    self.seq_axis, self.seq_method, self.num_blocks = seq_axis, seq_method, num_blocks
    self.group_size, self.batch_axes = group_size, batch_axes
    # Creation order fixes which random draws each parameter gets: keep it.
    init_qkv(self, rngs, D, Kd, Vd, init_std)
    self.g_proj = normal_param(rngs, (D, Vd), init_std, ("embed", "heads"))  # output gate
    self.gk_down = normal_param(rngs, (D, R), init_std, ("embed", "gate_rank"))
    self.gk_up = normal_param(rngs, (R, Kd), init_std, ("gate_rank", "heads"))
    self.gk_bias = constant_param((Kd,), gate_bias_init, ("heads",))
    self.g_norm = RMSNorm(Vd // num_heads, norm_eps, logical_axes=("head_dim",))
    self.o_proj = normal_param(rngs, (Vd, D), out_std, ("heads", "embed"))
    if use_short_conv:
      init_short_convs(self, rngs, Kd, Vd, conv_size)

  def decode(self, x_BxLxD, cache: LayerCache):
    """``(y, cache)`` for the next ``L`` tokens (a decode step is L = 1) after ``cache``:
    the token recurrence, O(1) per token in the context length."""
    B, L, _ = x_BxLxD.shape
    (q, k, v), conv = step_qkv(self, x_BxLxD, self.num_heads, cache.conv)
    g = self._log_decay(x_BxLxD).reshape(B, L, self.num_heads, -1)
    o, state = fused_recurrent_gla(q, k, v, g, initial_state=cache.state,
                                   output_final_state=True)
    return self._output(o, x_BxLxD), LayerCache(state, conv)

  def _log_decay(self, x_BxTxD):
    gate_logits = dot(dot(x_BxTxD, self.gk_down[...]), self.gk_up[...]).astype(jnp.float32)
    return jax.nn.log_sigmoid(gate_logits + self.gk_bias[...]) / self.gate_logit_normalizer

  def _output(self, o_BxTxHxV, x_BxTxD):
    B, T, _ = x_BxTxD.shape
    gate = dot(x_BxTxD, self.g_proj[...]).reshape(B, T, self.num_heads, -1)
    return gated_output(self.g_norm, self.o_proj, o_BxTxHxV, gate, x_BxTxD)

  def _run(self, x_BxTxD, mesh, segment_ids, *, tails: bool):
    B, T, _ = x_BxTxD.shape
    H = self.num_heads
    (q, k, v), conv = project_qkv_with_tails(
        self, x_BxTxD, H, short_conv=self.use_short_conv, segment_ids=segment_ids,
        mesh=mesh, seq_axis=self.seq_axis, tails=tails)
    g = self._log_decay(x_BxTxD).reshape(B, T, H, -1)
    out = gla_op(q, k, v, g, mesh=mesh, seq_axis=self.seq_axis, seq_method=self.seq_method,
                 num_blocks=self.num_blocks, group_size=self.group_size,
                 chunk_size=self.chunk_size, backend=self.backend,
                 segment_ids=segment_ids, batch_axes=self.batch_axes,
                 output_final_state=tails)
    o, state = out if tails else (out, None)
    y = self._output(o, x_BxTxD)
    return y, (LayerCache(state, conv) if tails else None)


__all__ = ["GatedLinearAttention", "check_gla_args", "gla_op"]
