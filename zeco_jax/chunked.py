"""The chunked GLA algorithm in plain jnp: forward and explicit backward (``docs/design.md`` §2).

This is the ``backend="jax"`` path of :func:`zeco_jax.chunk_gla` and the template the
Pallas kernels follow stage by stage:

  forward:  state pass (chunk states h[n], final state)  ->  output (inter + intra chunk)
  backward: state-gradient pass (reverse over chunks)    ->  dq, dk, dv, dg

Layout inside this module is head-major chunks, ``[B, H, N, C, D]``; the public layout
``[B, T, H, D]`` is converted once at entry. ``T`` must be a multiple of ``chunk_size``
(:func:`zeco_jax.chunk_gla` pads). All math is float32. The log-decay g is per-dim
``[B, T, H, K]``, per-head scalar ``[B, T, H]`` (broadcast over K here: no specialised
scalar path) or None (no decay); its gradient comes back in the same shape.

Stability: a chunk's cumulative log-decay ``b`` can reach -5 * 64 = -320, so ``exp(-b)``
overflows. Every exponent used here is a difference that is <= 0: the intra-chunk scores
use 16-token sub-chunks, each with a reference row (both factors <= 1), and the diagonal
sub-chunk blocks use exact pairwise decays in log space.

Memory: the backward recomputes the chunk states instead of saving them, so what lives
between forward and backward is the inputs alone: O(T * (K + V)) per head.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from zeco_jax._vma import match_varying

_HI = lax.Precision.HIGHEST
SUB_CHUNK = 16


def _ein(eq, *xs):
  return jnp.einsum(eq, *xs, precision=_HI, preferred_element_type=jnp.float32)


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


class _IntraDecay:
  """Decay factors for the intra-chunk pair terms ``exp(b_r - b_i)``, i <= r.

  Rows are split into sub-chunks ``a`` of S tokens with reference ``ref_a = b`` at the
  sub-chunk's first row. For i before sub-chunk a the decay factors as
  ``exp(b_r - ref_a) * exp(ref_a - b_i)`` (``q_fac``, ``k_fac``, both <= 1); inside the
  sub-chunk it is taken exactly (``diag``, [.., Ns, S, S, K]).
  """

  def __init__(self, b):
    *lead, C, K = b.shape
    S = _sub(C)
    Ns = C // S
    self.S, self.Ns, self.C = S, Ns, C
    b_sub = b.reshape(*lead, Ns, S, K)
    ref = b_sub[..., :1, :]                                      # [.., Ns, 1, K]
    self.q_fac = jnp.exp(b_sub - ref)                            # [.., Ns, S, K]
    before = (jnp.arange(C)[None, :] < (jnp.arange(Ns) * S)[:, None])   # [Ns, C]
    k_exp = jnp.where(before[:, :, None], ref - b[..., None, :, :], -jnp.inf)
    self.k_fac = jnp.exp(k_exp)                                  # [.., Ns, C, K]
    causal = jnp.tril(jnp.ones((S, S), bool))
    diff = b_sub[..., :, None, :] - b_sub[..., None, :, :]       # [.., Ns, S, S, K]
    self.diag = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))
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
    diag = _ein("...ask,...ajk,...asjk->...asj", qs, ks, self.diag)
    full = off.reshape(*off.shape[:-3], self.Ns, self.S, self.Ns, self.S)
    full = full + diag[..., :, :, None, :] * self.eye[:, None, :, None]
    return full.reshape(*off.shape[:-3], self.C, self.C)

  def row_side(self, dA, k):
    """sum_i dA[r, i] k_i exp(b_r - b_i): the gradient for the row operand, [.., C, K]."""
    ks = self.split_rows(k)
    dA_rows = dA.reshape(*dA.shape[:-2], self.Ns, self.S, self.C)
    off = _ein("...asi,...aik->...ask", dA_rows, k[..., None, :, :] * self.k_fac) * self.q_fac
    diag = _ein("...asj,...ajk,...asjk->...ask", self.diag_blocks(dA), ks, self.diag)
    return (off + diag).reshape(k.shape)

  def col_side(self, dA, q):
    """sum_r dA[r, i] q_r exp(b_r - b_i): the gradient for the column operand, [.., C, K]."""
    qs = self.split_rows(q)
    dA_rows = dA.reshape(*dA.shape[:-2], self.Ns, self.S, self.C)
    off = _ein("...asi,...ask,...aik->...ik", dA_rows, qs * self.q_fac, self.k_fac)
    diag = _ein("...asj,...ask,...asjk->...ajk", self.diag_blocks(dA), qs, self.diag)
    return off + diag.reshape(q.shape)


def state_pass(kc, vc, b, h0):
  """States entering each chunk and the final state.

  Args: kc [B,H,N,C,K], vc [B,H,N,C,V], b chunk-local cumulative log-decay [B,H,N,C,K],
    h0 [B,H,K,V]. Returns (h [B,H,N,K,V] entering each chunk, final [B,H,K,V]).
  """
  b_last = b[..., -1:, :]
  increment = _ein("bhnik,bhniv->bhnkv", kc * jnp.exp(b_last - b), vc)
  decay = jnp.exp(b_last[..., 0, :])                              # [B, H, N, K]

  def step(h, xs):
    dec, inc = xs
    return dec[..., None] * h + inc, h

  h0 = match_varying(h0, increment, decay)
  final, h = lax.scan(step, h0, (jnp.moveaxis(decay, 2, 0), jnp.moveaxis(increment, 2, 0)))
  return jnp.moveaxis(h, 0, 2), final


def state_grad_pass(qc, doc, b, dht, scale):
  """Cotangents of the states leaving each chunk, and of the initial state (reverse scan).

  dH[N-1] = dht;  dH[n-1] = exp(b_last[n]) * dH[n] + scale * (q e^b)[n]^T do[n].
  Returns (dH [B,H,N,K,V], dh0 [B,H,K,V]).
  """
  local = scale * _ein("bhnrk,bhnrv->bhnkv", qc * jnp.exp(b), doc)
  decay = jnp.exp(b[..., -1, :])

  def step(dh, xs):
    dec, loc = xs
    return dec[..., None] * dh + loc, dh

  dht = match_varying(dht, local, decay)
  dh0, dH = lax.scan(step, dht, (jnp.moveaxis(decay, 2, 0), jnp.moveaxis(local, 2, 0)),
                     reverse=True)
  return jnp.moveaxis(dH, 0, 2), dh0


def _decay_chunks(g, shape, C):
  """g ([B,T,H,K], [B,T,H] or None) as float32 chunks [B,H,N,C,K]."""
  if g is None:
    g = jnp.zeros(shape, jnp.float32)
  elif g.ndim == 3:
    g = jnp.broadcast_to(g.astype(jnp.float32)[..., None], shape)
  return to_chunks(g, C)


def fwd(q, k, v, g, *, scale, initial_state, chunk_size):
  """Forward. q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K], [B,T,H] or None; T % chunk_size == 0.

  Returns (o [B,T,H,V] in v's dtype, final_state float32 [B,H,K,V]).
  """
  C = chunk_size
  qc, kc, vc = (to_chunks(x, C) for x in (q, k, v))
  gc = _decay_chunks(g, q.shape, C)
  b = jnp.cumsum(gc, axis=-2)
  h, final = state_pass(kc, vc, b, initial_state.astype(jnp.float32))
  intra = _IntraDecay(b)
  o = scale * (_ein("bhnrk,bhnkv->bhnrv", qc * jnp.exp(b), h)
               + _ein("bhnri,bhniv->bhnrv", intra.scores(qc, kc), vc))
  return from_chunks(o, v.dtype), final


def bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size):
  """Backward of :func:`fwd`. Returns (dq, dk, dv, dg float32 in g's shape or None,
  dh0 float32)."""
  C = chunk_size
  qc, kc, vc, doc = (to_chunks(x, C) for x in (q, k, v, do))
  gc = _decay_chunks(g, q.shape, C)
  b = jnp.cumsum(gc, axis=-2)
  h, _ = state_pass(kc, vc, b, initial_state.astype(jnp.float32))
  dH, dh0 = state_grad_pass(qc, doc, b, dht.astype(jnp.float32), scale)
  intra = _IntraDecay(b)
  causal = jnp.tril(jnp.ones((C, C), bool))
  scores = intra.scores(qc, kc)
  dA = jnp.where(causal, scale * _ein("bhnrv,bhniv->bhnri", doc, vc), 0.0)
  b_last = b[..., -1:, :]
  k_to_end = jnp.exp(b_last - b)                                   # [B,H,N,C,K], <= 1
  dq = scale * _ein("bhnrv,bhnkv->bhnrk", doc, h) * jnp.exp(b) + intra.row_side(dA, kc)
  dk_state = _ein("bhniv,bhnkv->bhnik", vc, dH) * k_to_end
  dk = intra.col_side(dA, qc) + dk_state
  dv = (scale * _ein("bhnri,bhnrv->bhniv", scores, doc)
        + _ein("bhnik,bhnkv->bhniv", kc * k_to_end, dH))
  # d(loss)/d(b): +q*dq for every exp(+b_r), -k*dk for every exp(-b_i), and the chunk's
  # total decay b_last (through exp(b_last) h and the state increments) on the last row.
  db = qc * dq - kc * dk
  d_last = jnp.exp(b_last[..., 0, :]) * jnp.sum(h * dH, axis=-1) + jnp.sum(kc * dk_state, axis=-2)
  db = db.at[..., -1, :].add(d_last)
  dg = from_chunks(jnp.flip(jnp.cumsum(jnp.flip(db, -2), axis=-2), -2), jnp.float32)
  if g is None:
    dg = None
  elif g.ndim == 3:
    dg = jnp.sum(dg, axis=-1)
  return (from_chunks(dq, q.dtype), from_chunks(dk, k.dtype), from_chunks(dv, v.dtype), dg,
          dh0)
