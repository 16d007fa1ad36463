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
* ``"all_scan_2level"``: the ranks in contiguous groups of ``group_size``: All-Scans inside
  the groups and across their last ranks, then each group's entering state spread over its
  members (:func:`_two_level_scan`): at most two states per rank in about
  ``2 sqrt(P)`` hops instead of ``P``; its backward the same scan run the other way.

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
import numpy as np
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
    grouped: the ranks are cut into groups along the chain; ``run`` and ``time`` take a
      ``group_size`` keyword (None: :func:`default_group_size`).
  """
  name: str
  summary: str
  run: Callable
  time: Callable[..., float]
  bytes_per_rank: Callable[..., float]
  blocked: bool = False
  overlaps_local: bool = True
  grouped: bool = False


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
    ScanMethod(
        "all_scan_2level", "All-Scans within groups of G ranks and across the groups' last "
        "ranks, then each group's entering state spread over its members",
        run=lambda *a, group_size=None: _run_two_level(*a, group_size=group_size),
        time=lambda P, nb, M, m_A, alpha, beta, group_size=None: two_level_cost(
            P, _group(P, M, alpha, beta, group_size), nb, M, m_A, alpha, beta).time,
        bytes_per_rank=lambda P, M, m_A, group_size=None: two_level_cost(
            P, _group(P, M, DEFAULT_ALPHA_S, DEFAULT_BETA_S_PER_BYTE, group_size), 1, M,
            m_A, DEFAULT_ALPHA_S, DEFAULT_BETA_S_PER_BYTE).bytes_per_rank,
        blocked=True, grouped=True),
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
                   method: str = "all_scan", transition_bytes: float = 0.0,
                   group_size: int | None = None) -> float:
  """Alpha-beta model of one exclusive scan, in seconds (docs/design.md §6)."""
  spec = get_method(method, name="predicted_time")
  if P <= 1:
    return 0.0
  nb = num_blocks if spec.blocked else 1
  kw = {"group_size": group_size} if spec.grouped else {}
  return spec.time(P, nb, state_bytes, transition_bytes, alpha, beta, **kw)


def bytes_sent_per_rank(P: int, state_bytes: float, method: str,
                        transition_bytes: float = 0.0, group_size: int | None = None) -> float:
  """The most bytes one rank puts on the wire for one scan, as the model counts them."""
  spec = get_method(method, name="bytes_sent_per_rank")
  kw = {"group_size": group_size} if spec.grouped else {}
  return 0.0 if P <= 1 else spec.bytes_per_rank(P, state_bytes, transition_bytes, **kw)


def default_num_blocks(P: int, state_bytes: float, V: int,
                       alpha: float = DEFAULT_ALPHA_S,
                       beta: float = DEFAULT_BETA_S_PER_BYTE, method: str = "all_scan",
                       group_size: int | None = None) -> int:
  """For a blocked method, the divisor of V nearest the All-Scan's optimum
  sqrt((L - 2) beta M / alpha) for its longest chain of L ranks (P for the All-Scan; the
  longer of a group and the number of groups for the two-level scan); 1 for the others."""
  spec = get_method(method, name="default_num_blocks")
  if not spec.blocked:
    return 1
  L = P
  if spec.grouped:
    G = _group(P, state_bytes, alpha, beta, group_size)
    L = max(min(G, P), -(-P // G))
  best = math.sqrt(max(L - 2, 0) * beta * state_bytes / alpha) if L > 2 else 1.0
  divisors = [d for d in range(1, V + 1) if V % d == 0]
  return min(divisors, key=lambda d: (abs(math.log(d) - math.log(max(best, 1.0))), d))


# --- the two-level All-Scan's groups and cost model (docs/design.md §6) ------------------

@dataclasses.dataclass(frozen=True)
class TwoLevelCost:
  """The alpha-beta model of one two-level scan with groups of ``group_size``.

  Attributes:
    time: seconds for one scan.
    bytes_per_rank: the most bytes any rank sends (a member's level-1 state, its prefix
      transition and its share of the spread; a group's last rank's level-2 state and
      the spread of the group's entering state).
    hops: sequential point-to-point steps on the critical path (level 1, level 2, the
      two steps of the spread).
  """
  time: float
  bytes_per_rank: float
  hops: int


def group_sizes(P: int, group_size: int) -> tuple:
  """The sizes of the contiguous groups the chain's P positions are cut into."""
  return tuple(min(group_size, P - s) for s in range(0, P, group_size))


def spread_width(elements: int, members: int) -> int:
  """Elements of one member's share of a group's entering state (the last may be short)."""
  return -(-elements // members)


def two_level_cost(P: int, group_size: int, num_blocks: float, M: float, m_A: float,
                   alpha: float, beta: float) -> TwoLevelCost:
  """:class:`TwoLevelCost` of P ranks in groups of ``group_size`` (float32 states of M
  bytes, transitions of ``m_A``); ``num_blocks`` blocks at both levels."""
  sizes = group_sizes(P, group_size)
  n, m, nb = max(sizes), len(sizes), num_blocks
  chain = lambda L: 0.0 if L < 2 else (nb + L - 2) * (alpha + beta * M / nb)
  hops = lambda L: 0 if L < 2 else int(nb) + L - 2
  spread = m >= 2 and any(k >= 2 for k in sizes[1:])
  time = chain(n) + chain(m) + (2 * alpha + 2 * beta * M if spread else 0.0)
  member = M + (m_A if m >= 2 else 0.0) if n >= 2 else 0.0
  if spread:
    F = M / 4
    member += max((k - 2) * spread_width(int(F), k - 1) * 4 for k in set(sizes[1:]) if k >= 2)
  # A group's last rank: level 2's send (all groups but the last), the spread (all but
  # the first, which h0 entered at level 1).
  last = max((M if g < m - 1 else 0.0) + (M if g >= 1 and k >= 2 else 0.0)
             for g, k in enumerate(sizes))
  return TwoLevelCost(time=time, bytes_per_rank=max(member, last),
                      hops=hops(n) + hops(m) + (2 if spread else 0))


@functools.lru_cache(maxsize=None)
def default_group_size(P: int, state_bytes: float, alpha: float = DEFAULT_ALPHA_S,
                       beta: float = DEFAULT_BETA_S_PER_BYTE) -> int:
  """The two-level scan's group size G: the least modelled time over G in 1..P, each with
  its own best block count (the continuous optimum of its longer chain); ties go to the
  fewer hops. G = 1 or P is the All-Scan itself."""
  def cost(G):
    sizes = group_sizes(P, G)
    L = max(max(sizes), len(sizes))
    nb = max(1.0, math.sqrt(max(L - 2, 0) * beta * state_bytes / alpha))
    c = two_level_cost(P, G, nb, state_bytes, 0.0, alpha, beta)
    return c.time, c.hops, G
  return min(range(1, P + 1), key=cost)


def _group(P, M, alpha, beta, group_size):
  return default_group_size(P, M, alpha, beta) if group_size is None else group_size


def check_group_size(group_size, method, *, name: str) -> None:
  """``group_size`` is None or a positive int, and only for a grouped method."""
  if group_size is None:
    return
  if not get_method(method, name=name).grouped:
    raise ValueError(f"{name}: `group_size`={group_size!r} is for a grouped scan method "
                     f"({', '.join(repr(k) for k, v in SCAN_METHODS.items() if v.grouped)}); "
                     f"method={method!r} has no groups. Leave group_size=None.")
  if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
    raise ValueError(f"{name}: `group_size` must be a positive int (ranks per group along "
                     f"the sequence) or None for the model's choice, got {group_size!r}.")


def check_num_blocks(num_blocks, V, *, name: str, none_ok: bool = False) -> None:
  if (not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1
      or V % num_blocks):
    raise ValueError(f"{name}: `num_blocks` must be a positive int dividing the value dim "
                     f"V = {V} (the state is split along V), got {num_blocks!r}. Try one of "
                     f"{[d for d in range(1, V + 1) if V % d == 0]}"
                     + (" or None for the default." if none_ok else "."))


def resolve_num_blocks(num_blocks, method, P: int, state_bytes: float, V: int, *,
                       name: str, group_size: int | None = None) -> int:
  """``num_blocks`` for ``method`` over ``P`` ranks: 1 for an unblocked method, the
  alpha-beta optimum (:func:`default_num_blocks`) for None, else ``num_blocks`` checked."""
  if not SCAN_METHODS[method].blocked:
    return 1
  if num_blocks is None:
    return default_num_blocks(P, state_bytes, V, method=method, group_size=group_size)
  check_num_blocks(num_blocks, V, name=name, none_ok=True)
  return num_blocks


def all_scan(state, decay, axis_name, *, num_blocks=1, method="all_scan", initial=None,
             reverse=False, overlap_with=None, group_size=None):
  """Exclusive scan of ``state`` under ``X -> A(X) + state`` over ``axis_name``.

  Args:
    state: this rank's ``S_p``, ``[..., K, V]`` (float32 recommended).
    decay: this rank's transition ``A_p``: a :class:`zeco_jax.transitions.Transition`
      (``DiagonalDecay``, ``ScalarDecay``, ``Identity``, ``DenseTransition``), None (no
      decay), or, as before transitions existed, a decay array ``[..., K]`` (per
      dimension) or ``[...]`` (per head), broadcast over V.
    axis_name: the mesh axis to scan over (inside shard_map).
    num_blocks: blocks along V for ``"all_scan"`` and ``"all_scan_2level"`` (both of its
      levels); must divide V. Other methods ignore it.
    method: a key of :data:`SCAN_METHODS`: ``"all_scan"``, ``"all_gather"``, ``"ring"``,
      ``"tree"`` or ``"all_scan_2level"``.
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
    group_size: ``"all_scan_2level"`` only: ranks per group along the chain (the last group
      may be shorter); None: :func:`default_group_size`, the alpha-beta optimum.

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
  check_group_size(group_size, method, name=name)
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
    kw = {}
    if spec.grouped:
      kw["group_size"] = _group(lax.axis_size(axis_name), 4 * S.size, DEFAULT_ALPHA_S,
                                DEFAULT_BETA_S_PER_BYTE, group_size)
    exclusive = spec.run(S, A, h0, axis_name, num_blocks if spec.blocked else 1, reverse,
                         **kw)
  if overlap_with is None:
    return exclusive, A.apply(exclusive) + S
  if results is None:
    results = [fn(*args) for fn, args in work]
  return exclusive, A.apply(exclusive) + S, list(results)


def check_overlap_pieces(overlap_pieces, method, H, *, name) -> int:
  """A local pass's ``overlap_pieces`` (not None) checked: a positive int dividing the
  number of heads H, and > 1 only with ``method="all_scan"`` (the only chain of sends)."""
  if (not isinstance(overlap_pieces, int) or isinstance(overlap_pieces, bool)
      or overlap_pieces < 1 or H % overlap_pieces):
    raise ValueError(f"{name}: `overlap_pieces` must be a positive int dividing the number of "
                     f"heads H = {H}, got {overlap_pieces!r}; try one of "
                     f"{[d for d in range(1, H + 1) if H % d == 0]} or None for the default.")
  if overlap_pieces > 1 and method != "all_scan":
    raise ValueError(f"{name}: `overlap_pieces`={overlap_pieces} splits the local pass over the "
                     f"All-Scan's sends; method={method!r} has none to overlap. Use "
                     "method='all_scan' or overlap_pieces=1.")
  return overlap_pieces


def _pick(blocks, jc):
  """``blocks[jc]`` for a traced index ``jc`` (pytrees alike: states or transitions)."""
  out = blocks[0]
  for j in range(1, len(blocks)):
    out = jax.tree.map(lambda a, b, j=j: jnp.where(jc == j, a, b), blocks[j], out)
  return out


def all_scan_of_pieces(pieces, axis_name, *, initial=None):
  """The All-Scan over blocks that local work produces along the way: block j is what
  piece j computes (a head group's local pass), so the chain starts after the first
  piece instead of after all of them, and each later piece runs while a send is in flight.

  Args:
    pieces: a sequence of G ``(fn, args)``; ``fn(*args)`` returns ``(S_j, A_j, extra_j)``:
      the block's state ``[..., K, V]`` (every block the same shape), its transition (a
      :class:`zeco_jax.transitions.Transition`) and anything else the caller needs.
    axis_name: the mesh axis of the chain (inside shard_map), forward direction.
    initial: None, or the state entering the first rank as G blocks (a sequence).

  Returns:
    ``(exclusive, inclusive, extras)``: per block the state entering this rank and the
    state after it (float32), and each piece's ``extra``.

  The chain is the All-Scan's (:func:`_chains_scan`) with the blocks in the role of its V
  blocks: at step s the rank at position c handles block s - c, so block j is first
  needed at step j (by the first rank). Piece 0 runs before the chain; piece j + 1 starts,
  behind an optimization barrier, once step j's send has its data, so it runs while that
  send is in flight; step j + 1 needs its result. Steps: G + P - 2 sends, one block per
  rank each (one state per rank in all). Plain JAX: autodiff gives the backward (the
  reverse chain, each step's received block kept: about two states per rank);
  :func:`all_scan_of_pieces_transpose` is that reverse chain for fixed transitions, with
  work of its own beside the sends.
  """
  pieces = list(pieces)
  G = len(pieces)
  P = lax.axis_size(axis_name)
  pos = lax.axis_index(axis_name)
  fn0, args0 = pieces[0]
  S0, A0, e0 = fn0(*args0)
  S, A, extras = [S0.astype(jnp.float32)], [A0.astype(jnp.float32)], [e0]
  zero = lambda: jnp.zeros_like(S[0])
  h0 = [zero() if initial is None else match_varying(initial[j].astype(jnp.float32), S[0])
        for j in range(G)]

  X = [None] * G
  recv = zero()
  steps = G + P - 2
  for s in range(G + P - 1):
    j = s - pos
    active = (j >= 0) & (j < G)
    jc = jnp.clip(j, 0, G - 1)
    ready = min(s, G - 1) + 1                      # blocks 0..s exist at step s
    incoming = jnp.where(pos == 0, _pick(h0[:ready], jc), recv)
    for jj in range(ready):
      keep = zero() if X[jj] is None else X[jj]
      X[jj] = jnp.where(active & (j == jj), incoming, keep)
    if s < steps:
      out = _pick(A[:ready], jc).apply(incoming) + _pick(S[:ready], jc)
      nxt = s + 1 < G
      if nxt:
        out, args = lax.optimization_barrier((out, pieces[s + 1][1]))
      perm = [(c, c + 1) for c in range(P - 1) if 0 <= s - c < G]
      if perm:
        recv = lax.ppermute(out, axis_name, perm)
      if nxt:
        Sj, Aj, ej = pieces[s + 1][0](*args)
        S.append(Sj.astype(jnp.float32))
        A.append(Aj.astype(jnp.float32))
        extras.append(ej)
  X = [zero() if x is None else x for x in X]
  return X, [a.apply(x) + st for a, x, st in zip(A, X, S)], extras


def all_scan_of_pieces_transpose(transitions_, d_exclusive, d_inclusive, axis_name, *,
                                 initial_like=None, pieces=None):
  """The transpose of :func:`all_scan_of_pieces` for fixed transitions (the reverse chain),
  with local work beside its sends.

  Args:
    transitions_: the G blocks' transitions on this rank (the forward's ``A_j``).
    d_exclusive, d_inclusive: per block the cotangents of the state entering this rank and
      of the state after it (float32 ``[..., K, V]``).
    axis_name: the forward chain's mesh axis.
    initial_like: None, or the forward's initial blocks (their cotangents are returned).
    pieces: None, or G ``(fn, args)``: ``fn(d_state_j, *args)`` is block j's work given
      the whole cotangent of its state ``S_j`` (the delta rule: head group j's backward).

  Returns:
    ``(d_states, d_initial, results)``: per block the cotangent of ``S_j``, of the initial
    block (None without ``initial_like``) and ``fn``'s result (None without ``pieces``).

  The chain runs the forward's steps backwards: at step s the rank at position c takes
  block s - c, whose state cotangent is what position c + 1 sent at step s + 1 plus the
  block's ``d_inclusive``, and sends ``A^T`` of it plus ``d_exclusive`` to position c - 1:
  one block per rank and step, one state per rank in all, as forward. Block s's cotangent
  is whole on every rank once step s has run (position 0 takes it last), so block s's
  work starts behind an optimization barrier once step s's send has its data, and step s
  - 1's send waits for its result: G - 1 of the G + P - 2 sends have a piece beside them,
  the forward's pipeline mirrored.
  """
  G = len(transitions_)
  P = lax.axis_size(axis_name)
  pos = lax.axis_index(axis_name)
  backward = [a.transpose() for a in transitions_]
  zero = lambda: jnp.zeros_like(d_exclusive[0])

  d_states = [zero() for _ in range(G)]
  first = [zero() for _ in range(G)]            # position 0's outgoing: the initial's share
  results = [None] * G
  recv, pending = zero(), None
  for s in reversed(range(G + P - 1)):
    j = s - pos
    active = (j >= 0) & (j < G)
    jc = jnp.clip(j, 0, G - 1)
    d_state = recv + _pick(d_inclusive, jc)
    out = _pick(backward, jc).apply(d_state) + _pick(d_exclusive, jc)
    for jj in range(G):
      mine = active & (j == jj)
      d_states[jj] = jnp.where(mine, d_state, d_states[jj])
      first[jj] = jnp.where(mine & (pos == 0), out, first[jj])
    if pending is not None:
      out, _ = lax.optimization_barrier((out, pending))
    work = pieces is not None and s < G
    if work:
      out, args = lax.optimization_barrier((out, (d_states[s], pieces[s][1])))
    perm = [(c, c - 1) for c in range(1, P) if 0 <= s - c < G]
    if perm:
      recv = lax.ppermute(out, axis_name, perm)
    if work:
      results[s] = pieces[s][0](args[0], *args[1])
      pending = results[s]
  d_initial = None
  if initial_like is not None:
    # The forward cast each initial block to vary like the states (match_varying); its
    # transpose takes the cotangent back to the initial's own type.
    d_initial = [jax.linear_transpose(
        lambda h, like=like: match_varying(h.astype(jnp.float32), d_exclusive[0]), like)(f)[0]
        for like, f in zip(initial_like, first)]
  return d_states, d_initial, results


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
  """ZeCO's chain over the whole axis (see :func:`_chains_scan`)."""
  P, pos, dev = _chain(axis_name, reverse)
  return _chains_scan(S, A, h0, axis_name, nb, pos, (tuple(dev(c) for c in range(P)),),
                      pieces)


def _chains_scan(S, A, h0, axis_name, nb, pos, chains, pieces=()):
  """Pipelined chains: at step s the rank at position c of its chain handles V block
  j = s - c, and sends A(incoming) + S on to position c + 1.

  ``chains``: disjoint tuples of device indices along the axis, each one chain (the
  All-Scan: one chain of every rank; the two-level scan: its groups, then its leaders);
  ``pos``: this device's position in its chain (traced), or at least the longest
  chain's length plus ``nb`` for a device in none (it then only returns zeros). Only the
  pairs that carry a real block are in a step's perm, so every rank but a chain's last
  sends exactly one state.

  ``pieces``: ``(fn, args)`` pairs of local work independent of the chain (see
  :func:`all_scan`'s ``overlap_with``). Piece i is assigned to send
  ``s = i * steps // len(pieces)``; optimization barriers make it start only once that
  send's data is ready and make the next send wait for its result, so the compiler has
  exactly that piece to run while send s is in flight (docs/design.md §4). Returns
  ``(X, [fn(*args) for each piece])``.
  """
  n_max = max(len(ch) for ch in chains)
  steps = nb + n_max - 2
  n = len(pieces)
  at_step = [[i for i in range(n) if i * steps // n == s] for s in range(steps)]
  results, pending = [None] * n, []
  *lead, K, V = S.shape
  to_blocks = lambda x: jnp.moveaxis(x.reshape(*lead, K, nb, V // nb), -2, 0)
  S_b = to_blocks(S)
  h0_b = to_blocks(jnp.broadcast_to(h0, S.shape))
  X_b = jnp.zeros_like(S_b)
  recv = jnp.zeros_like(S_b[0])
  for s in range(nb + n_max - 1):
    j = s - pos
    active = (j >= 0) & (j < nb)
    jc = jnp.clip(j, 0, nb - 1)
    incoming = jnp.where(pos == 0, lax.dynamic_index_in_dim(h0_b, jc, 0, keepdims=False), recv)
    keep = lax.dynamic_index_in_dim(X_b, jc, 0, keepdims=False)
    X_b = lax.dynamic_update_index_in_dim(X_b, jnp.where(active, incoming, keep), jc, 0)
    if s < steps:
      out = A.apply(incoming) + lax.dynamic_index_in_dim(S_b, jc, 0, keepdims=False)
      perm = [(ch[c], ch[c + 1]) for ch in chains for c in range(len(ch) - 1)
              if 0 <= s - c < nb]
      args = [pieces[i][1] for i in at_step[s]]
      if args or pending:
        out, done, args = lax.optimization_barrier((out, [results[i] for i in pending], args))
        for i, r in zip(pending, done):
          results[i] = r
      if perm:
        recv = lax.ppermute(out, axis_name, perm)
      for i, a in zip(at_step[s], args):
        results[i] = pieces[i][0](*a)
      pending = at_step[s]
  if pending:
    X_b, done = lax.optimization_barrier((X_b, [results[i] for i in pending]))
    for i, r in zip(pending, done):
      results[i] = r
  return jnp.moveaxis(X_b, 0, -2).reshape(S.shape), results


def _run_two_level(S, A, h0, axis_name, num_blocks, reverse, group_size):
  """The two-level All-Scan, with the operands' varying axes matched as in
  :func:`_run_chain`."""
  h0 = jnp.broadcast_to(h0, S.shape)
  leaves = (S, h0, *jax.tree.leaves(A))
  S, h0 = (match_varying(x, *leaves) for x in (S, h0))
  A = jax.tree.map(lambda x: match_varying(x, *leaves), A)
  return _two_level(S, A, h0, axis_name, num_blocks, group_size, reverse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _two_level(S, A, h0, axis_name, nb, G, reverse):
  return _two_level_scan(S, A, h0, axis_name, nb, G, reverse)


def _two_level_fwd(S, A, h0, axis_name, nb, G, reverse):
  X = _two_level_scan(S, A, h0, axis_name, nb, G, reverse)
  return X, (X, A)


def _two_level_bwd(axis_name, nb, G, reverse, residuals, dX):
  """As the All-Scan's (:func:`_pipeline_bwd`): the same two-level scan run the other way
  over the cotangents under the transposed transitions."""
  X, A = residuals
  A_t = A.transpose()
  E = _two_level(dX, A_t, jnp.zeros_like(dX), axis_name, nb, G, not reverse)
  _, pos, _ = _chain(axis_name, reverse)
  d_initial = jnp.where(pos == 0, dX + A_t.apply(E), 0.0)
  return E, A.cotangent(X, E), d_initial


_two_level.defvjp(_two_level_fwd, _two_level_bwd)


def _tree_where(cond, a, b):
  return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


def _two_level_scan(S, A, h0, axis_name, nb, G, reverse):
  """The two-level All-Scan (docs/design.md §6): the chain's positions in contiguous
  groups of G (the last may be shorter).

  1. Level 1: a pipelined All-Scan inside every group from a zero state (the first group
     from ``h0``) gives each rank b, its state from its own group's earlier ranks; beside
     it, a chain of transitions gives each rank R, the product of its group's earlier
     transitions. A group's last rank then holds the group's total (state and transition).
  2. Level 2: a pipelined All-Scan over the groups' last ranks of those totals gives each
     last rank Y, the state entering its group.
  3. The spread: each last rank sends its group's other members one share each of Y,
     flattened, and the members all-gather the shares among themselves (ppermutes).
  Then ``X = b + R(Y)``. Every member sends one state, one transition and (n - 2) shares
  of Y / (n - 1); a last rank two states (level 2 and the spread): at most two states per
  rank, within a few elements, against the All-Scan's one, in nb + n - 2 + nb + m - 2 + 2
  hops for groups of n and m groups, against nb + P - 2.
  """
  P, pos, dev = _chain(axis_name, reverse)
  sizes = group_sizes(P, G)
  m = len(sizes)
  starts = [sum(sizes[:i]) for i in range(m)]
  groups = [tuple(range(st, st + k)) for st, k in zip(starts, sizes)]
  table = lambda values: jnp.asarray(np.asarray(values, np.int32))[pos]
  grp = table([i for i, k in enumerate(sizes) for _ in range(k)])
  c = table([j for k in sizes for j in range(k)])
  size = table([k for k in sizes for _ in range(k)])
  far = P + nb                                        # a position no chain step reaches
  zeros = jnp.zeros_like(S)
  # Level 1: inside each group, from zero (the first group from h0).
  b = jnp.where(grp == 0, h0, zeros)
  if max(sizes) > 1:
    b = _chains_scan(S, A, b, axis_name, nb, c,
                     tuple(tuple(dev(p) for p in g) for g in groups))[0]
  if m == 1:
    return b
  R = A                                              # A_{c-1} o ... o A_0, for c >= 1
  for s in range(max(sizes) - 1):
    cur = A if s == 0 else _tree_where(c == 0, A, A.compose(R))
    perm = [(dev(g[s]), dev(g[s + 1])) for g in groups if s + 1 < len(g)]
    recv = jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), cur)
    R = _tree_where(c == s + 1, recv, R)
  last = c == size - 1
  # Level 2: over the groups' last ranks, the groups' totals.
  total = A.apply(b) + S
  A_group = _tree_where(c == 0, A, A.compose(R))
  Y = _chains_scan(total, A_group, zeros, axis_name, nb, jnp.where(last, grp, far),
                   (tuple(dev(g[-1]) for g in groups),))[0]
  # The spread of Y over each group's members (the first group's Y is zero: h0 went in
  # at level 1). One set of ppermutes per group size, as each has its own share width.
  flat = Y.reshape(-1)
  F = flat.shape[0]
  Y_member = zeros
  for k in sorted(set(sizes[1:])):
    n_mem = k - 1
    if n_mem < 1:
      continue
    of_size = [g for g in groups[1:] if len(g) == k]
    w = spread_width(F, n_mem)
    share = jnp.zeros((w,), flat.dtype)
    for i in range(n_mem):
      piece = flat[i * w:min((i + 1) * w, F)]
      if piece.shape[0] == 0:          # more members than elements: nothing for this one
        continue
      got = lax.ppermute(piece, axis_name, [(dev(g[-1]), dev(g[i])) for g in of_size])
      share = jnp.where(c == i, jnp.pad(got, (0, w - piece.shape[0])), share)
    shares = lax.dynamic_update_index_in_dim(jnp.zeros((n_mem, w), flat.dtype), share,
                                             jnp.clip(c, 0, n_mem - 1), 0)
    for d in range(1, n_mem):
      got = lax.ppermute(share, axis_name, [(dev(g[i]), dev(g[(i + d) % n_mem]))
                                            for g in of_size for i in range(n_mem)])
      shares = lax.dynamic_update_index_in_dim(shares, got, jnp.mod(c - d, n_mem), 0)
    gathered = shares.reshape(-1)[:F].reshape(Y.shape)
    Y_member = jnp.where((grp >= 1) & (size == k), gathered, Y_member)
  Y = jnp.where(last, Y, Y_member)
  return b + jnp.where(c == 0, Y, R.apply(Y))


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
