"""Flax NNX Kimi Delta Attention layer: flash-linear-attention's ``KimiDeltaAttention``
(chunk mode), the linear mixer of Kimi Linear.

    from zeco_jax.nn import KimiDeltaAttention
    attn = KimiDeltaAttention(hidden_size=256, num_heads=2, head_dim=64, rngs=nnx.Rngs(0))
    y_BxTxD = attn(x_BxTxD)                  # [B, T, 256] -> [B, T, 256]

As FLA's layer: q/k/v projections (key dim ``num_heads * head_dim``, value dim
``num_heads * head_dim * expand_v``), a causal short convolution (+ SiLU) on each, q and
k l2-normalised, the write strength ``beta = sigmoid(x W_b)``, the per-channel log-decay
from a low-rank projection ``f = x W_f1 W_f2`` (rank: the value dim per head) through
:func:`zeco_jax.kda_gate` (``-exp(A_log) * softplus(f + dt_bias)``, ``A`` drawn uniform
in (1, 16), ``dt`` log-uniform in [0.001, 0.1]; with ``lower_bound`` FLA's bounded form),
then per-head RMSNorm of the output times a sigmoid output gate from a second low-rank
projection (with a bias), and an output projection.

Sequence parallelism: :func:`zeco_jax.zeco_kda` over the mesh axis ``seq_axis`` when it has
size > 1, else :func:`zeco_jax.chunk_kda`. The norms and short convolution are
:mod:`zeco_jax.nn.common`'s. Decoding: ``init_cache`` / ``prefill`` / ``decode`` as the
other layers', the steps by :func:`zeco_jax.fused_recurrent_kda`.

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

from zeco_jax.nn.common import (LOGICAL_AXES_KEY, LayerCache, RMSNorm, TokenMixer,
                                constant_param, dot, gated_output, init_qkv, init_short_convs,
                                normal_param, project_qkv_with_tails, step_qkv)
from zeco_jax.ops.kda.gate import kda_gate
from zeco_jax.ops.kda.op import chunk_kda
from zeco_jax.ops.kda.parallel import zeco_kda
from zeco_jax.ops.kda.recurrent import fused_recurrent_kda
from zeco_jax.sp import shard
from zeco_jax._checks import check_choice
from zeco_jax.ops._dispatch import BACKENDS
from zeco_jax.sp.scan import SCAN_METHODS, check_group_size


def kda_op(q, k, v, g, beta, *, mesh=None, seq_axis: str = "seq", seq_method: str = "all_scan",
           num_blocks: Optional[int] = None, group_size: Optional[int] = None,
           chunk_size: int = 64, segment_ids=None, output_final_state: bool = False,
           backend: str = "auto"):
  """KDA with l2-normalised q, k: ``zeco_kda`` over ``seq_axis`` when that mesh axis has
  size > 1, else ``chunk_kda``. Returns o, and with ``output_final_state``
  ``(o, final_state)``."""
  if shard.seq_size(mesh, seq_axis) > 1:
    o, final = zeco_kda(q, k, v, g, beta, mesh=mesh, seq_axis=seq_axis, method=seq_method,
                        num_blocks=num_blocks, group_size=group_size, chunk_size=chunk_size,
                        use_qk_l2norm=True, segment_ids=segment_ids, backend=backend,
                        output_final_state=output_final_state)
  else:
    o, final = chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, use_qk_l2norm=True,
                         segment_ids=segment_ids, backend=backend,
                         output_final_state=output_final_state)
  return (o, final) if output_final_state else o


class KimiDeltaAttention(TokenMixer):
  """The KDA token mixer: ``[B, T, hidden_size]`` -> ``[B, T, hidden_size]``.

  Args:
    hidden_size, num_heads, head_dim: width, heads, key dim per head.
    expand_v: value dim per head = ``head_dim * expand_v`` (an integer); also the rank of
      the decay's and the output gate's low-rank projections (FLA's ``head_v_dim``).
    lower_bound: None, or FLA's lower bound of the log-decay (e.g. -5): the gate's bounded
      form (:func:`zeco_jax.kda_gate`).
    use_short_conv, conv_size: causal short convolution (+ SiLU) on q, k and v.
    norm_eps, init_std, output_init_std: the output norm's epsilon; std of the
      projections and of the output projection (default ``init_std``).
    chunk_size, seq_axis, seq_method, num_blocks, group_size, backend: passed to the op
      (``backend``: ``"auto"``, ``"jax"`` or ``"pallas"``, as in :func:`zeco_jax.chunk_kda`).
  """

  def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int, expand_v: float = 1.0,
               lower_bound: Optional[float] = None, use_short_conv: bool = True,
               conv_size: int = 4, norm_eps: float = 1e-5, init_std: float = 0.02,
               output_init_std: Optional[float] = None, chunk_size: int = 64,
               seq_axis: str = "seq", seq_method: str = "all_scan",
               num_blocks: Optional[int] = None, group_size: Optional[int] = None,
               backend: str = "auto", rngs: nnx.Rngs):
    for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                        ("head_dim", head_dim), ("chunk_size", chunk_size),
                        ("conv_size", conv_size)):
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"KimiDeltaAttention: {name} must be a positive int, got {value!r}")
    head_v = head_dim * expand_v
    if head_v <= 0 or not math.isclose(head_v, round(head_v)):
      raise ValueError(f"KimiDeltaAttention: head_dim * expand_v = {head_dim} * {expand_v} "
                       "must be a positive integer (the value dim per head)")
    if lower_bound is not None and not lower_bound < 0:
      raise ValueError(f"KimiDeltaAttention: lower_bound must be None or negative (a "
                       f"log-decay bound, e.g. -5), got {lower_bound!r}")
    if seq_method not in SCAN_METHODS:
      raise ValueError(f"KimiDeltaAttention: seq_method must be one of {tuple(SCAN_METHODS)}, "
                       f"got {seq_method!r}")
    check_group_size(group_size, seq_method, name="KimiDeltaAttention")
    check_choice(backend, BACKENDS, arg="backend", name="KimiDeltaAttention")
    D, H, R = hidden_size, num_heads, int(round(head_v))
    Kd, Vd = H * head_dim, H * R
    out_std = init_std if output_init_std is None else output_init_std
    self.num_heads, self.use_short_conv, self.lower_bound = H, use_short_conv, lower_bound
    self.chunk_size, self.seq_axis, self.conv_size = chunk_size, seq_axis, conv_size
    self.seq_method, self.num_blocks, self.group_size = seq_method, num_blocks, group_size
    self.backend = backend
    init_qkv(self, rngs, D, Kd, Vd, init_std)
    self.f_down = normal_param(rngs, (D, R), init_std, ("embed", None))
    self.f_up = normal_param(rngs, (R, Kd), init_std, (None, "heads"))
    self.b_proj = normal_param(rngs, (D, H), init_std, ("embed", None))
    A = jax.random.uniform(rngs.params(), (H,), jnp.float32, 1.0, 16.0)
    self.A_log = nnx.Param(jnp.log(A), **{LOGICAL_AXES_KEY: (None,)})
    lo, hi = math.log(1e-3), math.log(0.1)
    dt = jnp.maximum(jnp.exp(jax.random.uniform(rngs.params(), (Kd,), jnp.float32, lo, hi)),
                     1e-4)
    # softplus(dt_bias) = dt at initialisation.
    self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)), **{LOGICAL_AXES_KEY: ("heads",)})
    if use_short_conv:
      init_short_convs(self, rngs, Kd, Vd, conv_size)
    self.g_down = normal_param(rngs, (D, R), init_std, ("embed", None))
    self.g_up = normal_param(rngs, (R, Vd), init_std, (None, "heads"))
    self.g_bias = constant_param((Vd,), 0.0, ("heads",))
    self.o_norm = RMSNorm(R, norm_eps, logical_axes=("head_dim",))
    self.o_proj = normal_param(rngs, (Vd, D), out_std, ("heads", "embed"))

  def decode(self, x_BxLxD, cache: LayerCache):
    """``(y, cache)`` for the next ``L`` tokens after ``cache`` (the token recurrence)."""
    (q, k, v), conv = step_qkv(self, x_BxLxD, self.num_heads, cache.conv)
    g, beta = self._gates(x_BxLxD)
    o, state = fused_recurrent_kda(q, k, v, g, beta.astype(v.dtype),
                                   initial_state=cache.state, output_final_state=True,
                                   use_qk_l2norm=True)
    return self._output(o, x_BxLxD), LayerCache(state, conv)

  def _gates(self, x_BxTxD):
    """The per-channel log-decay g float32 ``[B, T, H, K]`` and the write strength beta
    float32 ``[B, T, H]``."""
    B, T, _ = x_BxTxD.shape
    beta = jax.nn.sigmoid(dot(x_BxTxD, self.b_proj[...]).astype(jnp.float32))
    f = dot(dot(x_BxTxD, self.f_down[...]), self.f_up[...])   # kda_gate takes it to float32
    g = kda_gate(f.reshape(B, T, self.num_heads, -1), self.A_log[...], self.dt_bias[...],
                 lower_bound=self.lower_bound)
    return g, beta

  def _output(self, o_BxTxHxV, x_BxTxD):
    """Per-head RMSNorm times the sigmoid output gate, through ``o_proj``."""
    B, T, _ = x_BxTxD.shape
    gate = dot(dot(x_BxTxD, self.g_down[...]), self.g_up[...])
    return gated_output(self.o_norm, self.o_proj, o_BxTxHxV,
                        gate.reshape(B, T, self.num_heads, -1), x_BxTxD,
                        activation=jax.nn.sigmoid,
                        gate_bias=self.g_bias[...].reshape(self.num_heads, -1))

  def _run(self, x_BxTxD, mesh, segment_ids, *, tails: bool):
    (q, k, v), conv = project_qkv_with_tails(
        self, x_BxTxD, self.num_heads, short_conv=self.use_short_conv,
        segment_ids=segment_ids, mesh=mesh, seq_axis=self.seq_axis, tails=tails)
    g, beta = self._gates(x_BxTxD)
    out = kda_op(q, k, v, g, beta.astype(v.dtype), mesh=mesh, seq_axis=self.seq_axis,
                 seq_method=self.seq_method, num_blocks=self.num_blocks,
                 group_size=self.group_size, chunk_size=self.chunk_size,
                 segment_ids=segment_ids, backend=self.backend, output_final_state=tails)
    o, state = out if tails else (out, None)
    return self._output(o, x_BxTxD), (LayerCache(state, conv) if tails else None)


__all__ = ["KimiDeltaAttention", "kda_op"]
