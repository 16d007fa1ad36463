"""Packed documents: ``segment_ids``, document starts, padding and FLA's ``cu_seqlens``.

Every GLA op takes ``segment_ids=None`` or an integer ``[B, T]`` array
(``docs/design.md`` §10):

* A document is a run of equal, non-negative ids. A new document starts at t = 0 and at
  every t > 0 where ``segment_ids[:, t] != segment_ids[:, t - 1]``; at a start t > 0 the
  state is reset to zero before token t writes into it (no state crosses documents).
* A negative id is padding: a token in no document. It writes nothing into the state
  (its key is zeroed), reads nothing (its output is zero), leaves the state unchanged
  (its decay is ignored) and gets zero gradients for q, k, v and g. The next non-padding
  token starts a new document, since its id differs.
* ``initial_state`` is the state before token 0, so it seeds the document holding token 0
  (one carried over from a previous call); every later document starts from zero. The
  final state is the state after token T - 1: the last document's (padding at the end of
  the row leaves it as the last document left it).

How the ops implement a start (``docs/design.md`` §10): the log-decay of a start token is
replaced by :data:`RESET_LOG_DECAY` before the chunked machinery sees it. Every decay
exponent there is a sum of log-decays over exactly the tokens it spans (never a
difference of cumulative sums, ``docs/design.md`` §2), so an exponent that spans a start
is <= -1e4 and its factor is exactly 0 in float32, and one that does not span it never
sees the sentinel: the kernels need no change.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

RESET_LOG_DECAY = -1e4
"""The log-decay given to a document's first token: exp of any sum that includes it
underflows to exactly 0 (float32 and float64), and it is finite, so a masked matmul that
forms a sum (0 * RESET_LOG_DECAY) stays 0 instead of NaN."""


def check_segment_ids(segment_ids, B, T, *, name: str):
  """ValueError (naming the argument, the value and the fix) unless ``[B, T]`` integer."""
  shape = tuple(getattr(segment_ids, "shape", ()))
  if shape != (B, T):
    raise ValueError(f"{name}: `segment_ids` must be [B, T] = [{B}, {T}] (one document id "
                     f"per token, q's batch and time), got shape {shape or segment_ids!r}. "
                     "Build it from FLA-style offsets with "
                     "zeco_jax.segments.cu_seqlens_to_segment_ids.")
  dtype = getattr(segment_ids, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{name}: `segment_ids` must be an integer array (int32: a document id "
                     f"per token, negative for padding), got dtype {dtype}. Cast it with "
                     ".astype(jnp.int32).")


def document_spans(ids_row):
  """``[(start, end)]`` of the documents of one row of ids, on the host (runs of equal
  non-negative ids; padding skipped): what the float64 per-document truths loop over."""
  row = np.asarray(ids_row)
  out, t = [], 0
  while t < len(row):
    e = t
    while e < len(row) and row[e] == row[t]:
      e += 1
    if row[t] >= 0:
      out.append((t, e))
    t = e
  return out


def padding_mask(segment_ids):
  """bool ``[B, T]``: True on padding (a negative id)."""
  return jnp.asarray(segment_ids) < 0


def document_starts(segment_ids):
  """bool ``[B, T]``: True on the first token of every document (t = 0 or an id change,
  never on padding)."""
  ids = jnp.asarray(segment_ids)
  changed = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
  return changed & (ids >= 0)


def resets(segment_ids, first=None):
  """bool ``[B, T]``: the starts where the state is reset (every start at t > 0).

  ``first``: bool ``[B]`` or None: whether token 0 itself is a reset (a shard of a longer
  row whose first token starts a document); None: it is not (token 0 continues the
  initial state).
  """
  starts = document_starts(segment_ids)
  head = jnp.zeros_like(starts[:, :1]) if first is None else (first[:, None] & starts[:, :1])
  return jnp.concatenate([head, starts[:, 1:]], axis=1)


def position_in_document(segment_ids):
  """int32 ``[B, T]``: tokens since the start of the token's document (0 on a start);
  on padding, tokens since the padding began. Token 0 is position 0."""
  ids = jnp.asarray(segment_ids)
  T = ids.shape[1]
  t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), ids.shape)
  run_start = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
  last = jax.lax.cummax(jnp.where(run_start, t, 0), axis=1)
  return t - last


def cu_seqlens_to_segment_ids(cu_seqlens, total_len: int):
  """FLA-style varlen offsets to ``segment_ids`` ``[1, total_len]`` int32.

  ``cu_seqlens`` ``[N + 1]``: 0, then the cumulative document lengths (FLA's ``cu_seqlens``
  for sequences packed into one row of ``[1, total_len, H, D]``). Document n covers tokens
  ``[cu_seqlens[n], cu_seqlens[n + 1])`` and gets id n; tokens from ``cu_seqlens[-1]`` to
  ``total_len`` are padding (id -1). Empty documents (repeated offsets) take no tokens.
  Concrete offsets are checked (start at 0, nondecreasing, last <= total_len); traced
  ones are not.
  """
  name = "cu_seqlens_to_segment_ids"
  if not isinstance(total_len, (int, np.integer)) or isinstance(total_len, bool) or total_len < 1:
    raise ValueError(f"{name}: `total_len` must be a positive int (the packed row's length "
                     f"T), got {total_len!r}.")
  if getattr(cu_seqlens, "ndim", np.ndim(cu_seqlens)) != 1 or np.shape(cu_seqlens)[0] < 1:
    raise ValueError(f"{name}: `cu_seqlens` must be 1-D [N + 1] (0, then cumulative "
                     f"document lengths), got shape {np.shape(cu_seqlens)}.")
  if not isinstance(cu_seqlens, jax.core.Tracer):
    cu = np.asarray(cu_seqlens)
    if not np.issubdtype(cu.dtype, np.integer):
      raise ValueError(f"{name}: `cu_seqlens` must be integers, got dtype {cu.dtype}.")
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > total_len:
      raise ValueError(f"{name}: `cu_seqlens` must start at 0, never decrease and end at "
                       f"most at total_len = {total_len}, got {cu.tolist()}. Pass the "
                       "cumulative lengths [0, len_0, len_0 + len_1, ...].")
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  t = jnp.arange(total_len, dtype=jnp.int32)
  ids = jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1
  return jnp.where(t < cu[-1], ids, -1)[None, :]


def apply(q, k, g, segment_ids, *, first=None):
  """The op's inputs with the documents applied (``docs/design.md`` §10).

  q and k are zeroed on padding; g (None, ``[B, T, H]`` or ``[B, T, H, K]``) becomes
  float32 with :data:`RESET_LOG_DECAY` at every reset (see :func:`resets`; ``first`` as
  there) and 0 on padding; a None g becomes a scalar ``[B, T, H]`` decay that is 0 except
  at the resets. The masks are ``jnp.where``s, so the gradients at the masked tokens are
  zero. Returns ``(q, k, g)``.
  """
  B, T, H = q.shape[:3]
  pad = padding_mask(segment_ids)
  reset = resets(segment_ids, first)
  keep = ~pad[:, :, None, None]
  q = jnp.where(keep, q, jnp.zeros((), q.dtype))
  k = jnp.where(keep, k, jnp.zeros((), k.dtype))
  g = jnp.zeros((B, T, H), jnp.float32) if g is None else g.astype(jnp.float32)
  expand = (lambda m: m[:, :, None]) if g.ndim == 3 else (lambda m: m[:, :, None, None])
  g = jnp.where(expand(pad), 0.0, g)
  g = jnp.where(expand(reset), RESET_LOG_DECAY, g)
  return q, k, g


def reset_first_token(g, reset):
  """g (float32, from :func:`apply`) with :data:`RESET_LOG_DECAY` on token 0 of the rows
  where ``reset`` (bool ``[B]``) holds: a shard whose first token starts a document."""
  first = jnp.where(reset.reshape((-1,) + (1,) * (g.ndim - 2)), RESET_LOG_DECAY, g[:, 0])
  return g.at[:, 0].set(first)


def delta_float64_documents(truth, q, k, v, g, beta, h0, do, dht, segment_ids, scale=None):
  """A delta-rule family's float64 truth ``truth(q, k, v, g, beta, h0, do, dht, scale) ->
  (o, final, grads)`` run document by document (packed rows, docs/design.md §10): every
  document starts from zero except the one holding token 0 (from h0); negative ids are
  padding (output 0, zero gradients); the final state is the last document's."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, g, beta, do, dht = map(f, (q, k, v, g, beta, do, dht))
  ids = np.asarray(segment_ids)
  B, T, H, K = q.shape
  scale = K ** -0.5 if scale is None else scale
  o = np.zeros(v.shape)
  final = np.zeros((B, H, K, v.shape[-1])) if h0 is None else f(h0).copy()
  grads = {n: np.zeros_like(x) for n, x in zip("q k v g beta".split(), (q, k, v, g, beta))}
  if h0 is not None:
    grads["h0"] = np.zeros(final.shape)
  for b in range(B):
    docs = document_spans(ids[b])
    for n, (s, e) in enumerate(docs):
      last = n == len(docs) - 1
      seeded = h0 is not None and s == 0
      sl = lambda x: x[b:b + 1, s:e]
      start = f(h0)[b:b + 1] if seeded else None
      d_final = dht[b:b + 1] if last else np.zeros((1,) + dht.shape[1:])
      o_d, fin, gr = truth(*(sl(x) for x in (q, k, v, g, beta)), start, sl(do), d_final,
                           scale)
      o[b, s:e] = o_d[0]
      if last:
        final[b] = fin[0]
      for nm in "q k v g beta".split():
        grads[nm][b, s:e] = gr[nm][0]
      if seeded:
        grads["h0"][b] = gr["h0"][0]
    if not docs and h0 is not None:
      grads["h0"][b] = dht[b]
  return o, final, grads
