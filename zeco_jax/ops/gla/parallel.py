"""ZeCO sequence-parallel GLA: ``zeco_gla`` over a mesh axis, and its per-shard body.

Forward on the rank holding tokens ``[pL, (p+1)L)`` (docs/design.md §3):

1. local chunked GLA with a zero initial state -> local outputs and the local final
   state ``S_p``; the segment's transition ``A_p`` (docs/design.md §7): the decay
   ``exp(sum of g over the segment)``, per dimension ``[B, H, K]`` or per head ``[B, H]``,
   or none;
2. the scan of ``(S_p, A_p)`` (``method``, a key of :data:`zeco_jax.sp.scan.SCAN_METHODS`)
   -> ``X_p``, the true state entering the segment;
3. the fix-up (GLA's output correction), one GEMM: ``o += scale * (q * exp(c)) @ X_p``
   with ``c`` the cumulative log-decay from the segment start.

Nothing in step 1's output path depends on ``X_p``, so XLA can run the intra-chunk work
while the All-Scan's point-to-point sends are in flight. A method whose registry entry has
``overlaps_local=False`` (LASP-1's ``"ring"``) runs the local pass from the received state
instead, after it arrives. The backward composes the parts' own backwards
(docs/design.md §5): the fix-up's transpose gives ``dX_loc``, the scan's custom_vjp
runs the reverse All-Scan on it, and the local chunked backward receives the segment's
final-state cotangent ``D_p`` through ``S_p``. Beyond the inputs, only ``X_p`` (one state
per layer, independent of T and P) is saved for it.

Steps 1 and 3 (and the no-overlap path's segment state) are GLA's: they know its
elementwise decay. The scan in step 2 knows only the transition's algebra, so a family
with a dense transition (docs/design.md §7) reuses it with its own steps 1 and 3.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from zeco_jax import _checks
from zeco_jax import segments
from zeco_jax._linalg import HI as _HI
from zeco_jax._linalg import output_precision
from zeco_jax.ops.gla import chunked
from zeco_jax.ops.gla.op import chunk_gla, resolve_backend
from zeco_jax.runtime.target import platform_of
from zeco_jax.sp import scan as _scan
from zeco_jax.sp import shard
from zeco_jax.sp import transitions


def _num_blocks(num_blocks, method, P_size, B, H, K, V, *, name, group_size=None):
  return _scan.resolve_num_blocks(num_blocks, method, P_size, 4 * B * H * K * V, V, name=name,
                                  group_size=group_size)


def default_overlap_pieces(platform: str, method: str, P: int, num_blocks: int, H: int) -> int:
  """How many head groups the local pass is split into by default (docs/design.md §4).

  On TPU with ``"all_scan"``: the largest divisor of H not above the chain's
  ``num_blocks + P - 2`` sends, so each send has a kernel to overlap (XLA's TPU scheduler
  otherwise puts the whole local pass beside one send; measured in
  benchmarks/results/tpu_schedule.md). Elsewhere 1: on an H200 the split costs more than any
  send could hide (16K tokens, H16, K = V = 128: forward + backward 4.1 ms whole, 5.0 ms in 2
  head groups, against about 1 MiB per send; benchmarks/results/gpu_overlap.md).
  """
  if platform != "tpu" or method != "all_scan" or P < 2:
    return 1
  steps = num_blocks + P - 2
  return max(d for d in range(1, H + 1) if H % d == 0 and d <= steps)


def _resolve_pieces(overlap_pieces, method, platform, P, num_blocks, H, *, name) -> int:
  if overlap_pieces is None:
    return default_overlap_pieces(platform, method, P, num_blocks, H)
  return _scan.check_overlap_pieces(overlap_pieces, method, H, name=name)


def _check_args(q, k, v, g, initial_state, scale, chunk_size, method, group_size, *, name):
  """The trace-time checks zeco_gla and zeco_gla_local share."""
  args = _checks.check_gla_inputs(q, k, v, g, initial_state, scale, name=name)
  _checks.check_chunk_size(chunk_size, name=name, multiple_of=chunked.SUB_CHUNK)
  _scan.get_method(method, name=name)
  _scan.check_group_size(group_size, method, name=name)
  return args


def zeco_gla_local(q, k, v, g=None, *, axis_name, method="all_scan", num_blocks=None,
                   chunk_size=64, scale=None, initial_state=None, output_final_state=False,
                   backend="auto", kernel_config=None, overlap_pieces=None,
                   segment_ids=None, group_size=None):
  """The per-shard body of :func:`zeco_gla`, for code already inside its own shard_map.

  Takes this rank's contiguous segment of the sequence (``q, k [B, L, H, K]``, ...) and
  the mesh axis name the sequence is split over; ``initial_state`` is the state before
  the whole sequence (the same on every rank of ``axis_name``). The other arguments are
  as in :func:`zeco_gla`. ``segment_ids`` ``[B, L]`` is this rank's slice of the row's
  ids (docs/design.md §10); whether its first token starts a document is decided against
  the previous rank's last id, fetched with one ``ppermute`` of B int32 that only the
  transition and the fix-up wait for, never the local pass.

  Returns ``(o, state_after_segment)``: o for this segment, and (if
  ``output_final_state``) the float32 state after this rank's last token. On the last
  rank of the axis that is the final state of the whole sequence.
  """
  name = "zeco_gla_local"
  args = _check_args(q, k, v, g, initial_state, scale, chunk_size, method, group_size,
                     name=name)
  platform = platform_of(q)
  backend = resolve_backend(backend, name=name, platform=platform)
  B, L, H, K, V, scale = args.B, args.T, args.H, args.K, args.V, args.scale
  nb = _num_blocks(num_blocks, method, lax.axis_size(axis_name), B, H, K, V, name=name,
                  group_size=group_size)
  scan = functools.partial(_scan.all_scan, axis_name=axis_name, num_blocks=nb,
                           method=method, initial=initial_state, group_size=group_size)
  local = functools.partial(chunk_gla, scale=scale, chunk_size=chunk_size, backend=backend,
                            kernel_config=kernel_config)
  g_local = g_seg = g
  if segment_ids is not None:
    # Resets inside the segment go into the local pass (it starts from zero, so a reset on
    # its first token changes nothing there); the one on the first token, known only after
    # the previous rank's last id arrives, only into the transition and the fix-up.
    segments.check_segment_ids(segment_ids, B, L, name=name)
    q, k, g_local = segments.apply(q, k, g, segment_ids)
    g_seg = segments.reset_first_token(g_local, shard.first_token_starts(segment_ids, axis_name))
  scan = functools.partial(scan, decay=segment_transition(g_seg))

  if _scan.SCAN_METHODS[method].overlaps_local:
    pieces = _resolve_pieces(overlap_pieces, method, platform, lax.axis_size(axis_name), nb, H,
                             name=name)
    if pieces == 1:
      # The local pass from zero (its kernel also gives S_p), the scan beside it.
      o_local, seg_state = local(q, k, v, g_local, output_final_state=True)
      entering, after = scan(seg_state)
    else:
      # S_p first, from one GEMM; the local pass in `pieces` head groups, each released
      # by one step of the All-Scan so that every send has a kernel to hide behind
      # (docs/design.md §4).
      # Every use of a head group reads the same slices (the local pass, S_p, the fix-up),
      # so the backward keeps them once: slicing the kernels' inputs only would keep
      # q, k, v, g twice (the slices for the kernels, the whole for S_p and the fix-up).
      hs = H // pieces
      part = lambda x, i: None if x is None else x[:, :, i * hs:(i + 1) * hs]
      groups = [tuple(part(x, i) for x in (q, k, v, g_local, g_seg)) for i in range(pieces)]
      local_o = lambda *a: local(*a)[0]
      work = [(local_o, grp[:4]) for grp in groups]
      s_p = jnp.concatenate([_segment_state(gk, gv, gg) for _, gk, gv, gg, _ in groups], 1)
      entering, after, outs = scan(s_p, overlap_with=work)
      fix = [_fix_up(gq, gs, entering[:, i * hs:(i + 1) * hs], scale)
             for i, (gq, _, _, _, gs) in enumerate(groups)]
      o = (jnp.concatenate(outs, axis=2).astype(jnp.float32)
           + jnp.concatenate(fix, axis=2)).astype(v.dtype)
      return o, (after if output_final_state else None)
    o = o_local.astype(jnp.float32)
    if not _nothing_enters(axis_name, initial_state):
      o = o + _fix_up(q, g_seg, entering, scale)
    o = o.astype(v.dtype)
  else:
    # No overlap (LASP-1): the segment's state from one GEMM, the scan, then the whole
    # local pass from the received state: compute after receive.
    entering, after = scan(_segment_state(k, v, g_seg))
    o, _ = local(q, k, v, g_seg, initial_state=(
        None if _nothing_enters(axis_name, initial_state) else entering))
  return o, (after if output_final_state else None)


def _nothing_enters(axis_name, initial_state) -> bool:
  """One rank and no initial state: the state entering the segment is zero, and nothing is
  computed from it (a zero constant meeting a dot is what XLA:CPU miscompiles,
  ``docs/xla_cpu_ynn.md``)."""
  return lax.axis_size(axis_name) == 1 and initial_state is None


# --- GLA's side of the transition (docs/design.md §7) --------------------------------------
# The scan sees only the segment's transition; what GLA does with the state it receives
# (the fix-up, the no-overlap path's segment state) uses its elementwise decay and stays
# here. A dense transition's family brings its own versions of these three.

def segment_transition(g) -> transitions.Transition:
  """A_p of a GLA segment: ``exp(sum_t g_t)``, ``[B, H, K]`` per dimension, ``[B, H]``
  per head (kept scalar), or the identity for ``g=None``."""
  if g is None:
    return transitions.Identity()
  total = jnp.exp(jnp.sum(g.astype(jnp.float32), axis=1))
  return transitions.DiagonalDecay(total) if g.ndim == 4 else transitions.ScalarDecay(total)


def _over_keys(factor):
  """A per-token decay factor ready to multiply ``[B, L, H, K]``: scalar decay over K."""
  return factor if factor.ndim == 4 else factor[..., None]


@jax.checkpoint
def _segment_state(k, v, g):
  """S_p from one GEMM: sum_t (k_t * exp(sum of g over (t, L])) v_t^T, each factor <= 1.

  The exponent is a true suffix sum (a reverse cumsum of g shifted by one token), never
  the difference ``c_L - c_t`` of two prefix sums: that difference cancels when the
  prefix sums are large (a -1e4 spike makes every later c about 1e4, whose float32 ulp
  is 1e-3) and loses the small decays after it.

  Rematerialized in the backward: only k, v, g (kept for the local pass anyway) are kept.
  """
  k_decayed = k.astype(jnp.float32)
  if g is not None:
    g = g.astype(jnp.float32)
    later = jnp.concatenate([g[:, 1:], jnp.zeros_like(g[:, :1])], axis=1)   # g_{t+1}
    after_t = chunked.rev_cumsum(later, 1)
    k_decayed = k_decayed * _over_keys(jnp.exp(after_t))
  if k.dtype == jnp.bfloat16 and v.dtype == jnp.bfloat16:
    # bf16 operands with float32 accumulation, as the kernels' own state GEMMs.
    return jnp.einsum("bthk,bthv->bhkv", k_decayed.astype(jnp.bfloat16), v,
                      preferred_element_type=jnp.float32)
  return jnp.einsum("bthk,bthv->bhkv", k_decayed, v.astype(jnp.float32), precision=_HI)


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _fix_up(q, g, entering, scale):
  """GLA's fix-up (its transition's output correction, docs/design.md §3):
  ``scale * (q * exp(c)) @ X_p``, one GEMM, c the log-decay from the segment start
  (exp(c) <= 1).

  Rematerialized in the backward, so that only X_p (one state) is kept for it beyond the
  inputs the local pass keeps anyway. At :func:`zeco_jax._linalg.output_precision` of q's
  dtype: HIGHEST for float32, the default matmul precision for bf16 (the output's own
  rounding is coarser).
  """
  q_decayed = q.astype(jnp.float32)
  if g is not None:
    q_decayed = q_decayed * _over_keys(jnp.exp(jnp.cumsum(g.astype(jnp.float32), axis=1)))
  return scale * jnp.einsum("bthk,bhkv->bthv", q_decayed, entering,
                            precision=output_precision(q.dtype))


def zeco_gla(q, k, v, g=None, *, mesh=None, seq_axis="seq", method="all_scan",
             num_blocks=None, chunk_size=64, scale=None, initial_state=None, segment_ids=None,
             output_final_state=False, backend="auto", kernel_config=None, batch_axes=None,
             overlap_pieces=None, group_size=None):
  """Sequence-parallel GLA over the mesh axis ``seq_axis`` (ZeCO, docs/design.md §3-§5).

  Args:
    q, k: ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]``, ``[B, T, H]`` or None
      (log-decay, <= 0): global arrays whose T axis is (or will be) split contiguously over
      ``seq_axis``. Other mesh axes (say B over ``data``, H over ``tensor``) are left to
      the compiler as they are: the shard_map is manual over ``seq_axis`` only.
    mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes; passing it is enough, no
      ``jax.set_mesh`` needed); default: the mesh set with ``jax.set_mesh``.
    seq_axis: the mesh axis the sequence is split over; T must be divisible by its size.
    method: a key of :data:`zeco_jax.sp.scan.SCAN_METHODS`: ``"all_scan"`` (ZeCO's
      pipelined All-Scan), ``"all_gather"`` (LASP-2), ``"ring"`` (LASP-1, no overlap),
      ``"tree"`` (recursive doubling) or ``"all_scan_2level"`` (All-Scans within groups of
      ranks and across them: at most two states per rank, about 2 sqrt(P) hops instead of
      P; docs/design.md §6); the same names as :func:`zeco_jax.all_scan`'s.
    num_blocks: blocks the state is split into along V for ``"all_scan"`` and
      ``"all_scan_2level"``; must divide V. None picks the alpha-beta optimum (see
      :func:`zeco_jax.sp.scan.default_num_blocks`).
    group_size: ``"all_scan_2level"`` only: ranks per group along the sequence; None picks
      the alpha-beta optimum (:func:`zeco_jax.sp.scan.default_group_size`).
    chunk_size, scale, initial_state, output_final_state, backend, kernel_config: as in
      :func:`zeco_jax.chunk_gla`; ``backend="auto"`` picks by the mesh's platform.
    segment_ids: None or integer ``[B, T]`` (split over ``seq_axis`` like q): packed
      documents, as in :func:`zeco_jax.chunk_gla` (docs/design.md §10). A rank whose
      segment holds a document start passes on only the state since its last start (its
      transition is zero) and applies the received state only before its first start;
      still one state per rank, plus one ppermute of B int32 (the previous rank's last id).
    batch_axes: the mesh axis (or tuple of axes) B is split over, for meshes with Auto
      axes (an Explicit split is read from q's type). Kernels cannot be partitioned by the
      compiler (Mosaic refuses, a GPU kernel would be run on gathered rows), so with the
      Pallas backend the shard_map is manual over every mesh axis: an Auto axis of size > 1
      that is neither ``seq_axis`` nor in ``batch_axes`` (nor an Explicit B / H split) is
      a ValueError. The jnp backend leaves unnamed Auto axes to the compiler.
    overlap_pieces: ``"all_scan"`` only: split the local pass into this many head groups
      (a divisor of H), each released by one send of the All-Scan, with the segment's
      state S_p computed first by one GEMM (docs/design.md §4). None: 
      :func:`default_overlap_pieces` (on TPU as many as there are sends, else 1).

  Returns:
    ``(o, final_state)`` as :func:`zeco_jax.chunk_gla`: o sharded like q over T; the final
    state of the whole sequence (float32, replicated over ``seq_axis``: one all-reduce of
    one state in the forward, none in the backward) or None.
  """
  name = "zeco_gla"
  args = _check_args(q, k, v, g, initial_state, scale, chunk_size, method, group_size,
                     name=name)
  mesh = shard.mesh_or_context(mesh, name=name)
  platform = platform_of(q, mesh=mesh)
  backend = resolve_backend(backend, name=name, platform=platform)
  spec = shard.shard_spec(q, mesh=mesh, seq_axis=seq_axis, batch_axes=batch_axes,
                          every_axis=backend == "pallas", check_vma=backend != "pallas",
                          name=name)
  nb = _num_blocks(num_blocks, method, spec.seq_axis_size, args.B, args.H, args.K, args.V,
                   name=name, group_size=group_size)
  _resolve_pieces(overlap_pieces, method, platform, spec.seq_axis_size, nb, args.H, name=name)
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, args.B, args.T, name=name)
  # Pallas calls (and the Pallas interpreter on CPU) do not carry shard_map's varying-axes
  # types through their bodies, so that check is off around them (check_vma above); JAX
  # then inserts the psums for replicated inputs itself.
  options = dict(method=method, num_blocks=num_blocks, chunk_size=chunk_size,
                 scale=args.scale, output_final_state=output_final_state, backend=backend,
                 kernel_config=kernel_config, overlap_pieces=overlap_pieces,
                 group_size=group_size)
  arrays = (q, k, v, g, segment_ids, initial_state)
  in_specs = tuple(None if x is None else spec.tokens(x.ndim) for x in arrays[:5]) + (
      None if initial_state is None else spec.state(),)
  return shard.sharded(_local, spec, arrays, in_specs, options=options,
                       out_spec=spec.tokens(4), final_state=output_final_state)


def _local(q, k, v, g, ids, h0, **options):
  """:func:`zeco_gla_local` on one shard (``shard.sharded``'s body)."""
  return zeco_gla_local(q, k, v, g, initial_state=h0, segment_ids=ids, **options)
