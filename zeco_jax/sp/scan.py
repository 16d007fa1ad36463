"""The exclusive scan of linear-attention states over a mesh axis, and its methods.

Call :func:`all_scan` inside ``shard_map``. Rank p holds a state ``S_p`` ``[..., K, V]``
and a transition ``A_p`` (:mod:`zeco_jax.sp.transitions`: a decay per dimension or per head,
none, or a dense ``K x K`` matrix); the result is the state entering rank p,

    X_0 = initial (zeros by default),   X_{p+1} = A_p(X_p) + S_p,

and the inclusive value ``A_p(X_p) + S_p`` (the state after rank p; on the last rank, the
state after the whole sequence). ``reverse=True`` runs the chain from the last rank to the
first (the backward pass's direction).

Every method is one entry of :data:`SCAN_METHODS` (docs/design.md §6): its run function,
its alpha-beta time model, its bytes per rank, whether it splits the state into blocks
and whether the local pass may overlap it. ``all_scan(method=)``, ``zeco_gla(method=)``
and the configs' ``seq_method`` take its keys:

* ``"all_scan"``: ZeCO's All-Scan (docs/design.md §4). The state is split into
  ``num_blocks`` blocks along V; an unrolled chain of ``num_blocks + P - 2`` ``ppermute``
  steps whose perms list only the pairs that carry a real block, so every rank sends
  exactly one state. Its backward (a custom_vjp) is the reverse All-Scan of
  docs/design.md §5: the same chain run the other way over the cotangents under the
  transposed transitions, keeping only ``X_p`` (and ``A_p``) from the forward.
* ``"all_gather"``: LASP-2. All-gather every ``(S_p, A_p)`` and fold locally.
* ``"ring"``: LASP-1: the serial chain (``"all_scan"`` with one block), and the local
  pass waits for the state (``overlaps_local=False``).
* ``"tree"``: recursive doubling on ``(A, S)`` pairs (as MaxText), ceil(log2 P) rounds
  plus a one-hop shift to make it exclusive; any P.

All are exact and differentiable; the tree and all-gather are differentiated by JAX (the
transpose of a ``ppermute`` is the reverse ``ppermute``; of an all-gather, a
reduce-scatter). Every method uses only the :class:`~zeco_jax.transitions.Transition`
operations, so a new transition needs no change here. What overlaps with the scan is up
to the caller (see :func:`zeco_jax.zeco_gla_local`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from zeco_jax._linalg import opaque
from zeco_jax._vma import make_varying, match_varying
from zeco_jax.sp.transitions import as_transition

# Alpha-beta model defaults (docs/design.md §6): a point-to-point hop's latency and the
# inverse link bandwidth. Rough GPU figures (NVLink-class link, ~10 us per collective
# launch-and-sync); pass your own for other fabrics.
DEFAULT_ALPHA_S = 10e-6
DEFAULT_BETA_S_PER_BYTE = 1.0 / 100e9


@dataclasses.dataclass(frozen=True)
class ScanMethod:
  """One way to compute the exclusive scan, defined once (docs/design.md §6).

  Attributes:
    name: the key in :data:`SCAN_METHODS`, the value of ``method=``.
    summary: one line saying what it is.
    run: ``run(S, A, h0, axis_name, num_blocks, reverse) -> exclusive`` inside shard_map
      with P >= 2; ``S`` float32 ``[..., K, V]``, ``A`` a float32 transition, ``h0``
      broadcastable to ``S``.
    time: ``time(P, num_blocks, M, m_A, alpha, beta)``: seconds for one scan, with ``M``
      the state's bytes and ``m_A`` the transition's.
    bytes_per_rank: ``bytes_per_rank(P, M, m_A)``: the most bytes one rank sends.
    blocked: the state is split into ``num_blocks`` along V (else ``num_blocks`` is 1).
    overlaps_local: the local pass may run while the state is in flight (False: the
      local pass starts from the received state, so the scan's time is exposed).
  """
  name: str
  summary: str
  run: Callable
  time: Callable[..., float]
  bytes_per_rank: Callable[..., float]
  blocked: bool = False
  overlaps_local: bool = True


def _rounds(P):
  return math.ceil(math.log2(P))


def _run_chain(S, A, h0, axis_name, num_blocks, reverse, work=()):
  """The pipelined chain. Every operand gets the same varying axes, so the custom_vjp's
  cotangents match (autodiff of the cast adds the psum a replicated initial state needs).
  With ``work`` (see :func:`all_scan`'s ``overlap_with``) returns ``(X, results)``.""" 
  h0 = jnp.broadcast_to(h0, S.shape)
  leaves = (S, h0, *jax.tree.leaves(A))
  S, h0 = (match_varying(x, *leaves) for x in (S, h0))
  A = jax.tree.map(lambda x: match_varying(x, *leaves), A)
  fns = tuple(fn for fn, _ in work)
  X, results = _pipeline(S, A, h0, tuple(args for _, args in work), axis_name, num_blocks,
                         reverse, fns)
  return (X, results) if work else X


def _run_ring(S, A, h0, axis_name, num_blocks, reverse):
  del num_blocks
  return _run_chain(S, A, h0, axis_name, 1, reverse)


def _run_tree(S, A, h0, axis_name, num_blocks, reverse):
  del num_blocks
  return _tree_scan(S, A, h0, axis_name, reverse)


def _run_all_gather(S, A, h0, axis_name, num_blocks, reverse):
  del num_blocks
  return _all_gather_scan(S, A, h0, axis_name, reverse)


_METHODS = {m.name: m for m in (
    ScanMethod(
        "all_scan", "ZeCO's All-Scan: pipelined chain over num_blocks blocks along V",
        run=_run_chain,
        time=lambda P, nb, M, m_A, alpha, beta: (nb + P - 2) * (alpha + beta * M / nb),
        bytes_per_rank=lambda P, M, m_A: M, blocked=True),
    ScanMethod(
        "all_gather", "LASP-2: all-gather every (S_p, A_p), fold locally",
        run=_run_all_gather,
        time=lambda P, nb, M, m_A, alpha, beta: (P - 1) * (alpha + beta * (M + m_A)),
        bytes_per_rank=lambda P, M, m_A: (P - 1) * (M + m_A)),
    ScanMethod(
        "ring", "LASP-1: the serial chain, one block; the local pass waits for the state",
        run=_run_ring,
        time=lambda P, nb, M, m_A, alpha, beta: (P - 1) * (alpha + beta * M),
        bytes_per_rank=lambda P, M, m_A: M, overlaps_local=False),
    ScanMethod(
        "tree", "recursive doubling on (A, S) pairs, then a one-hop shift",
        run=_run_tree,
        time=lambda P, nb, M, m_A, alpha, beta: (
            (_rounds(P) + 1) * alpha + beta * (_rounds(P) * (M + m_A) + M)),
        bytes_per_rank=lambda P, M, m_A: _rounds(P) * (M + m_A) + M),
)}

SCAN_METHODS: Mapping[str, ScanMethod] = types.MappingProxyType(_METHODS)
"""Every scan method by name: the one vocabulary of ``method=`` and ``seq_method``."""

_RENAMED = {"pipeline": "all_scan", "serial": "ring"}    # names before the one registry


def method_names() -> tuple:
  return tuple(SCAN_METHODS)


def get_method(method, *, name: str = "all_scan", arg: str = "method") -> ScanMethod:
  """The registry entry for ``method``; ValueError naming the argument and the choices."""
  if isinstance(method, str) and method in SCAN_METHODS:
    return SCAN_METHODS[method]
  hint = f" ({method!r} is now {_RENAMED[method]!r})" if method in _RENAMED else ""
  raise ValueError(f"{name}: unknown `{arg}` {method!r}; choose one of "
                   f"{', '.join(map(repr, SCAN_METHODS))}{hint}.")


def predicted_time(P: int, num_blocks: int, state_bytes: float,
                   alpha: float = DEFAULT_ALPHA_S, beta: float = DEFAULT_BETA_S_PER_BYTE,
                   method: str = "all_scan", transition_bytes: float = 0.0) -> float:
  """Alpha-beta model of one exclusive scan, in seconds (docs/design.md §6)."""
  spec = get_method(method, name="predicted_time")
  if P <= 1:
    return 0.0
  nb = num_blocks if spec.blocked else 1
  return spec.time(P, nb, state_bytes, transition_bytes, alpha, beta)


def bytes_sent_per_rank(P: int, state_bytes: float, method: str,
                        transition_bytes: float = 0.0) -> float:
  """Bytes each rank puts on the wire for one scan, as the model counts them."""
  spec = get_method(method, name="bytes_sent_per_rank")
  return 0.0 if P <= 1 else spec.bytes_per_rank(P, state_bytes, transition_bytes)


def default_num_blocks(P: int, state_bytes: float, V: int,
                       alpha: float = DEFAULT_ALPHA_S,
                       beta: float = DEFAULT_BETA_S_PER_BYTE, method: str = "all_scan") -> int:
  """For a blocked method, the divisor of V nearest the All-Scan's optimum
  sqrt((P - 2) beta M / alpha); 1 for the others."""
  if not get_method(method, name="default_num_blocks").blocked:
    return 1
  best = math.sqrt(max(P - 2, 0) * beta * state_bytes / alpha) if P > 2 else 1.0
  divisors = [d for d in range(1, V + 1) if V % d == 0]
  return min(divisors, key=lambda d: (abs(math.log(d) - math.log(max(best, 1.0))), d))


def check_num_blocks(num_blocks, V, *, name: str, none_ok: bool = False) -> None:
  if (not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1
      or V % num_blocks):
    raise ValueError(f"{name}: `num_blocks` must be a positive int dividing the value dim "
                     f"V = {V} (the state is split along V), got {num_blocks!r}. Try one of "
                     f"{[d for d in range(1, V + 1) if V % d == 0]}"
                     + (" or None for the default." if none_ok else "."))


def resolve_num_blocks(num_blocks, method, P: int, state_bytes: float, V: int, *,
                       name: str) -> int:
  """``num_blocks`` for ``method`` over ``P`` ranks: 1 for an unblocked method, the
  alpha-beta optimum (:func:`default_num_blocks`) for None, else ``num_blocks`` checked."""
  if not SCAN_METHODS[method].blocked:
    return 1
  if num_blocks is None:
    return default_num_blocks(P, state_bytes, V, method=method)
  check_num_blocks(num_blocks, V, name=name, none_ok=True)
  return num_blocks


def all_scan(state, decay, axis_name, *, num_blocks=1, method="all_scan", initial=None,
             reverse=False, overlap_with=None):
  """Exclusive scan of ``state`` under ``X -> A(X) + state`` over ``axis_name``.

  Args:
    state: this rank's ``S_p``, ``[..., K, V]`` (float32 recommended).
    decay: this rank's transition ``A_p``: a :class:`zeco_jax.transitions.Transition`
      (``DiagonalDecay``, ``ScalarDecay``, ``Identity``, ``DenseTransition``), None (no
      decay), or, as before transitions existed, a decay array ``[..., K]`` (per
      dimension) or ``[...]`` (per head), broadcast over V.
    axis_name: the mesh axis to scan over (inside shard_map).
    num_blocks: blocks along V for ``"all_scan"``; must divide V. Other methods ignore it.
    method: a key of :data:`SCAN_METHODS`: ``"all_scan"``, ``"all_gather"``, ``"ring"``
      or ``"tree"``.
    initial: the state entering the first rank of the chain (zeros if None).
    reverse: run the chain from the last rank to the first.
    overlap_with: None, or a sequence of ``(fn, args)``: independent local work (it must
      not depend on the scan's result) to run while the chain's sends are in flight.
      With ``"all_scan"`` over P >= 2 ranks, piece i runs during send
      ``i * steps // len(overlap_with)`` of the ``steps = num_blocks + P - 2``: optimization
      barriers let it start only when that send's data is ready and make the next send
      wait for it, so XLA cannot bunch every piece beside one send (docs/design.md §4); its
      backward is tied to the reverse chain the same way. Other methods (and P = 1) just
      call the pieces.

  Returns:
    ``(exclusive, inclusive)``: the state entering this rank and the state after it,
    float32; with ``overlap_with``, ``(exclusive, inclusive, [fn(*args) per piece])``.
  """
  name = "all_scan"
  spec = get_method(method, name=name)
  if getattr(state, "ndim", 0) < 2:
    raise ValueError(f"{name}: `state` must be [..., K, V], got shape {jnp.shape(state)}.")
  A = as_transition(decay, state.shape, name=name).astype(jnp.float32)
  if initial is not None and initial.shape != state.shape:
    raise ValueError(f"{name}: `initial` must have the state's shape {state.shape}, got "
                     f"{initial.shape}.")
  if spec.blocked:
    check_num_blocks(num_blocks, state.shape[-1], name=name)
  S = state.astype(jnp.float32)
  h0 = (make_varying(jnp.zeros_like(S), axis_name) if initial is None
        else initial.astype(jnp.float32))
  work = () if overlap_with is None else tuple(overlap_with)
  results = None
  if lax.axis_size(axis_name) == 1:
    # opaque: callers multiply it into their outputs (zeco_jax._linalg.opaque says why).
    exclusive = opaque(jnp.broadcast_to(h0, S.shape))
  elif work and spec.run is _run_chain:
    exclusive, results = _run_chain(S, A, h0, axis_name, num_blocks, reverse, work)
  else:
    exclusive = spec.run(S, A, h0, axis_name, num_blocks if spec.blocked else 1, reverse)
  if overlap_with is None:
    return exclusive, A.apply(exclusive) + S
  if results is None:
    results = [fn(*args) for fn, args in work]
  return exclusive, A.apply(exclusive) + S, list(results)


def _chain(axis_name, reverse):
  """(P, this rank's position along the chain, position -> device index)."""
  P = lax.axis_size(axis_name)
  idx = lax.axis_index(axis_name)
  if reverse:
    return P, P - 1 - idx, lambda c: P - 1 - c
  return P, idx, lambda c: c


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _pipeline(S, A, h0, piece_args, axis_name, nb, reverse, piece_fns):
  X, results = _pipeline_scan(S, A, h0, axis_name, nb, reverse,
                              list(zip(piece_fns, piece_args)))
  return X, tuple(results)


def _pipeline_fwd(S, A, h0, piece_args, axis_name, nb, reverse, piece_fns):
  # Each piece runs under jax.vjp, so its backward can be tied to the reverse chain.
  pieces = [(functools.partial(jax.vjp, fn), args) for fn, args in zip(piece_fns, piece_args)]
  X, outs = _pipeline_scan(S, A, h0, axis_name, nb, reverse, pieces)
  results = tuple(out for out, _ in outs)
  # One state (and the transition) kept for the backward, and the pieces' own residuals.
  return (X, results), (X, A, tuple(vjp for _, vjp in outs))


def _pipeline_bwd(axis_name, nb, reverse, piece_fns, residuals, cotangents):
  """The reverse All-Scan (docs/design.md §5): the same chain, run the other way.

  With E_p the cotangent of the state leaving position p (X_{p+1}), E is the exclusive
  scan of dX in the opposite direction under the transposed transitions; then
  dS_p = E_p, dA_p = the cotangent of A_p in <E_p, A_p(X_p)>, and the initial state's
  cotangent is dX_0 + A_0^T(E_0). The pieces' backwards run tied to the reverse chain's
  sends, as their forwards were to the forward chain's.
  """
  del piece_fns
  X, A, vjps = residuals
  dX, d_results = cotangents
  A_t = A.transpose()
  if vjps:
    E, d_args = _pipeline_scan(dX, A_t, jnp.zeros_like(dX), axis_name, nb, not reverse,
                               [(vjp, (d,)) for vjp, d in zip(vjps, d_results)])
  else:
    E, d_args = _pipeline(dX, A_t, jnp.zeros_like(dX), (), axis_name, nb, not reverse, ())
  _, pos, _ = _chain(axis_name, reverse)
  d_initial = jnp.where(pos == 0, dX + A_t.apply(E), 0.0)
  return E, A.cotangent(X, E), d_initial, tuple(d_args)


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)


def _pipeline_scan(S, A, h0, axis_name, nb, reverse, pieces=()):
  """ZeCO's chain: at step s the rank at position c handles V block j = s - c.

  ``pieces``: ``(fn, args)`` pairs of local work independent of the chain (see
  :func:`all_scan`'s ``overlap_with``). Piece i is assigned to send
  ``s = i * steps // len(pieces)``; optimization barriers make it start only once that
  send's data is ready and make the next send wait for its result, so the compiler has
  exactly that piece to run while send s is in flight (docs/design.md §4). Returns
  ``(X, [fn(*args) for each piece])``.
  """
  P, pos, dev = _chain(axis_name, reverse)
  steps = nb + P - 2
  n = len(pieces)
  at_step = [[i for i in range(n) if i * steps // n == s] for s in range(steps)]
  results, pending = [None] * n, []
  *lead, K, V = S.shape
  to_blocks = lambda x: jnp.moveaxis(x.reshape(*lead, K, nb, V // nb), -2, 0)
  S_b = to_blocks(S)
  h0_b = to_blocks(jnp.broadcast_to(h0, S.shape))
  X_b = jnp.zeros_like(S_b)
  recv = jnp.zeros_like(S_b[0])
  for s in range(nb + P - 1):
    j = s - pos
    active = (j >= 0) & (j < nb)
    jc = jnp.clip(j, 0, nb - 1)
    incoming = jnp.where(pos == 0, lax.dynamic_index_in_dim(h0_b, jc, 0, keepdims=False), recv)
    keep = lax.dynamic_index_in_dim(X_b, jc, 0, keepdims=False)
    X_b = lax.dynamic_update_index_in_dim(X_b, jnp.where(active, incoming, keep), jc, 0)
    if s < steps:
      out = A.apply(incoming) + lax.dynamic_index_in_dim(S_b, jc, 0, keepdims=False)
      perm = [(dev(c), dev(c + 1)) for c in range(P - 1) if 0 <= s - c < nb]
      args = [pieces[i][1] for i in at_step[s]]
      if args or pending:
        out, done, args = lax.optimization_barrier((out, [results[i] for i in pending], args))
        for i, r in zip(pending, done):
          results[i] = r
      recv = lax.ppermute(out, axis_name, perm)
      for i, a in zip(at_step[s], args):
        results[i] = pieces[i][0](*a)
      pending = at_step[s]
  if pending:
    X_b, done = lax.optimization_barrier((X_b, [results[i] for i in pending]))
    for i, r in zip(pending, done):
      results[i] = r
  return jnp.moveaxis(X_b, 0, -2).reshape(S.shape), results


def _tree_scan(S, A, h0, axis_name, reverse):
  """Recursive doubling on (A, S) pairs, then a one-hop shift to make it exclusive."""
  P, pos, dev = _chain(axis_name, reverse)
  acc_S = jnp.where(pos == 0, A.apply(h0) + S, S)   # fold the initial state into position 0
  acc_A = A
  d = 1
  while d < P:
    send = functools.partial(lax.ppermute, axis_name=axis_name,
                             perm=[(dev(c), dev(c + d)) for c in range(P - d)])
    recv_S, recv_A = send(acc_S), jax.tree.map(send, acc_A)
    has = pos >= d
    acc_S = jnp.where(has, acc_A.apply(recv_S) + acc_S, acc_S)
    acc_A = jax.tree.map(lambda new, old: jnp.where(has, new, old), acc_A.compose(recv_A),
                         acc_A)
    d *= 2
  shifted = lax.ppermute(acc_S, axis_name, [(dev(c), dev(c + 1)) for c in range(P - 1)])
  return jnp.where(pos == 0, jnp.broadcast_to(h0, S.shape), shifted)


def _all_gather_scan(S, A, h0, axis_name, reverse):
  """LASP-2: gather every rank's (S, A), fold the ones before this rank in chain order."""
  P, pos, dev = _chain(axis_name, reverse)
  S_all = lax.all_gather(S, axis_name)
  A_all = jax.tree.map(lambda x: lax.all_gather(x, axis_name), A)

  def fold(c, X):
    d = dev(c)
    X_next = jax.tree.map(lambda x: x[d], A_all).apply(X) + S_all[d]
    return jnp.where(c < pos, X_next, X)

  return lax.fori_loop(0, P, fold, make_varying(jnp.broadcast_to(h0, S.shape), axis_name))
