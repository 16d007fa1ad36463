"""All-Scan: the exclusive scan of linear-attention states over a mesh axis (spec section 4).

Call :func:`all_scan` inside ``shard_map``. Rank p holds a state ``S_p`` ``[..., K, V]`` and
a decay ``lam_p`` (``[..., K]`` per dimension or ``[...]`` per head, broadcast over V);
the result is the state entering rank p,

    X_0 = initial (zeros by default),   X_{p+1} = lam_p * X_p + S_p,

and the inclusive value ``lam_p * X_p + S_p`` (the state after rank p; on the last rank,
the state after the whole sequence). ``reverse=True`` runs the chain from the last rank to
the first (the backward pass's direction).

Methods, all exact and differentiable:

* ``"pipeline"``: ZeCO's All-Scan. The state is split into ``num_blocks`` blocks along V;
  an unrolled chain of ``num_blocks + P - 2`` ``ppermute`` steps in which each step's perm
  lists only the pairs that carry a real block, so every rank sends exactly one state.
  Its backward (a custom_vjp) is the reverse All-Scan of spec section 5: the same chain run
  the other way over the cotangents, keeping only ``X_p`` from the forward.
* ``"tree"``: recursive doubling with the associative combine, ceil(log2 P) rounds plus a
  one-hop shift to make it exclusive; any P.
* ``"all_gather"``: LASP-2. All-gather every ``(S_p, lam_p)`` and fold locally.
* ``"serial"``: LASP-1's chain: ``"pipeline"`` with one block.

The tree and all-gather methods are differentiated by JAX (the transpose of a
``ppermute`` is the reverse ``ppermute``; of an all-gather, a reduce-scatter).

It moves states only; what overlaps with it is up to the caller (see
:func:`zeco_jax.zeco_gla_local`; the alpha-beta model that picks ``num_blocks`` is here too).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from zeco_jax._vma import make_varying, match_varying

METHODS = ("pipeline", "tree", "all_gather", "serial")

# Alpha-beta model defaults for picking num_blocks (spec section 4): a point-to-point hop's
# latency and the inverse link bandwidth. Rough GPU figures (NVLink-class link, ~10 us per
# collective launch-and-sync); pass your own to ``default_num_blocks`` for other fabrics.
DEFAULT_ALPHA_S = 10e-6
DEFAULT_BETA_S_PER_BYTE = 1.0 / 100e9


def predicted_time(P: int, num_blocks: int, state_bytes: float,
                   alpha: float = DEFAULT_ALPHA_S, beta: float = DEFAULT_BETA_S_PER_BYTE,
                   method: str = "pipeline") -> float:
  """Alpha-beta model of one exclusive scan, in seconds (spec section 4)."""
  M = state_bytes
  if P <= 1:
    return 0.0
  if method in ("pipeline", "serial"):
    nb = 1 if method == "serial" else num_blocks
    return (nb + P - 2) * (alpha + beta * M / nb)
  if method == "tree":
    return (math.ceil(math.log2(P)) + 1) * (alpha + beta * M)
  if method == "all_gather":   # ring all-gather: P - 1 hops of M each
    return (P - 1) * (alpha + beta * M)
  raise ValueError(f"predicted_time: unknown method {method!r}")


def bytes_sent_per_rank(P: int, state_bytes: float, method: str) -> float:
  """Bytes each rank puts on the wire for one scan, as the model counts them."""
  if P <= 1:
    return 0.0
  return {"pipeline": state_bytes, "serial": state_bytes,
          "tree": (math.ceil(math.log2(P)) + 1) * state_bytes,
          "all_gather": (P - 1) * state_bytes}[method]


def default_num_blocks(P: int, state_bytes: float, V: int,
                       alpha: float = DEFAULT_ALPHA_S,
                       beta: float = DEFAULT_BETA_S_PER_BYTE) -> int:
  """The divisor of V nearest the model's optimum sqrt((P - 2) beta M / alpha)."""
  best = math.sqrt(max(P - 2, 0) * beta * state_bytes / alpha) if P > 2 else 1.0
  divisors = [d for d in range(1, V + 1) if V % d == 0]
  return min(divisors, key=lambda d: (abs(math.log(d) - math.log(max(best, 1.0))), d))


def _check(state, decay, initial, num_blocks, method, P):
  name = "all_scan"
  if method not in METHODS:
    raise ValueError(f"{name}: unknown `method` {method!r}; choose one of {METHODS}.")
  if state.ndim < 2:
    raise ValueError(f"{name}: `state` must be [..., K, V], got shape {state.shape}.")
  if decay.shape not in (state.shape[:-1], state.shape[:-2]):
    raise ValueError(f"{name}: `decay` must be [..., K] = {state.shape[:-1]} (per dimension) or "
                     f"[...] = {state.shape[:-2]} (per head) for state {state.shape}, got "
                     f"{decay.shape}.")
  if initial is not None and initial.shape != state.shape:
    raise ValueError(f"{name}: `initial` must have the state's shape {state.shape}, got "
                     f"{initial.shape}.")
  V = state.shape[-1]
  if method == "pipeline":
    if not isinstance(num_blocks, int) or num_blocks < 1 or V % num_blocks:
      raise ValueError(f"{name}: `num_blocks` must be a positive int dividing the blocked "
                       f"dimension V = {V}, got {num_blocks!r}. Try one of "
                       f"{[d for d in range(1, V + 1) if V % d == 0]}.")


def all_scan(state, decay, axis_name, *, num_blocks=1, method="pipeline", initial=None,
             reverse=False):
  """Exclusive scan of ``state`` under ``X -> decay * X + state`` over ``axis_name``.

  Args:
    state: this rank's ``S_p``, ``[..., K, V]`` (float32 recommended).
    decay: this rank's ``lam_p``, ``[..., K]`` or ``[...]``; broadcast over V (and K).
    axis_name: the mesh axis to scan over (inside shard_map).
    num_blocks: blocks along V for ``"pipeline"``; must divide V.
    method: ``"pipeline"``, ``"tree"``, ``"all_gather"`` or ``"serial"``.
    initial: the state entering the first rank of the chain (zeros if None).
    reverse: run the chain from the last rank to the first.

  Returns:
    ``(exclusive, inclusive)``: the state entering this rank and the state after it.
  """
  P = lax.axis_size(axis_name)
  _check(state, decay, initial, num_blocks, method, P)
  f32 = jnp.float32
  lam = decay.astype(f32)
  lam = lam[..., None] if decay.shape == state.shape[:-1] else lam[..., None, None]
  S = state.astype(f32)
  h0 = make_varying(jnp.zeros_like(S), axis_name) if initial is None else initial.astype(f32)
  _, pos, dev = _chain(axis_name, reverse)

  if P == 1:
    exclusive = jnp.broadcast_to(h0, S.shape)
  elif method == "all_gather":
    exclusive = _all_gather_scan(S, lam, h0, axis_name, P, pos, dev)
  elif method == "tree":
    exclusive = _tree_scan(S, lam, h0, axis_name, P, pos, dev)
  else:
    nb = 1 if method == "serial" else num_blocks
    # Same varying axes for every operand, so the custom_vjp's cotangents match (autodiff
    # of the cast adds the psum a replicated initial state needs).
    S, lam, h0 = (match_varying(x, S, lam, h0) for x in (S, lam, jnp.broadcast_to(h0, S.shape)))
    exclusive = _pipeline(S, lam, h0, axis_name, nb, reverse)
  return exclusive, lam * exclusive + S


def _chain(axis_name, reverse):
  """(P, this rank's position along the chain, position -> device index)."""
  P = lax.axis_size(axis_name)
  idx = lax.axis_index(axis_name)
  if reverse:
    return P, P - 1 - idx, lambda c: P - 1 - c
  return P, idx, lambda c: c


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _pipeline(S, lam, h0, axis_name, nb, reverse):
  P, pos, dev = _chain(axis_name, reverse)
  return _pipeline_scan(S, lam, h0, axis_name, P, pos, dev, nb)


def _pipeline_fwd(S, lam, h0, axis_name, nb, reverse):
  X = _pipeline(S, lam, h0, axis_name, nb, reverse)
  return X, (X, lam)                # one state kept for the backward (spec section 3, 4.)


def _pipeline_bwd(axis_name, nb, reverse, residuals, dX):
  """The reverse All-Scan (spec section 5): the same pipelined chain, run the other way.

  With E_p the cotangent of the state leaving position p (X_{p+1}), E is the exclusive
  scan of dX in the opposite direction under the same decays; then dS_p = E_p,
  dlam_p = sum(X_p * E_p) and the initial state's cotangent is dX_0 + lam_0 * E_0.
  """
  X, lam = residuals
  E = _pipeline(dX, lam, jnp.zeros_like(dX), axis_name, nb, not reverse)
  _, pos, _ = _chain(axis_name, reverse)
  d_initial = jnp.where(pos == 0, dX + lam * E, 0.0)
  d_lam = X * E
  reduce = tuple(i for i, (a, b) in enumerate(zip(lam.shape, d_lam.shape)) if a == 1 and b != 1)
  return E, jnp.sum(d_lam, axis=reduce, keepdims=True), d_initial


_pipeline.defvjp(_pipeline_fwd, _pipeline_bwd)


def _pipeline_scan(S, lam, h0, axis_name, P, pos, dev, nb):
  """ZeCO's chain: at step s the rank at position c handles block j = s - c."""
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
    if s < nb + P - 2:
      out = lam * incoming + lax.dynamic_index_in_dim(S_b, jc, 0, keepdims=False)
      perm = [(dev(c), dev(c + 1)) for c in range(P - 1) if 0 <= s - c < nb]
      recv = lax.ppermute(out, axis_name, perm)
  return jnp.moveaxis(X_b, 0, -2).reshape(S.shape)


def _tree_scan(S, lam, h0, axis_name, P, pos, dev):
  """Recursive doubling on (a, S) pairs, then a one-hop shift to make it exclusive."""
  acc_S = jnp.where(pos == 0, lam * h0 + S, S)      # fold the initial state into position 0
  acc_a = lam
  d = 1
  while d < P:
    perm = [(dev(c), dev(c + d)) for c in range(P - d)]
    recv_S = lax.ppermute(acc_S, axis_name, perm)
    recv_a = lax.ppermute(acc_a, axis_name, perm)
    has = pos >= d
    acc_S = jnp.where(has, acc_a * recv_S + acc_S, acc_S)
    acc_a = jnp.where(has, recv_a * acc_a, acc_a)
    d *= 2
  shifted = lax.ppermute(acc_S, axis_name, [(dev(c), dev(c + 1)) for c in range(P - 1)])
  return jnp.where(pos == 0, jnp.broadcast_to(h0, S.shape), shifted)


def _all_gather_scan(S, lam, h0, axis_name, P, pos, dev):
  """LASP-2: gather every rank's (S, lam), fold the ones before this rank in chain order."""
  S_all = lax.all_gather(S, axis_name)
  lam_all = lax.all_gather(lam, axis_name)

  def fold(c, X):
    d = dev(c)
    X_next = lam_all[d] * X + S_all[d]
    return jnp.where(c < pos, X_next, X)

  return lax.fori_loop(0, P, fold, make_varying(jnp.broadcast_to(h0, S.shape), axis_name))
