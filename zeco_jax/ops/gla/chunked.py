"""The chunked GLA algorithm in plain jnp: forward and explicit backward (``docs/design.md`` §2).

This is the ``backend="jax"`` path of :func:`zeco_jax.chunk_gla` (``fwd`` / ``bwd``, and
``fwd_res`` / ``bwd_res`` with no residual of their own) and the template the Pallas
kernels follow stage by stage:

  forward:  state pass (chunk states h[n], final state)  ->  output (inter + intra chunk)
  backward: state-gradient pass (reverse over chunks)    ->  dq, dk, dv, dg

Layout inside this module is head-major chunks, ``[B, H, N, C, D]``; the public layout
``[B, T, H, D]`` is converted once at entry. ``T`` must be a multiple of ``chunk_size``
(:func:`zeco_jax.chunk_gla` pads). All math is float32. The log-decay g is per-dim
``[B, T, H, K]``, per-head scalar ``[B, T, H]`` or None (no decay); a scalar or absent decay
keeps K = 1 in every decay factor (they broadcast over K), so its exponents cost 1/K of
the per-dim ones. Its gradient comes back in g's shape.

Stability: a chunk's cumulative log-decay ``b`` can reach -5 * 64 = -320, so ``exp(-b)``
overflows. Every exponent used here is <= 0: the intra-chunk scores use 16-token
sub-chunks, each with a reference row (both factors <= 1), and the diagonal sub-chunk
blocks use exact pairwise decays in log space. Precision: no exponent is a difference of
two cumulative sums (``b_r - b_i`` cancels in float32 when the chunk holds a large
log-decay such as -1e4); each is a sum of same-sign g's over the interval it spans, built
from sub-chunk prefixes, suffixes and totals (:class:`_ChunkDecay`), so the op is exact to
float32 for any mix of per-token log-decays in [-1e4, 0].

Memory: the backward recomputes the chunk states instead of saving them, so what lives
between forward and backward is the inputs alone: O(T * (K + V)) per head.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from zeco_jax._linalg import ein as _ein
from zeco_jax._linalg import opaque
from zeco_jax._vma import match_varying

SUB_CHUNK = 16


def to_chunks(x, C):
  """[B, T, H, D] -> float32 [B, H, N, C, D]."""
  B, T, H, D = x.shape
  return x.astype(jnp.float32).reshape(B, T // C, C, H, D).transpose(0, 3, 1, 2, 4)


def from_chunks(x, dtype):
  """[B, H, N, C, D] -> [B, T, H, D] in ``dtype``."""
  B, H, N, C, D = x.shape
  return x.transpose(0, 2, 3, 1, 4).reshape(B, N * C, H, D).astype(dtype)


def _sub(C):
  return SUB_CHUNK if C % SUB_CHUNK == 0 else C


def rev_cumsum(x, axis):
  """Inclusive reverse cumsum as a true reverse sum (flip, cumsum, flip): never
  ``total - cumsum + x``, which cancels when one term dominates."""
  return jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis=axis), axis)


class _ChunkDecay:
  """Every decay factor of a chunk, each exponent a sum of same-sign log-decays.

  All g <= 0, so a sum of g's over an interval is exact to a few ulps of itself; a
  difference of two chunk cumsums ``b_r - b_i`` is not (absolute error ~ eps * |b|, 1e-3
  with a -1e4 token in the chunk). So no exponent here is formed as a difference. Per
  16-token sub-chunk a (tokens r, i inside it):

    p_r   = sum of g over [start of a, r]        (inclusive prefix in the sub-chunk)
    s_i   = sum of g over (i, end of a]          (exclusive suffix, a true reverse cumsum)
    tot_a = sum of g over the sub-chunk
    mid[a, c] = sum of tot over the sub-chunks strictly between c and a (a masked sum over
      the few sub-chunks; c = -1 is "before the chunk", a = Ns "after the chunk")

  and then, with c(i) the sub-chunk of i:

    b_r       = mid[a, -1] + p_r                 (from the chunk start: ``exp_b``)
    b_C - b_i = s_i + mid[Ns, c(i)]              (to the chunk end: ``to_end``)
    b_C       = mid[Ns, -1]                      (the chunk's decay: ``total``)
    b_r - b_i = p_r + mid[a, c(i)] + s_i         (c(i) < a: ``q_fac`` * ``k_fac``, both <= 1)
    b_r - b_i = sum of g over (i, r]             (same sub-chunk: ``diag``, grown row by row)

  Shapes: g ``[.., C, K]``; exp_b, to_end ``[.., C, K]``; total ``[.., K]``; q_fac
  ``[.., Ns, S, K]``; k_fac ``[.., Ns, C, K]`` (the reference row of sub-chunk a is the
  row before it); diag ``[.., Ns, S, S, K]``. K may be 1 (a scalar decay): every factor
  then broadcasts over the head dim.
  """

  def __init__(self, g):
    *lead, C, K = g.shape
    S = _sub(C)
    Ns = C // S
    self.S, self.Ns, self.C = S, Ns, C
    gs = g.reshape(*lead, Ns, S, K)
    p = jnp.cumsum(gs, axis=-2)
    g_next = jnp.concatenate([gs[..., 1:, :], jnp.zeros_like(gs[..., :1, :])], axis=-2)
    s = rev_cumsum(g_next, -2)
    tot = p[..., -1, :]                                          # [.., Ns, K]
    # mid[a, c + 1] = sum_{c < a' < a} tot[a'] for a in 0..Ns, c in -1..Ns-1.
    a = jnp.arange(Ns + 1)[:, None, None]
    c = jnp.arange(-1, Ns)[None, :, None]
    a2 = jnp.arange(Ns)[None, None, :]
    between = ((c < a2) & (a2 < a)).astype(jnp.float32)          # [Ns+1, Ns+1, Ns]
    mid = _ein("acx,...xk->...ack", between, tot)
    self.exp_b = jnp.exp(mid[..., :Ns, 0:1, :] + p).reshape(*lead, C, K)
    self.to_end = jnp.exp(s + mid[..., Ns, 1:, None, :]).reshape(*lead, C, K)
    self.total = jnp.exp(mid[..., Ns, 0, :])                     # [.., K]
    self.q_fac = jnp.exp(p)
    earlier = jnp.arange(Ns)[None, :] < jnp.arange(Ns)[:, None]  # [a, c]: c < a
    k_exp = jnp.where(earlier[:, :, None, None], s[..., None, :, :, :] + mid[..., :Ns, 1:, None, :],
                      -jnp.inf)                                  # [.., Ns, Ns, S, K]
    self.k_fac = jnp.exp(k_exp).reshape(*lead, Ns, C, K)
    # inside[r, i] = sum_j [i < j <= r] g_j, row r = row r-1 + g_r on columns i < r: a sum
    # grown one g at a time (XLA fuses the S steps into one elementwise loop).
    ar = jnp.arange(S)
    rows, acc = [], jnp.zeros(gs.shape, jnp.float32)
    for r in range(S):
      acc = acc + jnp.where((r > ar)[:, None], gs[..., r:r + 1, :], 0.0)
      rows.append(acc)
    inside = jnp.stack(rows, axis=-3)                            # [.., Ns, S(r), S(i), K]
    causal = jnp.tril(jnp.ones((S, S), bool))
    self.diag = jnp.exp(jnp.where(causal[:, :, None], inside, -jnp.inf))
    self.eye = jnp.eye(Ns, dtype=jnp.float32)

  def split_rows(self, x):
    return x.reshape(*x.shape[:-2], self.Ns, self.S, x.shape[-1])

  def diag_blocks(self, m):
    """[.., C, C] -> its diagonal S x S blocks [.., Ns, S, S]."""
    m = m.reshape(*m.shape[:-2], self.Ns, self.S, self.Ns, self.S)
    return _ein("...asbj,ab->...asj", m, self.eye)

  def scores(self, q, k):
    """A[r, i] = sum_k q_r k_i exp(b_r - b_i) for i <= r, else 0: [.., C, C]."""
    qs, ks = self.split_rows(q), self.split_rows(k)
    off = _ein("...ask,...aik->...asi", qs * self.q_fac, k[..., None, :, :] * self.k_fac)
    if self.diag.shape[-1] == 1:
      diag = _ein("...ask,...ajk->...asj", qs, ks) * self.diag[..., 0]
    else:
      diag = _ein("...ask,...ajk,...asjk->...asj", qs, ks, self.diag)
    full = off.reshape(*off.shape[:-3], self.Ns, self.S, self.Ns, self.S)
    full = full + diag[..., :, :, None, :] * self.eye[:, None, :, None]
    return full.reshape(*off.shape[:-3], self.C, self.C)

  def row_side(self, dA, k):
    """sum_i dA[r, i] k_i exp(b_r - b_i): the gradient for the row operand, [.., C, K]."""
    ks = self.split_rows(k)
    dA_rows = dA.reshape(*dA.shape[:-2], self.Ns, self.S, self.C)
    off = _ein("...asi,...aik->...ask", dA_rows, k[..., None, :, :] * self.k_fac) * self.q_fac
    if self.diag.shape[-1] == 1:
      diag = _ein("...asj,...ajk->...ask", self.diag_blocks(dA) * self.diag[..., 0], ks)
    else:
      diag = _ein("...asj,...ajk,...asjk->...ask", self.diag_blocks(dA), ks, self.diag)
    return (off + diag).reshape(k.shape)

  def col_side(self, dA, q):
    """sum_r dA[r, i] q_r exp(b_r - b_i): the gradient for the column operand, [.., C, K]."""
    qs = self.split_rows(q)
    dA_rows = dA.reshape(*dA.shape[:-2], self.Ns, self.S, self.C)
    off = _ein("...asi,...ask,...aik->...ik", dA_rows, qs * self.q_fac, self.k_fac)
    if self.diag.shape[-1] == 1:
      diag = _ein("...asj,...ask->...ajk", self.diag_blocks(dA) * self.diag[..., 0], qs)
    else:
      diag = _ein("...asj,...ask,...asjk->...ajk", self.diag_blocks(dA), qs, self.diag)
    return off + diag.reshape(q.shape)


def state_pass(kc, vc, dec, h0):
  """States entering each chunk and the final state.

  Args: kc [B,H,N,C,K], vc [B,H,N,C,V], dec the chunks' :class:`_ChunkDecay`,
    h0 [B,H,K,V] or None (zero). Returns (h [B,H,N,K,V] entering each chunk, final
    [B,H,K,V]); h is None when nothing enters any chunk (one chunk, no h0): the callers
    then drop the terms it would multiply (:func:`_known_zero` says why).
  """
  increment = _ein("bhnik,bhniv->bhnkv", kc * dec.to_end, vc)
  if _known_zero(h0, kc):
    return None, increment[:, :, 0]

  def step(h, xs):
    d, inc = xs
    return d[..., None] * h + inc, h

  h0 = _initial(h0, increment, dec.total)
  final, h = lax.scan(step, h0, (jnp.moveaxis(dec.total, 2, 0), jnp.moveaxis(increment, 2, 0)))
  return jnp.moveaxis(h, 0, 2), final


def state_grad_pass(qc, doc, dec, dht, scale):
  """Cotangents of the states leaving each chunk, and of the initial state (reverse scan).

  dH[N-1] = dht;  dH[n-1] = exp(b_C[n]) * dH[n] + scale * (q e^b)[n]^T do[n]. ``dht``
  None: zero. Returns (dH [B,H,N,K,V] or None when it is zero: one chunk and no dht,
  dh0 [B,H,K,V]).
  """
  local = scale * _ein("bhnrk,bhnrv->bhnkv", qc * dec.exp_b, doc)
  if _known_zero(dht, qc):
    return None, local[:, :, 0]

  def step(dh, xs):
    d, loc = xs
    return d[..., None] * dh + loc, dh

  dht = _initial(dht, local, dec.total)
  dh0, dH = lax.scan(step, dht, (jnp.moveaxis(dec.total, 2, 0), jnp.moveaxis(local, 2, 0)),
                     reverse=True)
  return jnp.moveaxis(dH, 0, 2), dh0


def _known_zero(state, chunks) -> bool:
  """Whether the state at the sequence's open end is absent (zero) with one chunk only.

  Then nothing is computed from it. Not a shortcut but a workaround: XLA:CPU miscompiles a
  dot whose operand is a broadcast constant when a reduce shares its fusion
  (``docs/xla_cpu_ynn.md``), and with one chunk the scan is inlined, so a zero state would
  reach the output's dot as exactly that constant.
  """
  return state is None and chunks.shape[2] == 1


def _initial(state, like, decay):
  """The walk's first carry: zeros for None; every state behind an optimization barrier
  (``zeco_jax._linalg.opaque``: a constant state given by the caller, one chunk)."""
  if state is None:
    state = jnp.zeros(like.shape[:2] + like.shape[3:], jnp.float32)
  return opaque(match_varying(state, like, decay))


def _decay_chunks(g, shape, C):
  """g ([B,T,H,K], [B,T,H] or None) as float32 chunks [B,H,N,C,K], K = 1 unless per-dim."""
  if g is None:
    g = jnp.zeros((*shape[:-1], 1), jnp.float32)
  elif g.ndim == 3:
    g = g[..., None]
  return to_chunks(g, C)


def fwd(q, k, v, g, *, scale, initial_state, chunk_size):
  """Forward. q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K], [B,T,H] or None; T % chunk_size == 0;
  initial_state float32 [B,H,K,V] or None (zeros).

  Returns (o [B,T,H,V] in v's dtype, final_state float32 [B,H,K,V]).
  """
  C = chunk_size
  qc, kc, vc = (to_chunks(x, C) for x in (q, k, v))
  dec = _ChunkDecay(_decay_chunks(g, q.shape, C))
  h, final = state_pass(kc, vc, dec, _as_f32(initial_state))
  o = _ein("bhnri,bhniv->bhnrv", dec.scores(qc, kc), vc)
  if h is not None:
    o = o + _ein("bhnrk,bhnkv->bhnrv", qc * dec.exp_b, h)
  return from_chunks(scale * o, v.dtype), final


def _as_f32(x):
  return None if x is None else x.astype(jnp.float32)


def bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size):
  """Backward of :func:`fwd`; ``dht`` (the final state's cotangent) may be None (zero).
  Returns (dq, dk, dv, dg float32 in g's shape or None, dh0 float32)."""
  C = chunk_size
  qc, kc, vc, doc = (to_chunks(x, C) for x in (q, k, v, do))
  dec = _ChunkDecay(_decay_chunks(g, q.shape, C))
  h, _ = state_pass(kc, vc, dec, _as_f32(initial_state))
  dH, dh0 = state_grad_pass(qc, doc, dec, _as_f32(dht), scale)
  causal = jnp.tril(jnp.ones((C, C), bool))
  scores = dec.scores(qc, kc)
  dA = jnp.where(causal, scale * _ein("bhnrv,bhniv->bhnri", doc, vc), 0.0)
  dq = dec.row_side(dA, kc)
  if h is not None:
    dq = dq + scale * _ein("bhnrv,bhnkv->bhnrk", doc, h) * dec.exp_b
  dk = dec.col_side(dA, qc)
  dv = scale * _ein("bhnri,bhnrv->bhniv", scores, doc)
  # d(loss)/d(b) with b the chunk cumsum: +q*dq for every exp(+b_r), -k*dk for every
  # exp(-b_i), and the chunk's total decay b_C (through exp(b_C) h and the state
  # increments) on the last row; dg is its reverse cumsum (a true one: rev_cumsum).
  d_last = 0.0
  if dH is not None:
    dk_state = _ein("bhniv,bhnkv->bhnik", vc, dH) * dec.to_end
    dk = dk + dk_state
    dv = dv + _ein("bhnik,bhnkv->bhniv", kc * dec.to_end, dH)
    d_last = jnp.sum(kc * dk_state, axis=-2)
    if h is not None:
      d_last = d_last + dec.total * jnp.sum(h * dH, axis=-1)
  db = qc * dq - kc * dk
  if dH is not None:
    db = db.at[..., -1, :].add(d_last)
  dg = from_chunks(rev_cumsum(db, -2), jnp.float32)
  if g is None:
    dg = None
  elif g.ndim == 3:
    dg = jnp.sum(dg, axis=-1)
  return (from_chunks(dq, q.dtype), from_chunks(dk, k.dtype), from_chunks(dv, v.dtype), dg,
          dh0)


def fwd_res(q, k, v, g, **kwargs):
  """:func:`fwd` and no residual of its own: the backward recomputes from the inputs."""
  return fwd(q, k, v, g, **kwargs), None


def bwd_res(residual, q, k, v, g, do, dht, **kwargs):
  """:func:`bwd` (``residual`` is :func:`fwd_res`'s None)."""
  del residual
  return bwd(q, k, v, g, do, dht, **kwargs)
