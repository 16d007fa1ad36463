"""Sequence-parallel Gated DeltaNet: ``zeco_gated_delta_rule`` and its per-shard body.

Same mesh contract as :func:`zeco_jax.zeco_gla` (global arrays whose T axis is split over
``seq_axis``; other mesh axes kept; under jit and grad). On the rank holding a contiguous
segment of the sequence (docs/design.md §9):

1. the local pass from a zero state, widened by K columns that start as the identity
   (:func:`zeco_jax.ops.gated_delta.chunked.chunk_recurrence` with ``augment=True``, or the
   kernels on a state of V + K columns, v as it is). It gives the local outputs, the
   segment's own state ``S_p`` and, from the identity columns, the segment transition
   ``M_p`` (the product of its chunk transitions, ``K x K``) and one fix-up row per token,
   ``R_t = Qeff_n (M_{n-1} ... M_0)``: how token t's output depends on the state entering
   the segment. None of it waits for another rank;
2. the scan of ``(S_p, DenseTransition(M_p))`` over ``seq_axis`` (any method of
   :data:`zeco_jax.SCAN_METHODS`; the All-Scan sends one K x V state per rank and
   ``M_p`` never leaves its rank) -> ``X_p``, the state entering the segment;
3. the fix-up, one GEMM as in GLA: ``o_t += R_t X_p``.

Packed documents (``segment_ids``, docs/design.md §10): the starts inside the segment go
into the local pass as GLA's sentinel log-decay, which zeroes the widened state's identity
columns from the start on (so ``M_p = 0`` and the rows after it are 0); a start on the
segment's first token (known from the previous rank's last id) zeroes ``M_p`` and ``R``.

The backward (``zeco_jax._chunks.local_pass``) does not carry the widened columns: the
rank's outputs and the state it hands on are those of the plain pass entered with X_p, so
after the fix-up's transpose (``dX = R^T dO``) and the scan's reverse (one state per rank
back with the All-Scan; it gives ``dS_p``, the cotangent of the state after the segment),
the plain pass's backward on V columns from X_p gives the inputs' gradients, its chunk
states ``S_n + P_n X_p`` from the widened forward's; with head groups
(``overlap_pieces``) the same per group. ``"ring"`` (LASP-1) has no overlap: it runs the
chunked op from the received state after the scan.
"""
from __future__ import annotations

from zeco_jax import _chunks
from zeco_jax import segments
from zeco_jax.ops._delta_kernels import local_pass_ops, sharded_backend
from zeco_jax.ops.gated_delta.chunked import chunk_terms
from zeco_jax.ops.gated_delta.op import FAMILY, check_inputs, chunk_gated_delta_rule, l2norm
from zeco_jax.sp import scan as _scan
from zeco_jax.sp import shard


def _check_args(q, k, v, g, beta, initial_state, scale, chunk_size, method, group_size, *,
                name):
  args = check_inputs(q, k, v, g, beta, initial_state, scale, name=name,
                      chunk_size=chunk_size)
  _scan.get_method(method, name=name)
  _scan.check_group_size(group_size, method, name=name)
  return args


def zeco_gated_delta_rule_local(q, k, v, g, beta, *, axis_name, method="all_scan",
                                num_blocks=None, chunk_size=64, scale=None,
                                initial_state=None, output_final_state=False,
                                use_qk_l2norm=False, segment_ids=None, group_size=None,
                                backend="auto", kernel_config=None,
                                overlap_pieces=None):
  """The per-shard body of :func:`zeco_gated_delta_rule`, inside the caller's shard_map.

  Takes this rank's contiguous segment (``q, k [B, L, H, K]``, ``g, beta [B, L, H]``)
  and the mesh axis the sequence is split over; ``initial_state`` is the state before the
  whole sequence (the same on every rank). Returns ``(o, state_after_segment)``; on the
  last rank that state is the final state of the sequence. ``segment_ids`` ``[B, L]`` is
  this rank's slice of the packed rows' document ids (docs/design.md §9, §10).
  ``backend``, ``kernel_config``: as in :func:`zeco_jax.chunk_gated_delta_rule`; the
  kernels run on a state of V + K columns (the widened state; v as it is, u zero past its
  columns) in the forward, so a ``kernel_config`` is for that width; the backward runs
  them on V columns with the default configuration, walking the chunk states again from
  the received state (with a ``kernel_config`` whose ``save_states`` is on, and on TPU,
  the forward keeps its widened states and the backward's are formed from them; None
  given keeps none on GPU, unlike the op's default). ``overlap_pieces``: as in
  :func:`zeco_gated_delta_rule`.
  """
  name = "zeco_gated_delta_rule_local"
  args = _check_args(q, k, v, g, beta, initial_state, scale, chunk_size, method, group_size,
                     name=name)
  ops = local_pass_ops(
      backend, kernel_config, q, args, chunk_size, family=FAMILY, name=name,
      terms=chunk_terms, chunked_op=chunk_gated_delta_rule)
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  o, after = _chunks.local_pass(
      q, k, v, g, beta, ops=ops,
      axis_name=axis_name, method=method, num_blocks=num_blocks, group_size=group_size,
      chunk_size=chunk_size, scale=args.scale, initial_state=initial_state,
      segment_ids=segment_ids, name=name,
      overlap_pieces=overlap_pieces)
  return o, (after if output_final_state else None)


def zeco_gated_delta_rule(q, k, v, g, beta, *, mesh=None, seq_axis="seq", method="all_scan",
                          num_blocks=None, chunk_size=64, scale=None, initial_state=None,
                          output_final_state=False, use_qk_l2norm=False, segment_ids=None,
                          group_size=None, backend="auto", kernel_config=None,
                          overlap_pieces=None):
  """Sequence-parallel Gated DeltaNet over the mesh axis ``seq_axis`` (docs/design.md §9).

  Args:
    q, k: ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H]`` (log-decay <= 0); beta
      ``[B, T, H]`` in (0, 1): global arrays whose T axis is split contiguously over
      ``seq_axis`` (T divisible by its size; a segment need not be a multiple of
      ``chunk_size``).
    mesh, seq_axis, method, num_blocks, group_size: as in :func:`zeco_jax.zeco_gla`.
      ``"all_scan"`` sends one K x V state per rank; ``"all_gather"`` gathers every
      (S_p, M_p) pair; ``"tree"`` runs ceil(log2 P) rounds of pairs; ``"ring"`` waits for
      the state; ``"all_scan_2level"`` also chains the K x K prefix transitions inside each
      group (one more K x K per rank).
    chunk_size, scale, initial_state, output_final_state, use_qk_l2norm: as in
      :func:`zeco_jax.chunk_gated_delta_rule`.
    segment_ids: None or integer ``[B, T]`` (split over ``seq_axis`` like q): packed
      documents (docs/design.md §10); a rank holding a document start has transition 0.
    backend, kernel_config: the local pass's implementation, as in
      :func:`zeco_jax.chunk_gated_delta_rule`; ``"auto"`` picks by the mesh's platform.
      With the kernels the shard_map is manual over every mesh axis.
    overlap_pieces: None (one piece) or a divisor of H (``method="all_scan"``, no
      ``num_blocks``): the local pass in that many head groups, each giving the All-Scan
      one block, so the chain starts after the first group's local pass and the later
      groups run while sends are in flight (:func:`zeco_jax.sp.scan.all_scan_of_pieces`).

  Returns:
    ``(o, final_state)``: o sharded like q; the float32 final state replicated over
    ``seq_axis``, or None.
  """
  name = "zeco_gated_delta_rule"
  args = _check_args(q, k, v, g, beta, initial_state, scale, chunk_size, method, group_size,
                     name=name)
  mesh = shard.mesh_or_context(mesh, name=name)
  backend = sharded_backend(backend, kernel_config, q, mesh, args, chunk_size, family=FAMILY,
                            name=name)
  # Pallas calls do not carry shard_map's varying-axes types through their bodies, so that
  # check is off around them (as zeco_gla does).
  spec = shard.shard_spec(q, mesh=mesh, seq_axis=seq_axis, every_axis=backend == "pallas",
                          check_vma=backend != "pallas", name=name)
  _scan.resolve_num_blocks(num_blocks, method, spec.seq_axis_size,
                           4 * args.B * args.H * args.K * args.V, args.V, name=name,
                           group_size=group_size)
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, args.B, args.T, name=name)
  options = dict(method=method, num_blocks=num_blocks, chunk_size=chunk_size,
                 scale=args.scale, output_final_state=output_final_state,
                 use_qk_l2norm=use_qk_l2norm, group_size=group_size, backend=backend,
                 kernel_config=kernel_config, overlap_pieces=overlap_pieces)
  arrays = (q, k, v, g, beta, segment_ids, initial_state)
  in_specs = tuple(None if x is None else spec.tokens(x.ndim) for x in arrays[:6]) + (
      None if initial_state is None else spec.state(),)
  return shard.sharded(_local, spec, arrays, in_specs, options=options,
                       out_spec=spec.tokens(4), final_state=output_final_state)


def _local(q, k, v, g, beta, ids, h0, **options):
  """:func:`zeco_gated_delta_rule_local` on one shard (``shard.sharded``'s body)."""
  return zeco_gated_delta_rule_local(q, k, v, g, beta, initial_state=h0, segment_ids=ids,
                                     **options)
