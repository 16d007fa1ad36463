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

What it does not do: decoding with a recurrent cache, or the rest of a block (MLP,
residuals, embeddings).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import PartitionSpec as P

from zeco_jax.ops import chunk_gla
from zeco_jax.parallel import (_axes_in, _explicit_entries, _mesh_or_context, _on, seq_axis_size,
                               zeco_gla)
from zeco_jax.scan import SCAN_METHODS

LOGICAL_AXES_KEY = "logical_axes"   # the metadata key of every parameter's logical axis names


def normal_param(rngs: nnx.Rngs, shape, std: float, logical_axes) -> nnx.Param:
  """A float32 parameter drawn from N(0, std^2), tagged with its logical axis names."""
  init = jax.random.normal(rngs.params(), shape, jnp.float32) * std
  return nnx.Param(init, **{LOGICAL_AXES_KEY: tuple(logical_axes)})


def constant_param(shape, value: float, logical_axes) -> nnx.Param:
  return nnx.Param(jnp.full(shape, value, jnp.float32), **{LOGICAL_AXES_KEY: tuple(logical_axes)})


def _dot(x, w):
  return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


class RMSNorm(nnx.Module):
  """``x / rms(x) * weight`` over the last axis, in float32, returned in x's dtype."""

  def __init__(self, dim: int, eps: float = 1e-6, *, logical_axes=("embed",)):
    self.weight = constant_param((dim,), 1.0, logical_axes)
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class ShortConvolution(nnx.Module):
  """Causal depthwise convolution over time, then SiLU (fla ``ShortConvolution``).

  With ``segment_ids`` (``[B, T]``, :mod:`zeco_jax.segments`) a tap that would read a token
  before the start of the current document reads zero instead, as at the start of the
  row: no document sees the previous one.

  Over a mesh whose ``seq_axis`` has size > 1 (``mesh=`` or the one set with
  ``jax.set_mesh``; Auto or Explicit axes) each sequence shard receives its
  ``size - 1``-token halo (and its segment ids) from the previous shard by one
  ``ppermute`` inside a shard_map, forward and backward; a shard must hold at least
  ``size - 1`` tokens.
  """

  def __init__(self, dim: int, size: int = 4, *, rngs: nnx.Rngs,
               logical_axes=(None, "heads")):
    self.weight = normal_param(rngs, (size, dim), size ** -0.5, logical_axes)
    self.size = size

  def __call__(self, x_BxTxC, segment_ids=None, *, mesh=None, seq_axis: str = "seq"):
    if segment_ids is not None:
      ids = jnp.asarray(segment_ids)
      if ids.shape != x_BxTxC.shape[:2] or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ShortConvolution: `segment_ids` must be integer [B, T] = "
                         f"{x_BxTxC.shape[:2]}, got {ids.dtype} {ids.shape}.")
    w = self.weight[...].astype(x_BxTxC.dtype)
    if _seq_size(mesh, seq_axis) > 1:
      y = _sharded_conv(x_BxTxC, w, segment_ids, mesh=mesh, seq_axis=seq_axis)
    else:
      y = _conv_with_halo(x_BxTxC, w, segment_ids, None, None)
    return jax.nn.silu(y)


def _conv_with_halo(x_BxLxC, w_WxC, ids_BxL, halo_x, halo_ids):
  """The depthwise causal convolution of one shard, given the ``W - 1`` tokens before it
  (``halo_x``, and their ids ``halo_ids``; None: the start of the row, zeros)."""
  B, L, C = x_BxLxC.shape
  W = w_WxC.shape[0]
  if halo_x is None:
    halo_x = jnp.zeros((B, W - 1, C), x_BxLxC.dtype)
  padded = jnp.concatenate([halo_x, x_BxLxC], axis=1)
  # Tap j (j = 0 the current token) reads x[t - j], i.e. padded[:, W - 1 - j + t].
  taps = [padded[:, W - 1 - j:W - 1 - j + L] for j in range(W)]
  if ids_BxL is not None:
    if halo_ids is None:        # the row's start: the halo is zeros, any ids do
      halo_ids = jnp.zeros((B, W - 1), ids_BxL.dtype)
    ids = jnp.concatenate([halo_ids, ids_BxL], axis=1)
    # same[i] = padded token i continues padded token i - 1's document; tap j is read only
    # if tokens t - j + 1 .. t all continue.
    same = jnp.pad(ids[:, 1:] == ids[:, :-1], ((0, 0), (1, 0)))
    ok = jnp.ones((B, L), bool)
    for j in range(1, W):
      ok = ok & same[:, W - j:W - j + L]
      taps[j] = jnp.where(ok[..., None], taps[j], jnp.zeros((), taps[j].dtype))
  return sum(taps[j] * w_WxC[W - 1 - j] for j in range(W))


def _sharded_conv(x_BxTxC, w_WxC, ids_BxT, *, mesh, seq_axis):
  """:func:`_conv_with_halo` per sequence shard: the halo (and its ids) from the previous
  shard by one ``ppermute`` each (the first shard gets zeros, as the row's start)."""
  name = "ShortConvolution"
  mesh = _mesh_or_context(mesh, name=name)
  B, T, C = x_BxTxC.shape
  P_size = seq_axis_size(mesh, seq_axis, T, name=name)
  W = w_WxC.shape[0]
  if T // P_size < W - 1:
    raise ValueError(f"{name}: a sequence shard holds T / {P_size} = {T // P_size} tokens, "
                     f"fewer than the convolution's halo of size - 1 = {W - 1}; use at least "
                     f"{(W - 1) * P_size} tokens or a smaller conv_size.")
  batch_spec, chan_spec = _explicit_entries(x_BxTxC, mesh, seq_axis, (0, 2))
  manual = {seq_axis} | _axes_in(batch_spec) | _axes_in(chan_spec)
  x_spec = P(batch_spec, seq_axis, chan_spec)
  w_spec = P(None, chan_spec)
  ids_spec = None if ids_BxT is None else P(batch_spec, seq_axis)
  if manual != {seq_axis}:      # Explicit axes: keep the caller's split of B and C
    place = lambda a, spec: jax.sharding.reshard(a, _on(mesh, spec))
    x_BxTxC, w_WxC = place(x_BxTxC, x_spec), place(w_WxC, w_spec)
    ids_BxT = None if ids_BxT is None else place(ids_BxT, ids_spec)

  def body(x, w, ids):
    n = jax.lax.axis_size(seq_axis)
    send = lambda a: jax.lax.ppermute(a[:, a.shape[1] - (W - 1):], seq_axis,
                                      [(i, i + 1) for i in range(n - 1)])
    return _conv_with_halo(x, w, ids, send(x), None if ids is None else send(ids))

  return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec, ids_spec),
                       out_specs=x_spec, axis_names=manual)(x_BxTxC, w_WxC, ids_BxT)


def _seq_size(mesh, axis: str) -> int:
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or getattr(mesh, "empty", False):
    return 1
  return int(dict(mesh.shape).get(axis, 1))


def _mesh_size(mesh) -> int:
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or getattr(mesh, "empty", False):
    return 1
  return int(np.prod(list(dict(mesh.shape).values()), dtype=np.int64))


def gla_op(q, k, v, g, *, mesh=None, seq_axis: str = "seq", seq_method: str = "all_scan",
           num_blocks: Optional[int] = None, chunk_size: int = 64, backend: str = "auto",
           segment_ids=None, batch_axes=None):
  """GLA over ``[B, T, H, K/V]``: ``zeco_gla`` over ``seq_axis`` when that mesh axis has
  size > 1 (or when ``batch_axes`` names how B is split on a mesh of more than one
  device), else ``chunk_gla`` (on one seq shard, or with no mesh). Returns the output.
  ``segment_ids``: packed documents, as in :func:`zeco_jax.chunk_gla`. ``batch_axes``: the
  mesh axis (or axes) B is split over, as in :func:`zeco_jax.zeco_gla`: the kernels then
  run per shard of B too (the compiler cannot partition a kernel: without it a mesh with a
  data axis > 1 is refused on the Pallas backend)."""
  seg = {} if segment_ids is None else {"segment_ids": segment_ids}
  if _seq_size(mesh, seq_axis) > 1 or (batch_axes is not None and _mesh_size(mesh) > 1):
    kwargs = {} if num_blocks is None else {"num_blocks": num_blocks}
    kwargs.update(seg)
    o, _ = zeco_gla(q, k, v, g, mesh=mesh, seq_axis=seq_axis, method=seq_method,
                    chunk_size=chunk_size, backend=backend, batch_axes=batch_axes, **kwargs)
  else:
    o, _ = chunk_gla(q, k, v, g, chunk_size=chunk_size, backend=backend, **seg)
  return o


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
    raise ValueError(f"seq_method must be one of {tuple(SCAN_METHODS)} (zeco_jax.scan."
                     f"SCAN_METHODS), got {seq_method!r}")


class GatedLinearAttention(nnx.Module):
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
    seq_axis, seq_method, num_blocks: the mesh axis the sequence is split over and
      ``zeco_gla``'s method and pipeline blocks (None: ``zeco_gla``'s choice).
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
               batch_axes=None, rngs: nnx.Rngs):
    try:
      check_gla_args(hidden_size=hidden_size, num_heads=num_heads, expand_k=expand_k,
                     expand_v=expand_v, gate_low_rank_dim=gate_low_rank_dim,
                     chunk_size=chunk_size, conv_size=conv_size, seq_method=seq_method)
    except ValueError as e:
      raise ValueError(f"GatedLinearAttention: {e}") from None
    D, R = hidden_size, gate_low_rank_dim
    Kd, Vd = int(hidden_size * expand_k), int(hidden_size * expand_v)
    out_std = init_std if output_init_std is None else output_init_std
    self.num_heads, self.gate_logit_normalizer = num_heads, gate_logit_normalizer
    self.use_short_conv, self.chunk_size, self.backend = use_short_conv, chunk_size, backend
    self.seq_axis, self.seq_method, self.num_blocks = seq_axis, seq_method, num_blocks
    self.batch_axes = batch_axes
    # Creation order fixes which random draws each parameter gets: keep it.
    self.q_proj = normal_param(rngs, (D, Kd), init_std, ("embed", "heads"))
    self.k_proj = normal_param(rngs, (D, Kd), init_std, ("embed", "heads"))
    self.v_proj = normal_param(rngs, (D, Vd), init_std, ("embed", "heads"))
    self.g_proj = normal_param(rngs, (D, Vd), init_std, ("embed", "heads"))  # output gate
    self.gk_down = normal_param(rngs, (D, R), init_std, ("embed", "gate_rank"))
    self.gk_up = normal_param(rngs, (R, Kd), init_std, ("gate_rank", "heads"))
    self.gk_bias = constant_param((Kd,), gate_bias_init, ("heads",))
    self.g_norm = RMSNorm(Vd // num_heads, norm_eps, logical_axes=("head_dim",))
    self.o_proj = normal_param(rngs, (Vd, D), out_std, ("heads", "embed"))
    if use_short_conv:
      self.q_conv = ShortConvolution(Kd, conv_size, rngs=rngs)
      self.k_conv = ShortConvolution(Kd, conv_size, rngs=rngs)
      self.v_conv = ShortConvolution(Vd, conv_size, rngs=rngs)

  def __call__(self, x_BxTxD, mesh=None, segment_ids=None):
    """``[B, T, hidden_size]`` -> same. ``segment_ids``: None or integer ``[B, T]``, packed
    documents (:mod:`zeco_jax.segments`): the short convolution and the GLA state do not
    cross a document start; padding tokens (negative ids) output zero from the GLA."""
    B, T, _ = x_BxTxD.shape
    H = self.num_heads
    q = _dot(x_BxTxD, self.q_proj[...])
    k = _dot(x_BxTxD, self.k_proj[...])
    v = _dot(x_BxTxD, self.v_proj[...])
    if self.use_short_conv:
      conv = dict(mesh=mesh, seq_axis=self.seq_axis)
      q, k, v = (self.q_conv(q, segment_ids, **conv), self.k_conv(k, segment_ids, **conv),
                 self.v_conv(v, segment_ids, **conv))
    q, k, v = (x.reshape(B, T, H, -1) for x in (q, k, v))
    gate_logits = _dot(_dot(x_BxTxD, self.gk_down[...]), self.gk_up[...]).astype(jnp.float32)
    g = jax.nn.log_sigmoid(gate_logits + self.gk_bias[...]) / self.gate_logit_normalizer
    o_BxTxHxV = gla_op(q, k, v, g.reshape(B, T, H, -1), mesh=mesh, seq_axis=self.seq_axis,
                       seq_method=self.seq_method, num_blocks=self.num_blocks,
                       chunk_size=self.chunk_size, backend=self.backend,
                       segment_ids=segment_ids, batch_axes=self.batch_axes)
    gate = _dot(x_BxTxD, self.g_proj[...]).reshape(B, T, H, -1)
    o = self.g_norm(o_BxTxHxV).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return _dot(o.reshape(B, T, -1).astype(x_BxTxD.dtype), self.o_proj[...])


def remat_call(fn, module: nnx.Module, *args):
  """``fn(module, *args)`` recomputed in the backward (like ``nnx.remat``), where the
  recomputation cannot start before the cotangent of the output has arrived.

  With ``jax.checkpoint`` (``nnx.remat``) a block's recomputation depends only on the
  block's saved input, and its weight gradients on nothing the next block's backward needs,
  so XLA's latency-hiding scheduler is free to move both, for instance beside the All-Scan's
  collective-permutes, and then keeps many blocks' activations alive at once. Compiled for
  v5p:4x4x4 (seq = 64, 16K tokens per chip), 12 of gla_1b3's blocks with all_scan needed
  18.3 GiB of temporaries per chip (all_gather, with no permutes to fill: 11.5), the gap
  growing with depth (24 blocks: 31.9 against 14.9). Here a block's backward runs its inputs
  and the output cotangent through one ``optimization_barrier`` before it recomputes, and
  the input's cotangent and the parameters' through another after: 10.4 GiB at 12 blocks
  (benchmarks/results/scale_aot.md). Gradients are those of ``fn(module, *args)``; ``fn``'s
  other inputs (a mesh, flags) are closed over; ``args`` are arrays or None.
  """
  graphdef, state = nnx.split(module)

  def pure(state, *args):
    return fn(nnx.merge(graphdef, state), *args)

  @jax.custom_vjp
  def call(state, *args):
    return pure(state, *args)

  def call_fwd(state, *args):
    return pure(state, *args), (state, args)

  def call_bwd(res, ct):
    (state, args), ct = jax.lax.optimization_barrier((res, ct))
    grads = jax.vjp(pure, state, *args)[1](ct)
    # The input's cotangent leaves with the parameters' (no weight gradient left for later).
    leaves, tree = jax.tree.flatten(grads)
    real = [i for i, x in enumerate(leaves) if x.dtype != jax.dtypes.float0]
    for i, x in zip(real, jax.lax.optimization_barrier([leaves[i] for i in real])):
      leaves[i] = x
    return jax.tree.unflatten(tree, leaves)

  call.defvjp(call_fwd, call_bwd)
  return call(state, *args)


__all__ = ["GatedLinearAttention", "RMSNorm", "ShortConvolution", "check_gla_args",
           "constant_param", "gla_op", "normal_param", "remat_call", "LOGICAL_AXES_KEY"]
