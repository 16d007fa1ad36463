"""What the delta-rule families share: the chunk layout, exact segment sums of log-decays,
the UT transform, and the recurrence over chunks with dense ``K x K`` transitions and its
custom_vjp (``docs/design.md`` §9, §13).

A delta-rule family (Gated DeltaNet, Kimi Delta Attention) reduces every chunk of C tokens
to four arrays, computed chunk-parallel by the family's own ``terms`` function:
``Qeff [C, K]``, the chunk transition ``M [K, K]``, the chunk's own state ``Sc [K, V]``
and its own outputs ``Oc [C, V]``, such that a chunk entered with state ``Y`` leaves with
``M Y + Sc`` and outputs ``Oc + Qeff Y``. :func:`chunk_recurrence` runs the only
sequential part, that recurrence over chunks, and its backward; what the chunk terms are
(per-head or per-channel decay, which gates) is the family's.

:func:`local_pass` is a delta-rule family's per-shard body over the sequence mesh (the
local pass widened by K identity columns, the scan of its dense transition, the fix-up;
its backward the plain pass's from the received state).

What it does not hold: a family's maths (``ops/<family>/chunked.py``), or GLA's chunked
form (diagonal transitions, ``ops/gla/chunked.py``).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zeco_jax import segments
from zeco_jax._linalg import HI as _HI
from zeco_jax._linalg import output_precision
from zeco_jax._linalg import opaque
from zeco_jax._vma import match_varying
from zeco_jax.runtime.target import platform_of
from zeco_jax.sp import scan as _scan
from zeco_jax.sp import shard
from zeco_jax.sp import transitions


def to_chunks(x, C):
  """``[B, T, H, ...]`` -> float32 ``[B, H, N, C, ...]``, the tail zero-padded to N C."""
  T = x.shape[1]
  pad = -T % C
  x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = jnp.moveaxis(x, 2, 1)                                   # [B, H, T', ...]
  return x.reshape(x.shape[:2] + ((T + pad) // C, C) + x.shape[3:])


def from_chunks(x, T):
  """``[B, H, N, C, D]`` -> ``[B, T, H, D]``."""
  B, H, N, C, D = x.shape
  return jnp.moveaxis(x.reshape(B, H, N * C, D), 1, 2)[:, :T]


def segment_sums(g, channel_axes=0):
  """``out[.., i, j, *ch] = sum_{j < m <= i} g[.., m, *ch]`` for i >= j (an exact sum,
  <= 0), 0 above the diagonal (masked by the caller): the log of the decay from token j
  to token i.

  g is ``[.., C]`` (one decay per head) or ``[.., C, *ch]`` with ``channel_axes`` trailing
  channel axes (a decay per key channel). Each entry is a cumulative sum of g over exactly
  the tokens it spans, never the difference of two cumulative sums, so it keeps float32's
  relative precision whatever the decay (``docs/design.md`` §2). Costs ``C x C`` entries
  per channel: ``[.., C, C, K]`` for a per-channel decay.
  """
  C = g.shape[-1 - channel_axes]
  later = jnp.tril(jnp.ones((C, C), bool), -1)                 # m > j
  later = later.reshape((C, C) + (1,) * channel_axes)
  spread = jnp.where(later, jnp.expand_dims(g, -1 - channel_axes), 0.0)   # [.., m, j, *ch]
  return jnp.cumsum(spread, axis=-2 - channel_axes)             # sum over m <= i


def masked_exp(x, mask):
  """``exp(x)`` where ``mask``, else 0; the masked entries never reach ``exp``."""
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


INVERSE_BLOCK = 16   # the diagonal blocks unit_lower_inverse inverts by substitution


def unit_lower_inverse(A):
  """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]`` (the UT transform).

  Plain XLA ops, no LAPACK: the 16 x 16 diagonal blocks by forward substitution (a loop
  of 16 row steps, all blocks at once), then blocks merged pairwise,
  ``[[X11, 0], [A21, X22]]^{-1} = [[X11, 0], [-X22 A21 X11, X22]]``, as FLA's
  ``solve_tril``. Why not ``jax.scipy.linalg.solve_triangular``: on XLA:CPU (jax 0.10.2)
  its LAPACK call waits on the thread pool that the simulated devices' collectives block,
  so a sequence-parallel program that holds both can deadlock.
  """
  C = A.shape[-1]
  b = INVERSE_BLOCK if C % INVERSE_BLOCK == 0 else C
  eye_b = jnp.eye(b, dtype=A.dtype)
  blocks = jnp.stack([A[..., i:i + b, i:i + b] for i in range(0, C, b)], -3)   # [.., n, b, b]
  def substitute(i, X):
    # Row i of the inverse: e_i - A[i, :i] X[:i]; A is strictly lower and the rows of X
    # from i on are still zero, so the whole row of A may be used.
    row = eye_b[i] - jnp.einsum("...j,...jc->...c", blocks[..., i, :], X, precision=_HI)
    return lax.dynamic_update_index_in_dim(X, row, i, -2)

  diag = lax.fori_loop(0, b, substitute, jnp.zeros_like(blocks))               # [.., n, b, b]
  # (start row, inverse) per diagonal block; neighbours merged until one block is left.
  inverses = [(i * b, x) for i, x in enumerate(jnp.moveaxis(diag, -3, 0))]
  while len(inverses) > 1:
    merged = []
    for (r0, x11), (r1, x22) in zip(inverses[0::2], inverses[1::2]):
      a21 = A[..., r1:r1 + x22.shape[-1], r0:r1]
      x21 = -jnp.einsum("...ij,...jk,...kl->...il", x22, a21, x11, precision=_HI)
      top = jnp.concatenate([x11, jnp.zeros(x11.shape[:-1] + x22.shape[-1:], x11.dtype)], -1)
      merged.append((r0, jnp.concatenate([top, jnp.concatenate([x21, x22], -1)], -2)))
    inverses = merged + inverses[len(merged) * 2:]         # an odd one out waits a level
  return inverses[0][1]


# --- the recurrence over chunks -----------------------------------------------------------

def _terms(terms, q, k, v, g, beta, C, augment):
  """``terms`` on the chunked inputs; ``augment`` widens Sc and Oc by K zero columns (the
  prefix-product columns, which have no local part)."""
  Qeff, M, Sc, Oc = terms(*(to_chunks(x, C) for x in (q, k, v, g, beta)))
  if augment:
    K = M.shape[-1]
    Sc = jnp.concatenate([Sc, jnp.zeros(Sc.shape[:-1] + (K,), Sc.dtype)], -1)
    Oc = jnp.concatenate([Oc, jnp.zeros(Oc.shape[:-1] + (K,), Oc.dtype)], -1)
  return Qeff, M, Sc, Oc


def _initial(h0, M, Sc, augment):
  """The state entering chunk 0: h0 (zeros if None), widened by the identity if augment."""
  B, H, _, K, Wd = Sc.shape
  V = Wd - K if augment else Wd
  Y0 = jnp.zeros((B, H, K, V), jnp.float32) if h0 is None else h0.astype(jnp.float32)
  if augment:
    Y0 = jnp.concatenate([Y0, jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))],
                         -1)
  # opaque: a zero (or identity) Y0 must not reach a dot as a constant when one chunk
  # inlines the scan (XLA:CPU miscompiles that; see zeco_jax._linalg.opaque).
  return opaque(match_varying(Y0, M, Sc))


def _states(M, Sc, Y0):
  """The state entering every chunk, ``[B, H, N, K, W]``, and the final state."""
  def step(Y, xs):
    M_n, Sc_n = xs
    return jnp.einsum("bhij,bhjw->bhiw", M_n, Y, precision=_HI) + Sc_n, Y

  final, Ys = lax.scan(step, Y0, (jnp.moveaxis(M, 2, 0), jnp.moveaxis(Sc, 2, 0)))
  return jnp.moveaxis(Ys, 0, 2), final


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 7, 8))
def chunk_recurrence(terms, q, k, v, g, beta, h0, C, augment):
  """Outputs ``[B, T, H, W]`` float32 and final state ``[B, H, K, W]`` of a chunked
  delta-rule form.

  ``terms(q, k, v, g, beta)`` takes the float32 chunks ``[B, H, N, C, ...]`` (the tail
  padded with zeros: k = q = v = 0, beta = 0, g = 0, identity transitions) and returns
  ``(Qeff [.., C, K], M [.., K, K], Sc [.., K, V], Oc [.., C, V])`` per chunk; it is
  differentiated by JAX in the backward, recomputed from the inputs.

  ``W = V``; with ``augment`` ``W = V + K``: the extra columns start as the identity, so
  they carry the prefix products of the chunk transitions. Then ``out[..., V:]`` holds the
  rows ``Qeff_n (M_{n-1} ... M_0)`` that map a state entering the sequence to each
  token's output, and ``final[..., V:]`` the product of every chunk transition.

  Memory: the custom_vjp keeps the inputs and the state entering each chunk
  (``[B, H, N, K, W]``), never a state per token.
  """
  return _forward(terms, q, k, v, g, beta, h0, C, augment)[0]


def _forward(terms, q, k, v, g, beta, h0, C, augment):
  Qeff, M, Sc, Oc = _terms(terms, q, k, v, g, beta, C, augment)
  Ys, final = _states(M, Sc, _initial(h0, M, Sc, augment))
  out = Oc + jnp.einsum("bhnck,bhnkw->bhncw", Qeff, Ys, precision=_HI)
  return (from_chunks(out, q.shape[1]), final), Ys


def _chunk_recurrence_fwd(terms, q, k, v, g, beta, h0, C, augment):
  outs, Ys = _forward(terms, q, k, v, g, beta, h0, C, augment)
  return outs, (q, k, v, g, beta, h0, Ys)        # the inputs and one state per chunk


def _chunk_recurrence_bwd(terms, C, augment, residuals, cotangents):
  """The reverse recurrence over chunks, then the chunk terms' own vjp (recomputed).

  With dY the cotangent of the state leaving chunk n: dM_n = dY Y_n^T, dSc_n = dY,
  dQeff_n = dOut_n Y_n^T, and the state entering n gets M_n^T dY + Qeff_n^T dOut_n.
  """
  q, k, v, g, beta, h0, Ys = residuals
  d_out, d_final = cotangents
  (Qeff, M, Sc, Oc), terms_vjp = jax.vjp(
      lambda *a: _terms(terms, *a, C, augment), q, k, v, g, beta)
  d_out = to_chunks(d_out, C)                                 # [B, H, N, C, W]
  G = jnp.einsum("bhnck,bhncw->bhnkw", Qeff, d_out, precision=_HI)

  def step(dY, xs):
    M_n, G_n = xs
    return jnp.einsum("bhji,bhjw->bhiw", M_n, dY, precision=_HI) + G_n, dY

  d_final = opaque(match_varying(d_final.astype(jnp.float32), M, G))
  dY0, dYs = lax.scan(step, d_final, (jnp.moveaxis(M, 2, 0), jnp.moveaxis(G, 2, 0)),
                      reverse=True)
  dYs = jnp.moveaxis(dYs, 0, 2)                               # dY leaving each chunk
  dM = jnp.einsum("bhniw,bhnjw->bhnij", dYs, Ys, precision=_HI)
  dQeff = jnp.einsum("bhncw,bhnkw->bhnck", d_out, Ys, precision=_HI)
  dq, dk, dv, dg, dbeta = terms_vjp((dQeff, dM, dYs, d_out))
  dh0 = None if h0 is None else dY0[..., :h0.shape[-1]].astype(h0.dtype)
  return dq, dk, dv, dg, dbeta, dh0


chunk_recurrence.defvjp(_chunk_recurrence_fwd, _chunk_recurrence_bwd)


class LocalPass(NamedTuple):
  """A delta-rule backend's local pass, bound to its scale and chunk size
  (``zeco_jax.ops._delta_kernels.local_pass_ops`` builds one for the jnp path or the
  kernels).

  * ``widened(q, k, v, g, beta)``: ``(out [B, L, H, V + K], final [B, H, K, V + K])`` of
    the chunked form widened by K identity columns, from a zero state
    (:func:`chunk_recurrence` with ``augment``); a custom_vjp of its own.
  * ``widened_res``: the same, ``((out, final), states)`` with the state entering every
    chunk ``[B, H, N, K, V + K]`` (what the backward below is given), or None where the
    backend's backward walks the states again (the kernels' default).
  * ``backward(q, k, v, g, beta, h0, states, do, dht)``: ``(dq, dk, dv, dg, dbeta)`` of
    the plain pass (V columns) entered with ``h0`` ``[B, H, K, V]`` whose chunk states
    are ``states`` ``[B, H, N, K, V]`` (None: walked again from ``h0``), for the
    cotangents of its outputs and final state.
  * ``chunked_op``: the family's op (LASP-1's ``"ring"`` runs it from the received state).
  """
  widened: Callable
  widened_res: Callable
  backward: Callable
  chunked_op: Callable


def jnp_local_pass(terms, C, chunked_op) -> LocalPass:
  """:class:`LocalPass` on the jnp chunked form; ``terms`` is the family's chunk terms
  with its scale bound."""
  def backward(q, k, v, g, beta, h0, states, do, dht):
    return _chunk_recurrence_bwd(terms, C, False, (q, k, v, g, beta, h0, states),
                                 (do, dht))[:5]

  return LocalPass(
      widened=lambda q, k, v, g, beta: chunk_recurrence(terms, q, k, v, g, beta, None, C, True),
      widened_res=lambda q, k, v, g, beta: _forward(terms, q, k, v, g, beta, None, C, True),
      backward=backward, chunked_op=chunked_op)


def local_pass(q, k, v, g, beta, *, ops, axis_name, method, num_blocks, group_size,
               chunk_size, scale, initial_state, segment_ids, name, overlap_pieces=None):
  """A delta-rule family's per-shard body (docs/design.md §9): ``(o, state after the
  segment)`` on this rank's checked, l2-normalised segment; ``ops`` a :class:`LocalPass`.

  1. ``ops.widened``: the family's chunked form widened by K identity columns, from a zero
     state: the local outputs, the segment's own state S_p, its transition M_p and the
     fix-up rows R. Nothing waits for another rank.
  2. The scan of ``(S_p, DenseTransition(M_p))`` over ``axis_name`` -> X_p.
  3. The fix-up ``o += R X_p``, one GEMM. A method without overlap (LASP-1's ``"ring"``)
     instead runs ``ops.chunked_op`` from the received state.

  The backward (:func:`_segment`) runs the scan's reverse and then the plain pass's
  backward on V columns, entered with X_p: the gradient of the rank's outputs and of the
  state it hands on is that of the op started from X_p, so the widened columns are not
  carried through the backward.

  Packed documents: the starts inside the segment go into the local pass; a start on the
  first token (one ppermute of the previous rank's last id) zeroes M_p and R only.

  ``overlap_pieces`` > 1 (``"all_scan"`` over P >= 2 ranks; None:
  :func:`default_overlap_pieces`, more than 1 on TPU only): steps 1 and 2 interleaved by
  head groups (:func:`zeco_jax.sp.scan.all_scan_of_pieces`): the local pass of group j
  gives the chain's block j, so the chain starts after the first group's local pass and
  the later groups' run while sends are in flight; the fix-up per group. Its backward
  (:func:`_segment_in_pieces`) is the one above per group.
  """
  B, L, H, K = q.shape
  V = v.shape[-1]
  first_starts = None
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, B, L, name=name)
    q, k, g = segments.apply(q, k, g, segment_ids)
    first_starts = shard.first_token_starts(segment_ids, axis_name)
  overlap_pieces = resolve_overlap_pieces(overlap_pieces, method, num_blocks, H,
                                          platform=platform_of(q), P=lax.axis_size(axis_name),
                                          name=name)
  if overlap_pieces > 1 and lax.axis_size(axis_name) > 1:
    return _segment_in_pieces(ops, axis_name, overlap_pieces, q, k, v, g, beta, initial_state,
                              first_starts)
  nb = _scan.resolve_num_blocks(num_blocks, method, lax.axis_size(axis_name),
                                4 * B * H * K * V, V, name=name, group_size=group_size)
  scan = functools.partial(_dense_scan, axis_name=axis_name, num_blocks=nb, method=method,
                           group_size=group_size)
  if _scan.SCAN_METHODS[method].overlaps_local:
    return _segment(ops, scan, q, k, v, g, beta, initial_state, first_starts)
  # LASP-1: compute after receive, the whole chunked pass from the received state.
  _, (seg_state, seg_matrix, _) = _widened_parts(ops.widened(q, k, v, g, beta), V,
                                                 first_starts)
  entering, after = scan(seg_state, seg_matrix, initial_state)
  if first_starts is not None:
    g = segments.reset_first_token(g, first_starts)
  o, _ = ops.chunked_op(q, k, v, g, beta, scale=scale, initial_state=entering,
                        chunk_size=chunk_size)
  return o, after


def _dense_scan(seg_state, seg_matrix, initial, *, axis_name, num_blocks, method,
                group_size):
  """``(X_p, state after the segment)``: the scan of ``(S_p, DenseTransition(M_p))``."""
  return _scan.all_scan(seg_state, transitions.DenseTransition(seg_matrix), axis_name,
                        num_blocks=num_blocks, method=method, initial=initial,
                        group_size=group_size)


def _widened_parts(widened, V, first_starts):
  """``(o_local, (S_p, M_p, R))`` from the widened pass's ``(out, final)``; a start on
  the segment's first token zeroes M_p and R."""
  out, end = widened
  o_local, seg_state, seg_matrix, rows = out[..., :V], end[..., :V], end[..., V:], out[..., V:]
  if first_starts is not None:
    seg_matrix = jnp.where(first_starts[:, None, None, None], 0.0, seg_matrix)
    rows = jnp.where(first_starts[:, None, None, None], 0.0, rows)
  return o_local, (seg_state, seg_matrix, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _segment(ops, scan, q, k, v, g, beta, h0, first_starts):
  """Steps 1-3 of :func:`local_pass` (a method that overlaps): ``(o, state after the
  segment)``. A custom_vjp (:func:`_segment_bwd`); without differentiation this is the
  whole of it."""
  V = v.shape[-1]
  o_local, (seg_state, seg_matrix, rows) = _widened_parts(ops.widened(q, k, v, g, beta), V,
                                                          first_starts)
  entering, after = scan(seg_state, seg_matrix, h0)
  return (o_local + fix_up(rows, entering, v.dtype)).astype(v.dtype), after


def _segment_fwd(ops, scan, q, k, v, g, beta, h0, first_starts):
  V = v.shape[-1]
  widened, states = ops.widened_res(q, k, v, g, beta)
  o_local, (seg_state, seg_matrix, rows) = _widened_parts(widened, V, first_starts)
  if h0 is None:
    (entering, after), scan_vjp = jax.vjp(lambda s, m: scan(s, m, None), seg_state,
                                          seg_matrix)
  else:
    (entering, after), scan_vjp = jax.vjp(scan, seg_state, seg_matrix, h0)
  o = (o_local + fix_up(rows, entering, v.dtype)).astype(v.dtype)
  return (o, after), (q, k, v, g, beta, states, rows, entering, first_starts, scan_vjp)


def _segment_bwd(ops, scan, residuals, cotangents):
  """The backward without the widened columns.

  The rank's outputs and the state it hands on are those of the plain pass entered with
  X_p (``o = o_local + R X_p``, ``S_p + M_p X_p``), and M_p reaches the rest of the
  sequence only through that state. So: the fix-up's transpose ``R^T dO`` is X_p's local
  cotangent; the scan's reverse (its vjp kept from the forward: the reverse chain, one
  state per rank; the scan methods hold custom_vjps, so no linear transpose) gives
  ``dS_p``, the whole cotangent of the state after the segment, and the initial state's;
  and the plain pass's backward from X_p, with ``dO`` and ``dS_p``, gives the inputs'
  gradients (:func:`_plain_grads`).
  """
  q, k, v, g, beta, states, rows, entering, first_starts, scan_vjp = residuals
  do, d_after = cotangents
  d_scan = scan_vjp((_fix_up_transpose(rows, entering, do, v.dtype), d_after))
  dh0 = d_scan[2] if len(d_scan) > 2 else None
  grads = _plain_grads(ops, (q, k, v, g, beta), states, entering, first_starts, do, d_scan[0])
  return (*grads, dh0, None)


def _fix_up_transpose(rows, entering, do, dtype):
  """``R^T dO``: the cotangent of the received state through the fix-up."""
  _, fix_up_vjp = jax.vjp(lambda x: fix_up(rows, x, dtype), entering)
  return fix_up_vjp(do.astype(jnp.float32))[0]


def _plain_grads(ops, inputs, states, entering, first_starts, do, d_state):
  """``(dq, dk, dv, dg, dbeta)`` of the plain pass entered with the received state (zero
  where the segment's first token starts a document), for the cotangents of its outputs
  and of the state after it. Its chunk states are the widened forward's applied to that
  state: ``S_n + P_n X_p``, P_n (their last K columns) the product of the chunk
  transitions before chunk n, formed at :func:`output_precision` of the states' dtype
  (kept in bf16, the product's rounding is below theirs; at HIGHEST it was float32 FMAs
  on a GPU); with ``states`` None the backend walks them again from that state."""
  V = inputs[2].shape[-1]
  x = entering
  if first_starts is not None:
    x = jnp.where(first_starts[:, None, None, None], 0.0, x)
  if states is None:
    return ops.backward(*inputs, x, None, do, d_state)
  plain = (states[..., :V].astype(jnp.float32)
           + jnp.einsum("bhnkj,bhjv->bhnkv", states[..., V:].astype(jnp.float32), x,
                        precision=output_precision(states.dtype))).astype(states.dtype)
  return ops.backward(*inputs, x, plain, do, d_state)


_segment.defvjp(_segment_fwd, _segment_bwd)


def fix_up(rows, entering, dtype):
  """``R X`` in float32 (``rows [B, T, H, K]``, the state entering the segment ``[B, H,
  K, V]``) at :func:`zeco_jax._linalg.output_precision` of the input dtype: HIGHEST for
  float32, else the default, so that for bf16 inputs the GEMM and the two of its backward
  are not float32 FMAs (one rank's local pass at 2048 tokens, H16, K = V = 128: three GEMMs
  of 2048 x 128 x 128 per head)."""
  return jnp.einsum("bthk,bhkv->bthv", rows, entering, precision=output_precision(dtype),
                    preferred_element_type=jnp.float32)


def default_overlap_pieces(platform: str, method: str, P: int, H: int) -> int:
  """How many head groups a delta-rule local pass is split into by default.

  On TPU with ``"all_scan"`` over P >= 2 ranks: the largest divisor of H not above P, so
  the chain starts after 1/G of the local pass and G - 1 of its G + P - 2 forward sends
  have a group's kernel beside them (libtpu's schedule at v5p P = 8, H16:
  ``benchmarks/results/tpu_schedule.md``). Elsewhere 1: on a GPU the kernels are launched
  on every head at once (a head group leaves SMs idle), not measured split.
  """
  if platform != "tpu" or method != "all_scan" or P < 2:
    return 1
  return max(d for d in range(1, H + 1) if H % d == 0 and d <= P)


def resolve_overlap_pieces(overlap_pieces, method, num_blocks, H, *, platform, P,
                           name) -> int:
  """``overlap_pieces`` checked: None -> :func:`default_overlap_pieces` (1 when
  ``num_blocks`` is given); else a positive int dividing H, and > 1 only with
  ``method="all_scan"`` and no ``num_blocks`` > 1 (the head groups are the blocks)."""
  if overlap_pieces is None:
    if num_blocks not in (None, 1):
      return 1
    return default_overlap_pieces(platform, method, P, H)
  _scan.check_overlap_pieces(overlap_pieces, method, H, name=name)
  if overlap_pieces > 1 and num_blocks not in (None, 1):
    raise ValueError(f"{name}: `overlap_pieces`={overlap_pieces} makes the head groups the "
                     f"All-Scan's blocks; `num_blocks`={num_blocks!r} would split them again. "
                     "Pass num_blocks=None (or 1), or overlap_pieces=None.")
  return overlap_pieces


def _local_pass_in_pieces(ops, axis_name, pieces, q, k, v, g, beta, initial_state,
                          first_starts, keep):
  """:func:`local_pass` with the All-Scan's blocks the ``pieces`` head groups, each
  produced by its group's widened local pass (:func:`zeco_jax.sp.scan.all_scan_of_pieces`):
  ``((o, state after the segment), residuals)``; with ``keep`` the groups' passes keep
  their chunk states and ``residuals`` is what :func:`_segment_in_pieces_bwd` takes, else
  None."""
  H, V = q.shape[2], v.shape[-1]
  hs = H // pieces
  heads = lambda x, i, axis: lax.slice_in_dim(x, i * hs, (i + 1) * hs, axis=axis)
  inputs = [tuple(heads(x, i, 2) for x in (q, k, v, g, beta)) for i in range(pieces)]

  def piece(*x):
    widened, states = ops.widened_res(*x) if keep else (ops.widened(*x), None)
    o_local, (seg_state, seg_matrix, rows) = _widened_parts(widened, V, first_starts)
    return (seg_state, transitions.DenseTransition(seg_matrix),
            (o_local, rows, states, seg_matrix))

  initial = None if initial_state is None else [heads(initial_state, i, 1)
                                                for i in range(pieces)]
  entering, after, extras = _scan.all_scan_of_pieces(
      [(piece, x) for x in inputs], axis_name, initial=initial)
  o = jnp.concatenate([o_local + fix_up(rows, x, v.dtype)
                       for (o_local, rows, _, _), x in zip(extras, entering)], axis=2)
  outputs = (o.astype(v.dtype), jnp.concatenate(after, axis=1))
  if not keep:
    return outputs, None
  kept = [(rows, states, matrix) for _, rows, states, matrix in extras]
  return outputs, (inputs, kept, entering, initial, first_starts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _segment_in_pieces(ops, axis_name, pieces, q, k, v, g, beta, h0, first_starts):
  """:func:`_local_pass_in_pieces`, with the backward of :func:`_segment_bwd` per head
  group (:func:`_segment_in_pieces_bwd`)."""
  return _local_pass_in_pieces(ops, axis_name, pieces, q, k, v, g, beta, h0, first_starts,
                               keep=False)[0]


def _segment_in_pieces_fwd(ops, axis_name, pieces, q, k, v, g, beta, h0, first_starts):
  return _local_pass_in_pieces(ops, axis_name, pieces, q, k, v, g, beta, h0, first_starts,
                               keep=True)


def _segment_in_pieces_bwd(ops, axis_name, pieces, residuals, cotangents):
  """:func:`_segment_bwd` per head group: the chain's transpose for the groups' fixed
  transitions (:func:`zeco_jax.sp.scan.all_scan_of_pieces_transpose`: one block per rank
  and send back) gives each group's ``dS_j``, and group j's plain backward runs beside a
  send of it as soon as ``dS_j`` is whole, as the forward's groups do."""
  inputs, kept, entering, initial, first_starts = residuals
  do, d_after = cotangents
  hs = d_after.shape[1] // pieces
  dtype = inputs[0][2].dtype
  dos = [lax.slice_in_dim(do, i * hs, (i + 1) * hs, axis=2) for i in range(pieces)]
  d_entering = [_fix_up_transpose(rows, x, d, dtype)
                for (rows, _, _), x, d in zip(kept, entering, dos)]
  d_afters = [lax.slice_in_dim(d_after, i * hs, (i + 1) * hs, axis=1) for i in range(pieces)]

  def group(d_state, inputs, states, entering, do):
    return _plain_grads(ops, inputs, states, entering, first_starts, do, d_state)

  work = [(group, (inputs[i], kept[i][1], entering[i], dos[i])) for i in range(pieces)]
  _, d_initial, grads = _scan.all_scan_of_pieces_transpose(
      [transitions.DenseTransition(m) for _, _, m in kept], d_entering, d_afters, axis_name,
      initial_like=initial, pieces=work)
  grads = [jnp.concatenate(parts, axis=2) for parts in zip(*grads)]
  dh0 = None if d_initial is None else jnp.concatenate(d_initial, axis=1)
  return (*grads, dh0, None)


_segment_in_pieces.defvjp(_segment_in_pieces_fwd, _segment_in_pieces_bwd)
