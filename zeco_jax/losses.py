"""Losses for language-model heads that never materialise the ``[tokens, vocab]`` logits.

    from zeco_jax.losses import linear_cross_entropy
    nll_N, correct_N = linear_cross_entropy(h_NxD, w_VxD, targets_N, chunk_size=4096)

:func:`linear_cross_entropy` is the cross-entropy of the logits ``h @ w.T`` (an output
head, e.g. tied to the token embedding ``w``) computed ``chunk_size`` tokens at a time:
each chunk's logits are one matmul of the input dtype with float32 accumulation, reduced
to its log-sum-exp and target logit in float32, and dropped. The backward (a
``jax.custom_vjp``) recomputes each chunk's logits, forms ``softmax - onehot`` scaled by
the incoming gradient, casts it to the input dtype and does the two gradient matmuls in
that dtype (float32 accumulation; ``dw`` is accumulated over chunks in float32). So for
bf16 inputs every matmul is bf16, and the largest temporary is one chunk's float32 logits
(``chunk_size x vocab``) instead of the whole ``[N, vocab]`` array and its gradient. It
costs one more head matmul than the dense form (the recompute).

``correct`` (argmax of the logits == target, float32, no gradient) comes out of the same
pass, so accuracy needs no logits either. The reference it is tested against is
:func:`cross_entropy_reference` (dense float32 logits, ``jax.nn.log_softmax``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def cross_entropy_reference(h, w, targets):
  """Dense reference: float32 logits ``h @ w.T``; returns (nll, correct), both ``[N]``."""
  logits = jnp.einsum("nd,vd->nv", h.astype(jnp.float32), w.astype(jnp.float32))
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return nll, correct


def _check(h, w, targets, chunk_size):
  if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[1]:
    raise ValueError(f"linear_cross_entropy: h must be [N, D] and w [V, D] with the same D, "
                     f"got h {h.shape} and w {w.shape}")
  if targets.shape != h.shape[:1]:
    raise ValueError(f"linear_cross_entropy: targets must be [N] = {h.shape[:1]}, got "
                     f"{targets.shape}")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"linear_cross_entropy: targets must be integer, got {targets.dtype}")
  if chunk_size <= 0 or h.shape[0] % chunk_size:
    raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size} must be positive and "
                     f"divide the token count N={h.shape[0]}; pick a divisor of N (or N)")


def _logits(hc, w):
  return jax.lax.dot_general(hc, w, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _fwd_chunks(h, w, targets, chunk_size):
  N, D = h.shape
  V = w.shape[0]
  hs = h.reshape(N // chunk_size, chunk_size, D)
  ts = targets.reshape(N // chunk_size, chunk_size)

  def one(args):
    hc, tc = args
    logits = _logits(hc, w)                                   # [C, V] float32
    m = jnp.max(logits, axis=-1)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1))
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == tc[:, None]
    tgt = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    correct = (jnp.argmax(logits, axis=-1) == tc).astype(jnp.float32)
    return lse - tgt, correct, lse

  nll, correct, lse = jax.lax.map(one, (hs, ts))
  del V
  return nll.reshape(N), correct.reshape(N), lse.reshape(N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _lce(h, w, targets, chunk_size):
  nll, correct, _ = _fwd_chunks(h, w, targets, chunk_size)
  return nll, correct


def _lce_fwd(h, w, targets, chunk_size):
  nll, correct, lse = _fwd_chunks(h, w, targets, chunk_size)
  return (nll, correct), (h, w, targets, lse)


def _lce_bwd(chunk_size, res, cts):
  h, w, targets, lse = res
  g_nll = cts[0].astype(jnp.float32)             # correct has no gradient
  N, D = h.shape
  n = N // chunk_size
  xs = (h.reshape(n, chunk_size, D), targets.reshape(n, chunk_size),
        lse.reshape(n, chunk_size), g_nll.reshape(n, chunk_size))

  def one(dw, args):
    hc, tc, lc, gc = args
    logits = _logits(hc, w)
    p = jnp.exp(logits - lc[:, None])
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == tc[:, None]
    d = ((p - hit.astype(jnp.float32)) * gc[:, None]).astype(h.dtype)   # [C, V]
    dh = jax.lax.dot_general(d, w, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32).astype(h.dtype)
    dw = dw + jax.lax.dot_general(d, hc, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    return dw, dh

  dw, dh = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), xs)
  return dh.reshape(N, D), dw.astype(w.dtype), None


_lce.defvjp(_lce_fwd, _lce_bwd)


def linear_cross_entropy(h, w, targets, *, chunk_size: int = 4096):
  """Per-token cross-entropy of the logits ``h @ w.T``, ``chunk_size`` tokens at a time.

  Args:
    h: ``[N, D]`` hidden states (bf16 or float32).
    w: ``[V, D]`` output matrix (e.g. the tied embedding), cast to ``h``'s dtype.
    targets: ``[N]`` integer targets in ``[0, V)``.
    chunk_size: tokens per chunk; must divide N. Its float32 logits ``chunk_size x V``
      are the largest temporary.

  Returns:
    ``(nll, correct)``: float32 ``[N]`` negative log-likelihoods (differentiable in ``h``
    and ``w``) and argmax-equals-target indicators (no gradient).
  """
  _check(h, w, targets, chunk_size)
  return _lce(h, w.astype(h.dtype), targets.astype(jnp.int32), int(chunk_size))


@jax.custom_vjp
def embedding_lookup(table, ids):
  """``table[ids]`` whose gradient is a float32 scatter-add (then cast to the table's dtype).

  ``jnp.take``'s gradient scatters in the table's dtype; for a bf16 table on GPU that is an
  atomic compare-and-swap loop per element. Accumulating in float32 uses native atomics and
  adds repeated tokens in float32.
  """
  return jnp.take(table, ids, axis=0)


def _emb_fwd(table, ids):
  return jnp.take(table, ids, axis=0), (ids, table)   # the table is live anyway


def _emb_bwd(res, g):
  ids, table = res
  shape, dtype = table.shape, table.dtype
  # Scatter with ids as they come ([B, T], no flattening): a reshape merging a data-sharded
  # and a seq-sharded dim makes the SPMD partitioner all-gather ids and g over seq.
  acc = jnp.zeros(shape, jnp.float32).at[ids].add(g.astype(jnp.float32))
  return acc.astype(dtype), None


embedding_lookup.defvjp(_emb_fwd, _emb_bwd)

__all__ = ["cross_entropy_reference", "embedding_lookup", "linear_cross_entropy"]
