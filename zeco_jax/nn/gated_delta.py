"""Flax NNX Gated DeltaNet layer: flash-linear-attention's ``GatedDeltaNet`` (chunk mode).

    from zeco_jax.nn import GatedDeltaNet
    attn = GatedDeltaNet(hidden_size=256, num_heads=2, head_dim=64, rngs=nnx.Rngs(0))
    y_BxTxD = attn(x_BxTxD)                  # [B, T, 256] -> [B, T, 256]

As FLA's layer: q/k/v projections (key dim ``num_heads * head_dim``, value dim
``num_heads * head_dim * expand_v``), a causal short convolution (+ SiLU) on each, q and
k l2-normalised, the write strength ``beta = sigmoid(x W_b)``, the log-decay
``g = -exp(A_log) * softplus(x W_a + dt_bias)`` (Mamba2's parametrisation, ``A`` drawn
uniform in (0, 16), ``dt`` log-uniform in [0.001, 0.1]), then per-head RMSNorm of the output
times a swish output gate (``use_gate``) and an output projection.

Sequence parallelism: :func:`zeco_jax.zeco_gated_delta_rule` over the mesh
axis ``seq_axis`` when it has size > 1, else
:func:`zeco_jax.chunk_gated_delta_rule`. The norms and short convolution are
:mod:`zeco_jax.nn.common`'s.

Decoding: ``init_cache`` / ``prefill`` / ``decode`` as :class:`zeco_jax.nn.GatedLinearAttention`'s,
the steps by :func:`zeco_jax.fused_recurrent_gated_delta_rule`.

What it does not do: grouped value heads (``num_v_heads``), negative eigenvalues
(``allow_neg_eigval``). Packed documents: ``segment_ids`` ``[B, T]`` reset the short
convolutions and the state at every document start (docs/design.md §10).
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from zeco_jax.nn.common import (LOGICAL_AXES_KEY, LayerCache, RMSNorm, TokenMixer, dot,
                                gated_output, init_qkv, init_short_convs, normal_param,
                                project_qkv_with_tails, step_qkv)
from zeco_jax.ops.gated_delta.op import chunk_gated_delta_rule
from zeco_jax.ops.gated_delta.parallel import zeco_gated_delta_rule
from zeco_jax.ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule
from zeco_jax._checks import check_choice
from zeco_jax.ops._dispatch import BACKENDS
from zeco_jax.sp import shard
from zeco_jax.sp.scan import SCAN_METHODS, check_group_size


def gated_delta_op(q, k, v, g, beta, *, mesh=None, seq_axis: str = "seq",
                   seq_method: str = "all_scan", num_blocks: Optional[int] = None,
                   chunk_size: int = 64, segment_ids=None, output_final_state: bool = False,
                   group_size: Optional[int] = None, backend: str = "auto"):
  """Gated DeltaNet with l2-normalised q, k: ``zeco_gated_delta_rule`` over ``seq_axis``
  when that mesh axis has size > 1, else ``chunk_gated_delta_rule``. Returns o, and with
  ``output_final_state`` ``(o, final_state)``."""
  if shard.seq_size(mesh, seq_axis) > 1:
    o, final = zeco_gated_delta_rule(q, k, v, g, beta, mesh=mesh, seq_axis=seq_axis,
                                     method=seq_method, num_blocks=num_blocks,
                                     group_size=group_size, chunk_size=chunk_size,
                                     use_qk_l2norm=True, backend=backend,
                                     segment_ids=segment_ids,
                                     output_final_state=output_final_state)
  else:
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size,
                                      use_qk_l2norm=True, segment_ids=segment_ids,
                                      backend=backend,
                                      output_final_state=output_final_state)
  return (o, final) if output_final_state else o


class GatedDeltaNet(TokenMixer):
  """The Gated DeltaNet token mixer: ``[B, T, hidden_size]`` -> ``[B, T, hidden_size]``.

  Args:
    hidden_size, num_heads, head_dim: width, heads, key dim per head.
    expand_v: value dim per head = ``head_dim * expand_v`` (an integer).
    use_gate: swish output gate (FLA's ``FusedRMSNormGated``); else the norm alone.
    use_short_conv, conv_size: causal short convolution (+ SiLU) on q, k and v.
    norm_eps, init_std, output_init_std: the output norm's epsilon; std of the
      projections and of the output projection (default ``init_std``).
    chunk_size, seq_axis, seq_method, num_blocks, group_size, backend: passed to the op
      (``backend``: ``"auto"``, ``"jax"`` or ``"pallas"``, as in
      :func:`zeco_jax.chunk_gated_delta_rule`).
  """

  def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int, expand_v: float = 2.0,
               use_gate: bool = True, use_short_conv: bool = True, conv_size: int = 4,
               norm_eps: float = 1e-5, init_std: float = 0.02,
               output_init_std: Optional[float] = None, chunk_size: int = 64,
               seq_axis: str = "seq", seq_method: str = "all_scan",
               num_blocks: Optional[int] = None, group_size: Optional[int] = None,
               backend: str = "auto", rngs: nnx.Rngs):
    for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                        ("head_dim", head_dim), ("chunk_size", chunk_size),
                        ("conv_size", conv_size)):
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"GatedDeltaNet: {name} must be a positive int, got {value!r}")
    head_v = head_dim * expand_v
    if head_v <= 0 or not math.isclose(head_v, round(head_v)):
      raise ValueError(f"GatedDeltaNet: head_dim * expand_v = {head_dim} * {expand_v} must be "
                       "a positive integer (the value dim per head)")
    if seq_method not in SCAN_METHODS:
      raise ValueError(f"GatedDeltaNet: seq_method must be one of {tuple(SCAN_METHODS)}, got "
                       f"{seq_method!r}")
    check_group_size(group_size, seq_method, name="GatedDeltaNet")
    check_choice(backend, BACKENDS, arg="backend", name="GatedDeltaNet")
    D, H = hidden_size, num_heads
    Kd, Vd = H * head_dim, H * int(round(head_v))
    out_std = init_std if output_init_std is None else output_init_std
    self.num_heads, self.use_gate, self.use_short_conv = H, use_gate, use_short_conv
    self.chunk_size, self.seq_axis, self.conv_size = chunk_size, seq_axis, conv_size
    self.seq_method, self.num_blocks, self.group_size = seq_method, num_blocks, group_size
    self.backend = backend
    init_qkv(self, rngs, D, Kd, Vd, init_std)
    self.a_proj = normal_param(rngs, (D, H), init_std, ("embed", None))
    self.b_proj = normal_param(rngs, (D, H), init_std, ("embed", None))
    A = jax.random.uniform(rngs.params(), (H,), jnp.float32, 1e-4, 16.0)
    self.A_log = nnx.Param(jnp.log(A), **{LOGICAL_AXES_KEY: (None,)})
    lo, hi = math.log(1e-3), math.log(0.1)
    dt = jnp.maximum(jnp.exp(jax.random.uniform(rngs.params(), (H,), jnp.float32, lo, hi)),
                     1e-4)
    # softplus(dt_bias) = dt at initialisation.
    self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)), **{LOGICAL_AXES_KEY: (None,)})
    if use_short_conv:
      init_short_convs(self, rngs, Kd, Vd, conv_size)
    if use_gate:
      self.g_proj = normal_param(rngs, (D, Vd), init_std, ("embed", "heads"))
    self.o_norm = RMSNorm(Vd // H, norm_eps, logical_axes=("head_dim",))
    self.o_proj = normal_param(rngs, (Vd, D), out_std, ("heads", "embed"))

  def decode(self, x_BxLxD, cache: LayerCache):
    """``(y, cache)`` for the next ``L`` tokens after ``cache`` (the token recurrence)."""
    (q, k, v), conv = step_qkv(self, x_BxLxD, self.num_heads, cache.conv)
    g, beta = self._gates(x_BxLxD)
    o, state = fused_recurrent_gated_delta_rule(q, k, v, g, beta.astype(v.dtype),
                                                initial_state=cache.state,
                                                output_final_state=True, use_qk_l2norm=True)
    return self._output(o, x_BxLxD), LayerCache(state, conv)

  def _gates(self, x_BxTxD):
    """The log-decay g and the write strength beta, float32 ``[B, T, H]``."""
    beta = jax.nn.sigmoid(dot(x_BxTxD, self.b_proj[...]).astype(jnp.float32))
    a = dot(x_BxTxD, self.a_proj[...]).astype(jnp.float32)
    return -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...]), beta

  def _output(self, o_BxTxHxV, x_BxTxD):
    B, T, _ = x_BxTxD.shape
    gate = (dot(x_BxTxD, self.g_proj[...]).reshape(B, T, self.num_heads, -1)
            if self.use_gate else None)
    return gated_output(self.o_norm, self.o_proj, o_BxTxHxV, gate, x_BxTxD)

  def _run(self, x_BxTxD, mesh, segment_ids, *, tails: bool):
    (q, k, v), conv = project_qkv_with_tails(
        self, x_BxTxD, self.num_heads, short_conv=self.use_short_conv,
        segment_ids=segment_ids, mesh=mesh, seq_axis=self.seq_axis, tails=tails)
    g, beta = self._gates(x_BxTxD)
    out = gated_delta_op(q, k, v, g, beta.astype(v.dtype), mesh=mesh, seq_axis=self.seq_axis,
                         seq_method=self.seq_method, num_blocks=self.num_blocks,
                         group_size=self.group_size, chunk_size=self.chunk_size,
                         segment_ids=segment_ids, backend=self.backend,
                         output_final_state=tails)
    o, state = out if tails else (out, None)
    return self._output(o, x_BxTxD), (LayerCache(state, conv) if tails else None)


__all__ = ["GatedDeltaNet", "gated_delta_op"]
