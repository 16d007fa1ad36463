"""Kimi Delta Attention's chunked form (WY / UT representation with per-channel decay, as
FLA's ``chunk_kda``) in plain jnp, with a custom_vjp that keeps the inputs and one state
per chunk, never a state per token.

Per chunk of C tokens (``docs/design.md`` §13), entered with state ``Y``: the decay from
token j to token i is a vector over the K key channels, ``Ga[i, j, d] = exp(sum_{j < m <= i}
g[m, d])``, so the two intra-chunk matrices contract it with the channels,

    A[i, j]  = beta_i sum_d k[i, d] k[j, d] Ga[i, j, d]      (j < i; the delta rule's reads)
    Pm[i, j] = sum_d q[i, d] k[j, d] Ga[i, j, d]              (j <= i; the outputs' scores)

and with ``e^{b_i}`` the decay since the chunk start (``[C, K]``), ``T = (I + A)^{-1}`` (the
UT transform), ``W = T diag(beta) (e^{b} * k)`` and ``U = T diag(beta) v`` (the WY
factors), the chunk's pseudo-values are ``U - W Y`` and :func:`chunk_terms` gives

    M    = Diag(e^{b_C}) - K_end^T W,   Sc = K_end^T U,   K_end[j] = e^{b_C - b_j} * k_j
    Qeff = scale (e^{b} * q - Pm W),    Oc = scale Pm U

(a chunk maps ``Y -> M Y + Sc`` and outputs ``Oc + Qeff Y``). The recurrence over chunks,
its backward and the ``augment=True`` mode (the state widened by K identity columns: the
segment transition and per-token fix-up rows of the sequence-parallel op) are the
delta-rule families' shared :func:`zeco_jax._chunks.chunk_recurrence`.

Exactness: every exponent is a sum of g over exactly the tokens it spans (the per-channel
segment sums of :func:`zeco_jax._chunks.segment_sums` inside a sub-chunk, the inclusive
cumsum from the chunk or sub-chunk start, reverse cumsums for what follows a token, whole
sub-chunks' totals between them), never the difference of two cumulative sums and never
positive. So decays down to g = -5 per token and channel (-320 over a 64-token chunk,
e^{-320} far below float32's range) and the documents' -1e4 sentinel are exact to float32
rounding.

Memory and cost: A and Pm are formed in sub-chunks of 16 tokens (:func:`_pairs`). A
diagonal sub-chunk contracts its ``[16, 16, K]`` decays elementwise; a block below the
diagonal is one matmul of decay-scaled rows and columns (its exponent split at a sub-chunk
boundary into two such sums). The pairwise decays are then ``16 K`` floats per token and
head, against ``C K`` for the whole ``[C, C, K]`` (4x less at C = 64) and Gated DeltaNet's
``C``. They are never formed for the whole sequence at once: :func:`chunk_terms_bounded`
computes the chunk terms in groups of chunks (``TERMS_BYTES_PER_STEP``, still counted as
``[C, C, K]`` per chunk), each group rematerialised in the backward, and for short
sequences all chunks at once. On the H200 (benchmarks/results/kda_h200.md, B1 T16384 H16
K=V=128): forward 15.9 ms and forward + backward 76.2 ms, against 30.7 and 127.9 with the
whole ``[C, C, K]`` per chunk, and FLA's 1.23 and 5.76.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from zeco_jax import _chunks
from zeco_jax._chunks import masked_exp, segment_sums, unit_lower_inverse
from zeco_jax._linalg import HI as _HI
from zeco_jax._linalg import opaque

TERMS_BYTES_PER_STEP = 256 << 20
"""The float32 ``[B, H, c, C, C, K]`` pairwise decays of c chunks that one step of the
chunk-term map may hold (c >= 1): 256 MiB is 8 chunks of 64 tokens at B = 1, H = 16,
K = 128. The step's intermediates are a few times this."""


SUB_CHUNK = 16
"""Tokens per sub-chunk of :func:`_pairs`: the diagonal blocks it forms per channel."""


def _after(g):
  """``out[.., j, d] = sum_{m > j} g[.., m, d]`` over the chunk axis (-2): a reverse
  cumulative sum shifted by one token, a sum of the tokens it spans (0 on the last)."""
  rev = jnp.flip(jnp.cumsum(jnp.flip(g, -2), -2), -2)        # sum_{m >= j}
  return jnp.concatenate([rev[..., 1:, :], jnp.zeros_like(rev[..., :1, :])], -2)


def _pairs(x, *, k, g):
  """``out[.., i, j] = sum_d x[i, d] k[j, d] Ga[i, j, d]`` for j <= i, 0 above, with
  ``Ga[i, j, d] = e^{sum_{j < m <= i} g[m, d]}`` (the per-channel decay from j to i).

  In sub-chunks of :data:`SUB_CHUNK` tokens. A diagonal block forms its ``[s, s, K]``
  decays from segment sums; a block of rows I below the diagonal against columns J < I
  splits every exponent at the end of sub-chunk I - 1 into two sums of g over the tokens
  they span, ``e^{sum over I up to i}`` (rows) times ``e^{sum from after j to the end of
  I - 1}`` (columns, the rest of J plus the whole sub-chunks between), each <= 1, and is
  one matmul. So the pairwise decays cost ``C s K`` floats per chunk instead of
  ``C C K``, and no exponent is a difference of sums or positive.
  """
  C, K = k.shape[-2], k.shape[-1]
  s = SUB_CHUNK if C % SUB_CHUNK == 0 else C
  n = C // s
  blocks = lambda a: [a[..., i * s:(i + 1) * s, :] for i in range(n)]
  xb, kb, gb = blocks(x), blocks(k), blocks(g)
  incl = jnp.tril(jnp.ones((s, s), bool))[..., None]
  rows = []
  for I in range(n):
    row = []
    into = jnp.exp(jnp.cumsum(gb[I], -2))                   # e^{sum over I up to i}
    for J in range(I):
      span = _after(gb[J]) + sum((jnp.sum(gb[M], -2, keepdims=True) for M in range(J + 1, I)),
                                 jnp.zeros_like(gb[J][..., :1, :]))
      row.append(jnp.einsum("...ik,...jk->...ij", xb[I] * into, kb[J] * jnp.exp(span),
                            precision=_HI))
    decay = masked_exp(segment_sums(gb[I], channel_axes=1), incl)   # [.., s, s, K]
    row.append(jnp.sum(xb[I][..., :, None, :] * kb[I][..., None, :, :] * decay, -1))
    row += [jnp.zeros(x.shape[:-2] + (s, s), x.dtype)] * (n - I - 1)
    rows.append(jnp.concatenate(row, -1))
  return jnp.concatenate(rows, -2)


def chunk_terms(q, k, v, g, beta, scale):
  """Per-chunk arrays of the WY / UT form with per-channel decay, chunk-parallel.

  Inputs float32 ``[..., C, K]`` (q, k, g), ``[..., C, V]`` (v), ``[..., C]`` (beta), any
  leading axes (``[B, H, N]`` for every chunk at once). Returns ``(Qeff [.., C, K],
  M [.., K, K], Sc [.., K, V], Oc [.., C, V])`` (the module docstring has the formulas).
  """
  C, K = k.shape[-2], k.shape[-1]
  from_start = jnp.exp(jnp.cumsum(g, -2))                   # e^{b_i}: since the chunk start
  to_end = jnp.exp(_after(g))                               # e^{b_C - b_j}: to the chunk end
  pair = functools.partial(_pairs, k=k, g=g)
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  A = jnp.where(strict, beta[..., :, None] * pair(k), 0.0)
  Pm = pair(q)
  rhs = jnp.concatenate([beta[..., None] * from_start * k, beta[..., None] * v], -1)
  WU = jnp.einsum("...ij,...jc->...ic", unit_lower_inverse(A), rhs, precision=_HI)
  W, U = WU[..., :K], WU[..., K:]
  k_end = to_end * k
  M = (from_start[..., -1, :, None] * jnp.eye(K, dtype=jnp.float32)
       - jnp.einsum("...ck,...cj->...kj", k_end, W, precision=_HI))
  Sc = jnp.einsum("...ck,...cv->...kv", k_end, U, precision=_HI)
  Oc = scale * jnp.einsum("...ij,...jv->...iv", Pm, U, precision=_HI)
  Qeff = scale * (from_start * q - jnp.einsum("...ij,...jk->...ik", Pm, W, precision=_HI))
  return Qeff, M, Sc, Oc


def chunks_per_step(B, H, C, K):
  """How many chunks :func:`chunk_terms_bounded` handles at once (at least 1)."""
  return max(1, TERMS_BYTES_PER_STEP // (4 * B * H * C * C * K))


def chunk_terms_bounded(q, k, v, g, beta, scale):
  """:func:`chunk_terms` on ``[B, H, N, C, ...]`` chunks, at most :func:`chunks_per_step`
  chunks at a time.

  All chunks at once when they fit (the chunk-parallel form, as Gated DeltaNet's); else a
  ``lax.map`` over the chunk axis in groups, each group under ``jax.checkpoint`` so that
  the backward recomputes a group's pairwise decays instead of keeping every group's.
  """
  B, H, N, C, K = k.shape
  step = chunks_per_step(B, H, C, K)
  if step >= N:
    return chunk_terms(q, k, v, g, beta, scale)
  one = jax.checkpoint(lambda xs: chunk_terms(*xs, scale))
  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))   # [N, B, H, C, ...]
  outs = lax.map(one, xs, batch_size=step)
  # opaque: the chunk recurrence contracts these with the chunk states, which come out of
  # a scan transposed too; XLA:CPU's algebraic simplifier (jax 0.10.2 and 0.11.2) folds
  # two such transposed operands into a batched dot of the wrong shape and aborts. The
  # barrier keeps the terms' transposes out of that dot (one copy of the terms).
  return opaque(tuple(jnp.moveaxis(x, 0, 2) for x in outs))


def chunk_recurrence(q, k, v, g, beta, h0, scale, C, augment):
  """Outputs ``[B, T, H, W]`` float32 and final state ``[B, H, K, W]`` of the chunked form.

  ``W = V``; with ``augment`` ``W = V + K``: the extra columns start as the identity, so
  they carry the prefix products of the chunk transitions. Then ``out[..., V:]`` holds the
  rows ``Qeff_n (M_{n-1} ... M_0)`` that map a state entering the sequence to each
  token's output, and ``final[..., V:]`` the product of every chunk transition.
  A custom_vjp (:func:`zeco_jax._chunks.chunk_recurrence`) that keeps the inputs and the
  state entering each chunk.
  """
  return _chunks.chunk_recurrence(functools.partial(chunk_terms_bounded, scale=scale), q, k,
                                  v, g, beta, h0, C, augment)
