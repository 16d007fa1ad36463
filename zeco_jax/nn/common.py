"""What every token-mixing layer shares: parameters with logical axes, RMSNorm, the causal
short convolution (sequence-parallel too, and one step at a time for decoding), the q / k /
v prologue, the decoding cache, and a remat that waits for the output's cotangent.

The layers themselves are one file per family (:mod:`zeco_jax.nn.gla`,
:mod:`zeco_jax.nn.gated_delta`); this module knows none of them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zeco_jax.sp import shard

LOGICAL_AXES_KEY = "logical_axes"   # the metadata key of every parameter's logical axis names


def normal_param(rngs: nnx.Rngs, shape, std: float, logical_axes) -> nnx.Param:
  """A float32 parameter drawn from N(0, std^2), tagged with its logical axis names."""
  init = jax.random.normal(rngs.params(), shape, jnp.float32) * std
  return nnx.Param(init, **{LOGICAL_AXES_KEY: tuple(logical_axes)})


def constant_param(shape, value: float, logical_axes) -> nnx.Param:
  return nnx.Param(jnp.full(shape, value, jnp.float32), **{LOGICAL_AXES_KEY: tuple(logical_axes)})


def dot(x, w):
  """``x @ w`` over the last axis, ``w`` cast to x's dtype (the compute dtype)."""
  return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


class RMSNorm(nnx.Module):
  """``x / rms(x) * weight`` over the last axis, in float32, returned in x's dtype."""

  def __init__(self, dim: int, eps: float = 1e-6, *, logical_axes=("embed",)):
    self.weight = constant_param((dim,), 1.0, logical_axes)
    self.eps = eps

  def __call__(self, x):
    return self.apply(x, self.weight[...])

  def apply(self, x, weight):
    """The norm with ``weight`` given (a pure function of its arguments)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


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
    if shard.seq_size(mesh, seq_axis) > 1:
      return jax.nn.silu(_sharded_conv(x_BxTxC, w, segment_ids, mesh=mesh, seq_axis=seq_axis))
    # One shard: recomputed in the backward from x, so that the taps, their sum and the
    # SiLU's input are not kept per token (21 KB a token of Gated DeltaNet-340M's q, k and
    # v in jax's saved residuals).
    return jax.checkpoint(_local_conv_silu)(x_BxTxC, w, segment_ids)

  def step(self, x_BxLxC, tail_BxWxC):
    """The next ``L`` tokens (decoding) given the ``size - 1`` inputs before them
    (``tail``, as :func:`last_tokens` or the previous step left it): ``(y, new_tail)``."""
    w = self.weight[...].astype(x_BxLxC.dtype)
    tail = tail_BxWxC.astype(x_BxLxC.dtype)
    y = _conv_with_halo(x_BxLxC, w, None, tail, None)
    new_tail = jnp.concatenate([tail, x_BxLxC], axis=1)[:, x_BxLxC.shape[1]:]
    return jax.nn.silu(y), new_tail


def _local_conv_silu(x_BxTxC, w_WxC, ids_BxT):
  return jax.nn.silu(_conv_with_halo(x_BxTxC, w_WxC, ids_BxT, None, None))


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
  """:func:`_conv_with_halo` per sequence shard (``zeco_jax.sp.shard.sharded``): the halo
  and its ids from the previous shard by one ``ppermute`` each (the first shard gets
  zeros, as the row's start)."""
  name = "ShortConvolution"
  spec = shard.shard_spec(x_BxTxC, mesh=mesh, seq_axis=seq_axis, name=name)
  T, W = x_BxTxC.shape[1], w_WxC.shape[0]
  if T // spec.seq_axis_size < W - 1:
    raise ValueError(f"{name}: a sequence shard holds T / {spec.seq_axis_size} = "
                     f"{T // spec.seq_axis_size} tokens, fewer than the convolution's halo of "
                     f"size - 1 = {W - 1}; use at least {(W - 1) * spec.seq_axis_size} tokens "
                     "or a smaller conv_size.")
  in_specs = (spec.tokens(3), P(None, spec.heads), None if ids_BxT is None else spec.tokens(2))
  return shard.sharded(_conv_shard, spec, (x_BxTxC, w_WxC, ids_BxT), in_specs, options={},
                       out_spec=spec.tokens(3))[0]


def _conv_shard(x, w, ids, *, axis_name):
  halo = lambda a: shard.previous_shard_tail(a, w.shape[0] - 1, axis_name)
  return _conv_with_halo(x, w, ids, halo(x), None if ids is None else halo(ids)), None


def init_qkv(layer: nnx.Module, rngs: nnx.Rngs, hidden: int, key_dim: int, value_dim: int,
             std: float) -> None:
  """``layer.q_proj``, ``k_proj`` (``[hidden, key_dim]``) and ``v_proj``
  (``[hidden, value_dim]``), drawn in that order (the order fixes each one's random draws)."""
  layer.q_proj = normal_param(rngs, (hidden, key_dim), std, ("embed", "heads"))
  layer.k_proj = normal_param(rngs, (hidden, key_dim), std, ("embed", "heads"))
  layer.v_proj = normal_param(rngs, (hidden, value_dim), std, ("embed", "heads"))


def init_short_convs(layer: nnx.Module, rngs: nnx.Rngs, key_dim: int, value_dim: int,
                     size: int) -> None:
  """``layer.q_conv``, ``k_conv``, ``v_conv``: :class:`ShortConvolution` on q, k and v."""
  layer.q_conv = ShortConvolution(key_dim, size, rngs=rngs)
  layer.k_conv = ShortConvolution(key_dim, size, rngs=rngs)
  layer.v_conv = ShortConvolution(value_dim, size, rngs=rngs)


def project_qkv(layer: nnx.Module, x_BxTxD, num_heads: int, *, short_conv: bool,
                segment_ids=None, mesh=None, seq_axis: str = "seq"):
  """q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` from ``x``: the projections of
  :func:`init_qkv`, then (``short_conv``) the convolutions of :func:`init_short_convs`,
  which reset at document starts and take their halo over ``seq_axis``."""
  qkv, _ = project_qkv_with_tails(layer, x_BxTxD, num_heads, short_conv=short_conv,
                                  segment_ids=segment_ids, mesh=mesh, seq_axis=seq_axis)
  return qkv


def project_qkv_with_tails(layer: nnx.Module, x_BxTxD, num_heads: int, *, short_conv: bool,
                           segment_ids=None, mesh=None, seq_axis: str = "seq",
                           tails: bool = False):
  """:func:`project_qkv` and (``tails`` and ``short_conv``) the convolutions' decoding
  cache: each one's last ``size - 1`` inputs of each row's last document
  (:func:`last_tokens`), else None."""
  B, T, _ = x_BxTxD.shape
  raw = tuple(dot(x_BxTxD, w[...]) for w in (layer.q_proj, layer.k_proj, layer.v_proj))
  out, conv_tails = raw, None
  if short_conv:
    convs = (layer.q_conv, layer.k_conv, layer.v_conv)
    out = tuple(conv(t, segment_ids, mesh=mesh, seq_axis=seq_axis)
                for conv, t in zip(convs, raw))
    if tails:
      conv_tails = tuple(last_tokens(t, segment_ids, conv.size - 1)
                         for conv, t in zip(convs, raw))
  return tuple(t.reshape(B, T, num_heads, -1) for t in out), conv_tails


def step_qkv(layer: nnx.Module, x_BxLxD, num_heads: int, conv_tails):
  """q, k, v of the next ``L`` tokens (decoding) and the new convolution tails (None
  without short convolutions): :func:`project_qkv` continued from a cache."""
  B, L, _ = x_BxLxD.shape
  out = tuple(dot(x_BxLxD, w[...]) for w in (layer.q_proj, layer.k_proj, layer.v_proj))
  if conv_tails is not None:
    convs = (layer.q_conv, layer.k_conv, layer.v_conv)
    stepped = [conv.step(t, tail) for conv, t, tail in zip(convs, out, conv_tails)]
    out, conv_tails = tuple(y for y, _ in stepped), tuple(tail for _, tail in stepped)
  return tuple(t.reshape(B, L, num_heads, -1) for t in out), conv_tails


def last_positions(segment_ids, B: int, T: int):
  """int32 ``[B]``: each row's last token that is not padding (T - 1 without ids; -1 for a
  row that is all padding) and ``[B]`` the first token of the document holding it."""
  t = jnp.arange(T, dtype=jnp.int32)
  if segment_ids is None:
    return jnp.full((B,), T - 1, jnp.int32), jnp.zeros((B,), jnp.int32)
  ids = jnp.asarray(segment_ids)
  real = ids >= 0
  last = jnp.max(jnp.where(real, t, -1), axis=1)
  starts = real & jnp.concatenate([jnp.ones((B, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  first = jnp.max(jnp.where(starts & (t <= last[:, None]), t, 0), axis=1)
  return last, first


def last_tokens(x_BxTxC, segment_ids, n: int):
  """``[B, n, C]``: the ``n`` tokens of each row that end at its last non-padding token,
  zeros for those before the start of that token's document (or of the row).

  A one-hot contraction over T (no gather, no slicing of T): on a sequence-split T it is a
  partial sum per shard and one small all-reduce, and left and right padding are alike."""
  B, T, _ = x_BxTxC.shape
  last, first = last_positions(segment_ids, B, T)
  want = last[:, None] - (n - 1) + jnp.arange(n, dtype=jnp.int32)          # [B, n]
  ok = want >= first[:, None]
  onehot = (want[:, :, None] == jnp.arange(T, dtype=jnp.int32)) & ok[:, :, None]
  return jnp.einsum("bnt,btc->bnc", onehot.astype(x_BxTxC.dtype), x_BxTxC)


class LayerCache(NamedTuple):
  """A token mixer's decoding cache (a pytree): ``state`` the float32 recurrent state
  ``[B, H, K, V]``; ``conv`` the short convolutions' last ``size - 1`` inputs, one
  ``[B, size - 1, C]`` per q, k and v, or None without short convolutions."""
  state: jax.Array
  conv: Optional[tuple] = None


class TokenMixer(nnx.Module):
  """What every family's layer shares: the training call and the decoding entry points,
  over the family's ``_run(x, mesh, segment_ids, *, tails) -> (y, cache or None)`` (the
  chunked or sequence-parallel op) and ``decode(x, cache) -> (y, cache)`` (its recurrent
  op). A subclass sets ``num_heads``, ``use_short_conv``, ``conv_size`` and the
  projections of :func:`init_qkv`."""

  def __call__(self, x_BxTxD, mesh=None, segment_ids=None):
    """``[B, T, hidden_size]`` -> same. ``segment_ids``: None or integer ``[B, T]``, packed
    documents (:mod:`zeco_jax.segments`): the short convolution and the state do not cross
    a document start; padding tokens (negative ids) leave the state unchanged."""
    return self._run(x_BxTxD, mesh, segment_ids, tails=False)[0]

  def init_cache(self, batch_size: int, dtype=jnp.float32) -> LayerCache:
    """The decoding cache before any token (zeros); ``dtype``: the short convolutions'
    inputs (the compute dtype)."""
    H, key_dim, value_dim = self.num_heads, self.q_proj.shape[1], self.v_proj.shape[1]
    state = jnp.zeros((batch_size, H, key_dim // H, value_dim // H), jnp.float32)
    conv = None
    if self.use_short_conv:
      conv = tuple(jnp.zeros((batch_size, self.conv_size - 1, c), dtype)
                   for c in (key_dim, key_dim, value_dim))
    return LayerCache(state, conv)

  def prefill(self, x_BxTxD, mesh=None, segment_ids=None):
    """``(y, cache)``: the layer over a prompt (as ``__call__``, sequence-parallel on a mesh)
    and the cache after each row's last non-padding token (left or right padding, or
    packed documents: the last document's state and convolution inputs)."""
    return self._run(x_BxTxD, mesh, segment_ids, tails=True)

  def reserve(self, cache: LayerCache, n: int) -> LayerCache:
    """``cache`` ready for ``n`` more decoded tokens: unchanged (a recurrent state has no
    slots; a softmax attention layer's KV cache grows)."""
    del n
    return cache


def gated_output(norm: RMSNorm, o_proj, o_BxTxHxV, gate_BxTxHxV, x_BxTxD, *,
                 activation=jax.nn.silu, gate_bias=None):
  """The layer's ending: the per-head ``norm`` (float32), times ``activation(gate +
  gate_bias)`` if a gate is given (``gate_bias``: None or broadcastable to the gate
  ``[B, T, H, V]``), through ``o_proj`` back to ``[B, T, hidden]`` in x's dtype."""
  B, T, _ = x_BxTxD.shape

  # Under jax.checkpoint the backward recomputes the float32 norm and gate from o and the
  # gate instead of keeping float32 copies per token (72 KB a token of a Gated
  # DeltaNet-340M layer in jax's saved residuals).
  @jax.checkpoint
  def normed(o, gate, w, bias):
    o = norm.apply(o, w).astype(jnp.float32)
    if gate is not None:
      gate = gate.astype(jnp.float32)
      if bias is not None:
        gate = gate + bias.astype(jnp.float32)
      o = o * activation(gate)
    return o.astype(x_BxTxD.dtype)

  o = normed(o_BxTxHxV, gate_BxTxHxV, norm.weight[...], gate_bias)
  return dot(o.reshape(B, T, -1), o_proj[...])


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


__all__ = ["LOGICAL_AXES_KEY", "LayerCache", "RMSNorm", "ShortConvolution", "TokenMixer",
           "constant_param", "dot", "gated_output", "init_qkv", "init_short_convs",
           "last_positions", "last_tokens", "normal_param", "project_qkv",
           "project_qkv_with_tails", "remat_call", "step_qkv"]
