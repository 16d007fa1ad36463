"""Softmax attention with T split contiguously over a mesh axis, the same split the linear
families' All-Scan uses, so hybrid models keep one layout (docs/design.md §12).

``sp_attention`` (a shard_map over ``seq_axis``) and ``sp_attention_local`` (inside your
own) run one of :data:`ATTENTION_METHODS`:

* ``"ulysses"`` (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head shards
  (each rank: all T for H / P query heads), full attention there, an all-to-all back. H
  must be a multiple of P; with Hkv < P each key head is repeated to P heads before its
  all-to-all (P % Hkv == 0), so K and V cost what P key heads would.
* ``"all_gather"`` (LASP-2H): K and V all-gathered; the queries move into a zigzag layout
  for the computation (rank r computes sequence chunks r and 2P - 1 - r of 2P, every rank
  the same causal work) and the outputs move back, one ppermute per half each way.
* ``"ring"`` (ring attention): K and V blocks travel around the ring, P - 1 ppermutes;
  blocks a rank's queries cannot see are skipped (under a contiguous causal split the last
  rank works P times the first).

The local attention of Ulysses (and of one rank) runs through ``backend`` (the kernels of
:mod:`zeco_jax.ops.attention.op`: cuDNN on GPU, splash on TPU, XLA); the all-gather and
ring methods fold key blocks in XLA ops (``backend="auto"`` or ``"xla"``; a kernel backend
is an error there).

All three take ``segment_ids`` as the linear ops do (documents never attend across a
start, also across shard boundaries; negative ids are padding and output zero), an
optional sliding ``window`` and grouped key heads, and are differentiated by JAX (the
transposes of the all-to-alls, all-gathers and ppermutes). Each rank all-gathers the
int32 ids (``B x T x 4`` bytes) to number the documents globally.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable, Mapping

import jax.numpy as jnp
from jax import lax

from zeco_jax import _checks
from zeco_jax.ops.attention import op
from zeco_jax.ops.attention.blockwise import (finish, fold_if_visible, group_queries,
                                              init_stats)
from zeco_jax.ops.attention.op import check_inputs, local_attention
from zeco_jax.ops.attention.reference import document_numbers
from zeco_jax.runtime import target
from zeco_jax.sp import shard
from zeco_jax.sp.scan import DEFAULT_ALPHA_S, DEFAULT_BETA_S_PER_BYTE


@dataclasses.dataclass(frozen=True)
class AttentionMethod:
  """One way to run softmax attention over a sequence mesh axis.

  Attributes:
    name: the key in :data:`ATTENTION_METHODS`, the value of ``method=``.
    summary: one line.
    run: ``run(q, k, v, ids, *, axis_name, args, block_size, backend, platform) -> o`` on
      one rank's shard (``backend``: resolved by :func:`resolve_backend`).
    bytes_per_rank: ``bytes_per_rank(P, B, T, H, Hkv, D, itemsize)``: the bytes one rank
      sends in the forward (the backward sends the transposes: about as much again).
    time: ``time(P, B, T, H, Hkv, D, itemsize, alpha, beta)``: the alpha-beta seconds of
      the forward's communication.
  """
  name: str
  summary: str
  run: Callable
  bytes_per_rank: Callable[..., float]
  time: Callable[..., float]


def _global_docs(ids, axis_name, B, Tl):
  """Document numbers ``[B, T]`` of the whole sequence (-1 padding), from every rank's ids."""
  P = lax.axis_size(axis_name)
  if ids is None:
    return jnp.zeros((B, Tl * P), jnp.int32)
  return document_numbers(lax.all_gather(ids, axis_name, axis=1, tiled=True), B, Tl * P)


def _positions(first, n, B):
  return jnp.broadcast_to(first + jnp.arange(n, dtype=jnp.int32), (B, n))


def _ulysses(q, k, v, ids, *, axis_name, args, block_size, backend, platform):
  P = lax.axis_size(axis_name)
  B, Tl = q.shape[:2]
  T = Tl * P
  if k.shape[2] % P:                      # Hkv < P: repeat the key heads up to P
    rep = P // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  to_heads = lambda x: lax.all_to_all(x, axis_name, 2, 1, tiled=True)
  qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)            # [B, T, heads / P, D]
  doc = None if ids is None else _global_docs(ids, axis_name, B, Tl)
  o = local_attention(qh, kh, vh, doc, backend=backend, platform=platform, scale=args.scale,
                      causal=args.causal, window=args.window,
                      block_size=min(block_size, Tl))
  return lax.all_to_all(o, axis_name, 1, 2, tiled=True)


def _zigzag_perms(P):
  """The two ppermutes that move contiguous halves into the zigzag layout: rank r's first
  half is chunk 2r, its second chunk 2r + 1 (of 2P); chunk j belongs to rank j (slot 0)
  for j < P, else to rank 2P - 1 - j (slot 1). Even chunks go to distinct ranks, odd ones
  too, so each half is one permutation."""
  owner = lambda j: j if j < P else 2 * P - 1 - j
  return ([(r, owner(2 * r)) for r in range(P)], [(r, owner(2 * r + 1)) for r in range(P)])


def _all_gather(q, k, v, ids, *, axis_name, args, block_size, backend, platform):
  del block_size, backend, platform
  P = lax.axis_size(axis_name)
  r = lax.axis_index(axis_name)
  B, Tl = q.shape[:2]
  if Tl % 2:
    raise ValueError(f"sp_attention(method='all_gather'): a shard holds T / P = {Tl} tokens; "
                     "the zigzag layout needs an even number (two halves per rank).")
  c = Tl // 2
  doc = _global_docs(ids, axis_name, B, Tl)
  gather = lambda x: lax.all_gather(x, axis_name, axis=1, tiled=True)
  k_all, v_all = gather(k), gather(v)
  perm_a, perm_b = _zigzag_perms(P)
  recv_a = lax.ppermute(q[:, :c], axis_name, perm_a)     # an even chunk
  recv_b = lax.ppermute(q[:, c:], axis_name, perm_b)     # an odd chunk
  even = r % 2 == 0
  # Rank r's slot 0 is chunk r, of r's parity; slot 1 is chunk 2P - 1 - r, of the other.
  slots = (jnp.where(even, recv_a, recv_b), jnp.where(even, recv_b, recv_a))
  chunks = (r, 2 * P - 1 - r)
  blocks = lambda x: jnp.moveaxis(x.reshape(B, 2 * P, c, *x.shape[2:]), 1, 0)
  kb, vb, db = blocks(k_all), blocks(v_all), blocks(doc)
  pb = blocks(_positions(0, 2 * P * c, B))
  outs = []
  for q_c, j in zip(slots, chunks):
    q_pos = _positions(j * c, c, B)
    q_doc = lax.dynamic_slice_in_dim(doc, j * c, c, axis=1)
    qg = group_queries(q_c, k.shape[2])

    def step(stats, blk, qg=qg, q_doc=q_doc, q_pos=q_pos):
      kk, vv, kd, kp = blk
      return fold_if_visible(stats, qg, kk, vv, q_doc, q_pos, kd, kp, scale=args.scale,
                             causal=args.causal, window=args.window), None

    stats, _ = lax.scan(step, init_stats(B, k.shape[2], qg.shape[3], c, q.shape[3], qg,
                                         k_all, v_all, doc, q_doc), (kb, vb, db, pb))
    outs.append(finish(stats, v.dtype))
  back_a = lax.ppermute(jnp.where(even, outs[0], outs[1]), axis_name,
                        [(d, s) for s, d in perm_a])
  back_b = lax.ppermute(jnp.where(even, outs[1], outs[0]), axis_name,
                        [(d, s) for s, d in perm_b])
  return jnp.concatenate([back_a, back_b], axis=1)


def _ring(q, k, v, ids, *, axis_name, args, block_size, backend, platform):
  del block_size, backend, platform
  P = lax.axis_size(axis_name)
  r = lax.axis_index(axis_name)
  B, Tl = q.shape[:2]
  doc = _global_docs(ids, axis_name, B, Tl)
  qg = group_queries(q, k.shape[2])
  q_pos = _positions(r * Tl, Tl, B)
  q_doc = lax.dynamic_slice_in_dim(doc, r * Tl, Tl, axis=1)
  stats = init_stats(B, k.shape[2], qg.shape[3], Tl, q.shape[3], qg, k, v, q_doc)
  kk, vv = k, v
  for s in range(P):
    src = (r - s) % P
    k_pos = _positions(src * Tl, Tl, B)
    k_doc = lax.dynamic_slice_in_dim(doc, src * Tl, Tl, axis=1)
    stats = fold_if_visible(stats, qg, kk, vv, q_doc, q_pos, k_doc, k_pos, scale=args.scale,
                            causal=args.causal, window=args.window)
    if s < P - 1:
      kk, vv = (lax.ppermute(x, axis_name, [(i, (i + 1) % P) for i in range(P)])
                for x in (kk, vv))
  return finish(stats, v.dtype)


def _a2a_bytes(P, n):
  return n * (P - 1) / P


_METHODS = {m.name: m for m in (
    AttentionMethod(
        "ulysses", "all-to-all from sequence to head shards, full attention, and back",
        run=_ulysses,
        bytes_per_rank=lambda P, B, T, H, Hkv, D, it: (
            _a2a_bytes(P, 2 * B * T // P * H * D * it)
            + _a2a_bytes(P, 2 * B * T // P * max(Hkv, P) * D * it) + (P - 1) * B * T // P * 4),
        time=lambda P, B, T, H, Hkv, D, it, alpha, beta: 4 * (P - 1) * alpha + beta * (
            _a2a_bytes(P, 2 * B * T // P * H * D * it)
            + _a2a_bytes(P, 2 * B * T // P * max(Hkv, P) * D * it))),
    AttentionMethod(
        "all_gather", "K and V all-gathered; queries in a zigzag layout (balanced causal work)",
        run=_all_gather,
        bytes_per_rank=lambda P, B, T, H, Hkv, D, it: (
            (P - 1) * 2 * B * T // P * Hkv * D * it + 2 * B * T // P * H * D * it
            + (P - 1) * B * T // P * 4),
        time=lambda P, B, T, H, Hkv, D, it, alpha, beta: (P - 1 + 4) * alpha + beta * (
            (P - 1) * 2 * B * T // P * Hkv * D * it + 2 * B * T // P * H * D * it)),
    AttentionMethod(
        "ring", "K and V blocks around the ring, invisible blocks skipped",
        run=_ring,
        bytes_per_rank=lambda P, B, T, H, Hkv, D, it: (
            (P - 1) * 2 * B * T // P * Hkv * D * it + (P - 1) * B * T // P * 4),
        time=lambda P, B, T, H, Hkv, D, it, alpha, beta: (2 * (P - 1)) * alpha + beta * (
            (P - 1) * 2 * B * T // P * Hkv * D * it)),
)}

ATTENTION_METHODS: Mapping[str, AttentionMethod] = types.MappingProxyType(_METHODS)
"""Every sequence-parallel softmax attention method by name (``method=``)."""


def predicted_time(method: str, P: int, B: int, T: int, H: int, Hkv: int, D: int,
                   itemsize: int = 2, alpha: float = DEFAULT_ALPHA_S,
                   beta: float = DEFAULT_BETA_S_PER_BYTE) -> float:
  """Alpha-beta seconds of one forward's communication (docs/design.md §6's figures)."""
  return 0.0 if P <= 1 else _get(method, "predicted_time").time(P, B, T, H, Hkv, D, itemsize,
                                                                alpha, beta)


def _get(method, name):
  if isinstance(method, str) and method in ATTENTION_METHODS:
    return ATTENTION_METHODS[method]
  raise ValueError(f"{name}: unknown `method` {method!r}; choose one of "
                   f"{', '.join(map(repr, ATTENTION_METHODS))}.")


def _check_method(method, P, H, Hkv, Tl, *, name):
  spec = _get(method, name)
  if spec.name == "ulysses":
    if H % P:
      raise ValueError(f"{name}: method='ulysses' splits the H = {H} query heads over the "
                       f"{P} ranks of the sequence axis: H must be a multiple of P; use "
                       "method='all_gather' or 'ring'.")
    if Hkv % P and P % Hkv:
      raise ValueError(f"{name}: method='ulysses' needs the key heads Hkv = {Hkv} to be a "
                       f"multiple or a divisor of P = {P} (fewer are repeated up to P).")
  if spec.name == "all_gather" and Tl % 2:
    raise ValueError(f"{name}: method='all_gather' needs an even number of tokens per "
                     f"shard (the zigzag layout's two halves), got T / P = {Tl}.")
  return spec


def resolve_backend(backend, method, P, args, dtypes, *, segmented, platform, name):
  """The local attention's backend (:func:`zeco_jax.ops.attention.op.resolve`) for
  ``method`` at ``P`` ranks: the kernels run where a head's whole sequence is local
  (``P == 1``, Ulysses); all-gather and ring fold key blocks in XLA."""
  if P > 1 and _get(method, name).name != "ulysses":
    _checks.check_choice(backend, op.BACKENDS, arg="backend", name=name)
    if backend not in ("auto", "xla"):
      raise ValueError(f"{name}: backend={backend!r} runs a whole local sequence, which "
                       f"method={method!r} does not have (it folds key blocks in XLA); use "
                       "method='ulysses', or backend='xla' (or 'auto').")
    return "xla"
  return op.resolve(backend, platform, dtypes=dtypes, D=args.D, T=args.T * P, causal=args.causal,
                    window=args.window, segmented=segmented, name=name)


def sp_attention_local(q, k, v, *, axis_name, method="ulysses", causal=True, segment_ids=None,
                       scale=None, window=None, backend="auto", block_size: int = 512):
  """:func:`sp_attention` on this rank's shard, inside a shard_map over ``axis_name``:
  q ``[B, T/P, H, D]``, k, v ``[B, T/P, Hkv, D]``, ``segment_ids`` ``[B, T/P]`` (this
  rank's contiguous piece). Returns this rank's output ``[B, T/P, H, D]``. A Pallas
  backend (splash) needs the shard_map's ``check_vma=False``."""
  name = "sp_attention_local"
  args = check_inputs(q, k, v, segment_ids, scale, causal, window, name=name)
  P = lax.axis_size(axis_name)
  spec = _check_method(method, P, args.H, args.Hkv, args.T, name=name)
  platform = target.platform_of(q, k, v)
  backend = resolve_backend(backend, method, P, args, (q.dtype, k.dtype, v.dtype),
                            segmented=segment_ids is not None, platform=platform, name=name)
  if P == 1:
    doc = None if segment_ids is None else document_numbers(segment_ids, args.B, args.T)
    return local_attention(q, k, v, doc, backend=backend, platform=platform, scale=args.scale,
                           causal=causal, window=window, block_size=block_size)
  return spec.run(q, k, v, segment_ids, axis_name=axis_name, args=args, block_size=block_size,
                  backend=backend, platform=platform)


def sp_attention(q, k, v, *, mesh=None, seq_axis="seq", method="ulysses", causal=True,
                 segment_ids=None, scale=None, window=None, batch_axes=None,
                 backend="auto", block_size: int = 512):
  """Softmax attention with T split contiguously over the mesh axis ``seq_axis``.

  Args:
    q: ``[B, T, H, D]``; k, v: ``[B, T, Hkv, D]`` (Hkv divides H), T split over
      ``seq_axis`` like the linear ops' inputs.
    mesh: a ``Mesh`` (default: the one set with ``jax.set_mesh``); one device on
      ``seq_axis`` runs the one-device op (:func:`zeco_jax.ops.attention.op.attention`).
    method: a key of :data:`ATTENTION_METHODS`.
    causal, segment_ids, scale, window: the masks of
      :mod:`zeco_jax.ops.attention.reference`.
    batch_axes: the mesh axis (or axes) B is split over (as the linear ops').
    backend: the local attention's (one rank, Ulysses): a key of
      :data:`zeco_jax.ops.attention.op.BACKENDS`, ``"auto"`` by the mesh's platform
      (cuDNN on GPU, splash on TPU, where they take the inputs). all_gather and ring run
      XLA.
    block_size: keys per block of the XLA form's online softmax.

  Returns:
    ``[B, T, H, D]`` in v's dtype, split like q.
  """
  name = "sp_attention"
  args = check_inputs(q, k, v, segment_ids, scale, causal, window, name=name)
  mesh = shard.mesh_or_context(mesh, name=name)
  P = shard.seq_axis_size(mesh, seq_axis, args.T, name=name)
  _check_method(method, P, args.H, args.Hkv, args.T // P, name=name)
  local_args = dataclasses.replace(args, T=args.T // P)
  backend = resolve_backend(backend, method, P, local_args, (q.dtype, k.dtype, v.dtype),
                            segmented=segment_ids is not None,
                            platform=target.platform_of(q, mesh=mesh), name=name)
  kernel = backend == "splash"        # a Pallas call: manual over every axis, no vma check
  spec = shard.shard_spec(q, mesh=mesh, seq_axis=seq_axis, batch_axes=batch_axes,
                          every_axis=kernel, check_vma=not kernel, name=name)
  options = dict(method=method, causal=causal, scale=args.scale, window=window,
                 backend=backend, block_size=block_size)
  arrays = (q, k, v, segment_ids)
  in_specs = tuple(None if x is None else spec.tokens(x.ndim) for x in arrays)
  return shard.sharded(_local, spec, arrays, in_specs, options=options,
                       out_spec=spec.tokens(4))[0]


def _local(q, k, v, ids, *, axis_name, **options):
  return sp_attention_local(q, k, v, axis_name=axis_name, segment_ids=ids, **options), None


__all__ = ["ATTENTION_METHODS", "AttentionMethod", "predicted_time", "resolve_backend",
           "sp_attention", "sp_attention_local"]
