"""Gated DeltaNet's chunked form (WY / UT representation, as in the Gated DeltaNet paper
and FLA) in plain jnp, with a custom_vjp that keeps the inputs and one state per chunk,
never a state per token.

Per chunk of C tokens (``docs/design.md`` §9): with b the within-chunk cumulative
log-decay, every chunk reduces to four arrays computed chunk-parallel by
:func:`chunk_terms`: ``Qeff [C, K]``, the chunk transition ``M [K, K]``, the chunk's own
state ``Sc [K, V]`` and its own outputs ``Oc [C, V]``, such that a chunk entered with
state ``Y`` leaves with ``M Y + Sc`` and outputs ``Oc + Qeff Y``. The only sequential part
is that recurrence over chunks (:func:`chunk_recurrence`). Every exponent is a sum of g
over the tokens it spans (a segment sum, never the difference of two cumulative sums and
never positive), so decays down to g = -5 per token (-320 over a 64-token chunk) are
exact to float32 rounding.

:func:`chunk_recurrence` with ``augment=True`` also carries the prefix products of the
chunk transitions (the state widened by K columns that start as the identity): that gives
the segment's transition and the per-token fix-up rows the sequence-parallel op needs
(:mod:`zeco_jax.ops.gated_delta.parallel`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from zeco_jax._linalg import HI as _HI
from zeco_jax._linalg import opaque
from zeco_jax._vma import match_varying


def _to_chunks(x, C):
  """``[B, T, H, ...]`` -> float32 ``[B, H, N, C, ...]``, the tail zero-padded to N C."""
  T = x.shape[1]
  pad = -T % C
  x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = jnp.moveaxis(x, 2, 1)                                   # [B, H, T', ...]
  return x.reshape(x.shape[:2] + ((T + pad) // C, C) + x.shape[3:])


def _from_chunks(x, T):
  """``[B, H, N, C, D]`` -> ``[B, T, H, D]``."""
  B, H, N, C, D = x.shape
  return jnp.moveaxis(x.reshape(B, H, N * C, D), 1, 2)[:, :T]


def _segment_sums(g):
  """``out[i, j] = sum_{j < m <= i} g_m`` for i >= j (an exact sum, <= 0), 0 above the
  diagonal (masked by the caller): the log of the decay from token j to token i."""
  C = g.shape[-1]
  later = jnp.tril(jnp.ones((C, C), bool), -1)             # m > j
  spread = jnp.where(later, g[..., :, None], 0.0)          # [.., m, j]
  return jnp.cumsum(spread, axis=-2)                        # sum over m <= i


def _masked_exp(x, mask):
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


def chunk_terms(q, k, v, g, beta, scale):
  """Per-chunk arrays of the WY / UT form, chunk-parallel (docs/design.md §9).

  Inputs float32 ``[B, H, N, C, ...]``. With ``Ga[i, j]`` the decay from token j to i,
  ``A = strict_lower(beta_i Ga[i, j] k_i . k_j)`` and ``T = (I + A)^{-1}`` (the UT
  transform): ``W = T diag(beta e^b) k`` and ``U = T diag(beta) v`` (the WY factors), so
  the chunk's pseudo-values are ``U - W Y`` for entering state Y. Returns
  ``(Qeff [.., C, K], M [.., K, K], Sc [.., K, V], Oc [.., C, V])``.
  """
  C, K = k.shape[-2], k.shape[-1]
  seg = _segment_sums(g)                                    # [.., C, C]
  incl = jnp.tril(jnp.ones((C, C), bool))
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  decay_strict, decay_incl = _masked_exp(seg, strict), _masked_exp(seg, incl)
  from_start = jnp.exp(jnp.cumsum(g, -1))                   # e^{b_i}: decay since chunk start
  to_end = jnp.exp(seg[..., -1, :])                         # e^{b_C - b_j}: decay to chunk end
  kk = jnp.einsum("...ik,...jk->...ij", k, k, precision=_HI)
  A = beta[..., :, None] * decay_strict * kk
  rhs = jnp.concatenate([(beta * from_start)[..., None] * k, beta[..., None] * v], -1)
  WU = jnp.einsum("...ij,...jc->...ic", unit_lower_inverse(A), rhs, precision=_HI)
  W, U = WU[..., :K], WU[..., K:]
  k_end = to_end[..., None] * k
  M = (from_start[..., -1, None, None] * jnp.eye(K, dtype=jnp.float32)
       - jnp.einsum("...ck,...cj->...kj", k_end, W, precision=_HI))
  Sc = jnp.einsum("...ck,...cv->...kv", k_end, U, precision=_HI)
  Pm = decay_incl * jnp.einsum("...ik,...jk->...ij", q, k, precision=_HI)
  Oc = scale * jnp.einsum("...ij,...jv->...iv", Pm, U, precision=_HI)
  Qeff = scale * (from_start[..., None] * q
                  - jnp.einsum("...ij,...jk->...ik", Pm, W, precision=_HI))
  return Qeff, M, Sc, Oc


def _terms(q, k, v, g, beta, scale, C, augment):
  """chunk_terms from ``[B, T, H, ...]`` inputs; ``augment`` widens Sc and Oc by K zero
  columns (the prefix-product columns, which have no local part)."""
  Qeff, M, Sc, Oc = chunk_terms(*(_to_chunks(x, C) for x in (q, k, v, g, beta)), scale)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def chunk_recurrence(q, k, v, g, beta, h0, scale, C, augment):
  """Outputs ``[B, T, H, W]`` float32 and final state ``[B, H, K, W]`` of the chunked form.

  ``W = V``; with ``augment`` ``W = V + K``: the extra columns start as the identity, so
  they carry the prefix products of the chunk transitions. Then ``out[..., V:]`` holds the
  rows ``Qeff_n (M_{n-1} ... M_0)`` that map a state entering the sequence to each
  token's output, and ``final[..., V:]`` the product of every chunk transition.
  """
  return _forward(q, k, v, g, beta, h0, scale, C, augment)[0]


def _forward(q, k, v, g, beta, h0, scale, C, augment):
  Qeff, M, Sc, Oc = _terms(q, k, v, g, beta, scale, C, augment)
  Ys, final = _states(M, Sc, _initial(h0, M, Sc, augment))
  out = Oc + jnp.einsum("bhnck,bhnkw->bhncw", Qeff, Ys, precision=_HI)
  return (_from_chunks(out, q.shape[1]), final), Ys


def _chunk_recurrence_fwd(q, k, v, g, beta, h0, scale, C, augment):
  outs, Ys = _forward(q, k, v, g, beta, h0, scale, C, augment)
  return outs, (q, k, v, g, beta, h0, Ys)        # the inputs and one state per chunk


def _chunk_recurrence_bwd(scale, C, augment, residuals, cotangents):
  """The reverse recurrence over chunks, then the chunk terms' own vjp (recomputed).

  With dY the cotangent of the state leaving chunk n: dM_n = dY Y_n^T, dSc_n = dY,
  dQeff_n = dOut_n Y_n^T, and the state entering n gets M_n^T dY + Qeff_n^T dOut_n.
  """
  q, k, v, g, beta, h0, Ys = residuals
  d_out, d_final = cotangents
  (Qeff, M, Sc, Oc), terms_vjp = jax.vjp(
      lambda *a: _terms(*a, scale, C, augment), q, k, v, g, beta)
  d_out = _to_chunks(d_out, C)                                # [B, H, N, C, W]
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
