"""Gated DeltaNet's chunked form (WY / UT representation, as in the Gated DeltaNet paper
and FLA) in plain jnp, with a custom_vjp that keeps the inputs and one state per chunk,
never a state per token.

Per chunk of C tokens (``docs/design.md`` §9): with b the within-chunk cumulative
log-decay, every chunk reduces to four arrays computed chunk-parallel by
:func:`chunk_terms`: ``Qeff [C, K]``, the chunk transition ``M [K, K]``, the chunk's own
state ``Sc [K, V]`` and its own outputs ``Oc [C, V]``, such that a chunk entered with
state ``Y`` leaves with ``M Y + Sc`` and outputs ``Oc + Qeff Y``. The only sequential part
is that recurrence over chunks (:func:`chunk_recurrence`; its loop and custom_vjp are
:func:`zeco_jax._chunks.chunk_recurrence`, shared with Kimi Delta Attention). Every
exponent is a sum of g over the tokens it spans (a segment sum, never the difference of
two cumulative sums and never positive), so decays down to g = -5 per token (-320 over a
64-token chunk) are exact to float32 rounding.

:func:`chunk_recurrence` with ``augment=True`` also carries the prefix products of the
chunk transitions (the state widened by K columns that start as the identity): that gives
the segment's transition and the per-token fix-up rows the sequence-parallel op needs
(:mod:`zeco_jax.ops.gated_delta.parallel`).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from zeco_jax import _chunks
from zeco_jax._chunks import masked_exp, segment_sums, unit_lower_inverse
from zeco_jax._linalg import HI as _HI


def chunk_terms(q, k, v, g, beta, scale):
  """Per-chunk arrays of the WY / UT form, chunk-parallel (docs/design.md §9).

  Inputs float32 ``[B, H, N, C, ...]``. With ``Ga[i, j]`` the decay from token j to i,
  ``A = strict_lower(beta_i Ga[i, j] k_i . k_j)`` and ``T = (I + A)^{-1}`` (the UT
  transform): ``W = T diag(beta e^b) k`` and ``U = T diag(beta) v`` (the WY factors), so
  the chunk's pseudo-values are ``U - W Y`` for entering state Y. Returns
  ``(Qeff [.., C, K], M [.., K, K], Sc [.., K, V], Oc [.., C, V])``.
  """
  C, K = k.shape[-2], k.shape[-1]
  seg = segment_sums(g)                                    # [.., C, C]
  incl = jnp.tril(jnp.ones((C, C), bool))
  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  decay_strict, decay_incl = masked_exp(seg, strict), masked_exp(seg, incl)
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


def chunk_recurrence(q, k, v, g, beta, h0, scale, C, augment):
  """Outputs ``[B, T, H, W]`` float32 and final state ``[B, H, K, W]`` of the chunked form.

  ``W = V``; with ``augment`` ``W = V + K``: the extra columns start as the identity, so
  they carry the prefix products of the chunk transitions. Then ``out[..., V:]`` holds the
  rows ``Qeff_n (M_{n-1} ... M_0)`` that map a state entering the sequence to each
  token's output, and ``final[..., V:]`` the product of every chunk transition.
  A custom_vjp (:func:`zeco_jax._chunks.chunk_recurrence`) that keeps the inputs and the
  state entering each chunk.
  """
  return _chunks.chunk_recurrence(functools.partial(chunk_terms, scale=scale), q, k, v, g,
                                  beta, h0, C, augment)
