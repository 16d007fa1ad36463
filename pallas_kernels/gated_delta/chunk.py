"""The per-chunk kernels of Gated DeltaNet (grid over batch, head and chunk; no state).

One chunk of C tokens, scalar log-decays g (per head), b_i the sum of g from the chunk
start to token i, seg[i, j] the sum of g over (j, i], gamma = b_{C-1} the chunk's total
and to_end[j] = seg[C-1, j] (``docs/design.md`` §9):

  A   = strict_lower(beta_i e^{seg[i, j]} k_i . k_j),   T = (I + A)^{-1}   (the UT transform)
  w   = T diag(beta e^{b}) k,   u = T diag(beta) v                         (the WY factors)
  kd  = e^{to_end} k                      (the keys as the state at the chunk end sees them)

  entered with state h:  v_new = u - w h,   h' = e^{gamma} h + kd^T v_new,
                         o = scale (e^{b} q h + (incl_lower(e^{seg}) * q k^T) v_new)

Kernels: :func:`inverse` forms A and T (16 x 16 blocks) and writes T as a ``[C, C]``
tile per chunk; every other kernel works on whole-chunk tiles, looping over K and V tiles
so that few accumulators are live (:func:`wu`, :func:`output`; the backward's
:func:`vnew`, :func:`dqk`, :func:`dwy`). The forward takes :func:`wy_forward`:
:func:`inverse` and :func:`wu` in one program, applying T as the inverse leaves it, 16 x 16
blocks in registers, T never written; the backward, which needs T, keeps the two.

Exactness: every exponent is a sum of g over exactly the tokens it spans, never the
difference of two cumulative sums and never positive: over a chunk the segment sums are
cumulative sums of the masked ``[m, j]`` tile ``g_m [m > j]`` along m (:func:`seg_sums`),
b and to_end masked reductions; between the inverse's 16-token blocks an exponent is the
row's sum into its block, the whole blocks between and the column's sum to the end of
its own (:class:`Blocks`). The decay gradient is accumulated the same way: dg_m sums
exactly the terms whose span holds m (:func:`seg_grad`, :func:`revsum`, :func:`exclsum`).

The UT inverse is by 16 x 16 blocks (FLA's ``solve_tril`` scheme): each diagonal block by
forward substitution (16 row steps, masked rows, no slicing of loaded values, which
Triton cannot do), the blocks below by ``X_IJ = -X_II sum_{J <= M < I} A_IM X_MJ``, float32
products at HIGHEST precision for float32 inputs and three bfloat16 products for narrower
ones (:func:`pallas_kernels._delta.merge_dot`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._delta import block_inverse, stacked_through
from pallas_kernels._launch import F32, block, call, dot, iota, masked_exp, program_barrier, tiles

S = 16                       # rows of a block of the UT inverse


def _tile():
  return iota((S, S), 0), iota((S, S), 1)


def revsum(x, n):
  """``out[m] = sum_{i >= m} x[i]`` of a ``[n]`` vector (a masked reduction, exact order
  of a sum)."""
  r, c = iota((n, n), 0), iota((n, n), 1)
  return jnp.sum(jnp.where(r >= c, x[:, None], 0.0), axis=0)


def exclsum(x, n):
  """``out[m] = sum_{j < m} x[j]`` of a ``[n]`` vector."""
  r, c = iota((n, n), 0), iota((n, n), 1)
  return jnp.sum(jnp.where(r < c, x[:, None], 0.0), axis=0)


def seg_sums(g, n):
  """``[n, n]``: ``out[i, j] = sum_{j < m <= i} g[m]`` for i > j (0 elsewhere): a cumsum of
  the masked tile along m, a sum of the tokens it spans."""
  r, c = iota((n, n), 0), iota((n, n), 1)
  return jnp.cumsum(jnp.where(r > c, g[:, None], 0.0), axis=0)


def seg_grad(dseg, n):
  """The gradient of g through :func:`seg_sums`: ``out[m] = sum_{i >= m > j} dseg[i, j]``."""
  r, c = iota((n, n), 0), iota((n, n), 1)
  before = jnp.cumsum(dseg, axis=1) - dseg                    # [i, m]: sum_{j < m} dseg[i, j]
  return jnp.sum(jnp.where(r >= c, before, 0.0), axis=0)


class Blocks:
  """The decays of one chunk as 16-token blocks: per block ``into`` (g summed from the
  block start to the token), ``after`` (from after the token to the block end), ``tot``
  and the diagonal block's segment sums; from them every exponent a block pair needs,
  each a sum of the tokens it spans."""

  def __init__(self, gs):
    r, c = _tile()
    self.L = len(gs)
    self.into = [jnp.sum(jnp.where(r <= c, g[:, None], 0.0), axis=0) for g in gs]
    self.after = [jnp.sum(jnp.where(r > c, g[:, None], 0.0), axis=0) for g in gs]
    self.tot = [jnp.sum(g) for g in gs]
    self.diag = [seg_sums(g, S) for g in gs]

  def span(self, lo, hi):
    """The totals of blocks lo..hi-1 (None if empty)."""
    out = None
    for M in range(lo, hi):
      out = self.tot[M] if out is None else out + self.tot[M]
    return out

  def _plus(self, x, s):
    return x if s is None else x + s

  def b(self, I):
    """``[S]``: g summed from the chunk start to each token of block I."""
    return self._plus(self.into[I], self.span(0, I))

  def to_end(self, J):
    """``[S]``: g summed from after each token of block J to the chunk end."""
    return self._plus(self.after[J], self.span(J + 1, self.L))

  def gamma(self):
    return self.span(0, self.L)

  def seg(self, I, J):
    """``[S, S]`` exponents from the tokens of block J to those of block I >= J."""
    if I == J:
      return self.diag[I]
    return self.into[I][:, None] + self._plus(self.after[J], self.span(J + 1, I))[None, :]

  def mask(self, I, J):
    r, c = _tile()
    return (r > c) if I == J else (r >= 0)


def block_kkt(k_of, slices, betas, dec, dt):
  """The strictly lower blocks of A (``{(I, J): [S, S]}`` for J <= I), the decays
  ``e^{seg}`` (masked) and the raw ``k_I k_J^T``, summed over the K ``slices``
  (``k_of(I, ks)``: block I's keys ``[S, kd]``, loaded per slice so that only one slice
  of the chunk's keys is live)."""
  KK = {}
  for ks in slices:
    kb = [k_of(I, ks) for I in range(dec.L)]
    for I in range(dec.L):
      for J in range(I + 1):
        term = dot(kb[I], kb[J], dt, tb=True)
        KK[I, J] = term if (I, J) not in KK else KK[I, J] + term
  A, E = {}, {}
  for I in range(dec.L):
    for J in range(I + 1):
      E[I, J] = masked_exp(dec.mask(I, J), dec.seg(I, J))
      A[I, J] = betas[I][:, None] * E[I, J] * KK[I, J]
  return A, E, KK


def _rows(n, C, L):
  return [pl.ds(n * C + I * S, S) for I in range(L)]


def _load_chunk(refs, b, hd, n, C):
  """Per block: g, beta (float32 [S]); and their Blocks."""
  g_ref, beta_ref = refs
  L = C // S
  rows = _rows(n, C, L)
  gs = [g_ref[b, r, hd].astype(F32) for r in rows]
  betas = [beta_ref[b, r, hd].astype(F32) for r in rows]
  return rows, gs, betas, Blocks(gs)


# --- forward ------------------------------------------------------------------------------

def _inverse_blocks(k_ref, g_ref, beta_ref, ad_ref, b, hd, n, *, C, K, KD, dt, config):
  """This program's chunk: ``(rows, betas, dec, X)`` with X the blocks of (I + A)^{-1}
  (:func:`pallas_kernels._delta.block_inverse`), A's diagonal blocks through the float32
  scratch ``ad_ref``, all at once."""
  rows, _, betas, dec = _load_chunk((g_ref, beta_ref), b, hd, n, C)
  A, _, _ = block_kkt(lambda I, ks: k_ref[b, rows[I], hd, ks], tiles(K, KD), betas, dec, dt)
  for I in range(dec.L):
    ad_ref[b, rows[I], hd, :] = A[I, I]
  program_barrier(config)
  stacked = stacked_through(ad_ref, b, hd, n, C, config,
                            lambda i, first: ad_ref[b, n * C + first + i, hd, :])
  return rows, betas, dec, block_inverse(A, dec.L, stacked, dt)


def _inverse_kernel(k_ref, g_ref, beta_ref, t_ref, ad_ref, *, C, K, KD, dt, config):
  b, hd, n = (pl.program_id(i) for i in range(3))
  rows, _, dec, X = _inverse_blocks(k_ref, g_ref, beta_ref, ad_ref, b, hd, n, C=C, K=K,
                                    KD=KD, dt=dt, config=config)
  for I in range(dec.L):
    for J in range(dec.L):
      block = X[I, J] if J <= I else jnp.zeros((S, S), F32)
      t_ref[b, rows[I], hd, pl.ds(J * S, S)] = block.astype(t_ref.dtype)


def inverse(k, g, beta, *, chunk_size, config):
  """T = (I + A)^{-1} per chunk, ``[B, T, H, C]`` (row i of its chunk's inverse at token i)
  in k's dtype (every dot reads it so). A's diagonal blocks go through a float32 scratch
  output ``[B, T, H, 16]``, from which the substitution gathers their rows, all four
  blocks at once (:func:`pallas_kernels._delta.block_inverse`; one block at a time from
  register tiles measured slower: ``benchmarks/results/gdn_h200.md``)."""
  B, T, H, K = k.shape
  kern = functools.partial(_inverse_kernel, C=chunk_size, K=K, KD=config.inv.kd, dt=k.dtype,
                           config=config)
  out = (jax.ShapeDtypeStruct((B, T, H, chunk_size), k.dtype),
         jax.ShapeDtypeStruct((B, T, H, S), F32))          # + the diagonal blocks' scratch
  return call(kern, out, (B, H, T // chunk_size), config=config, num_warps=config.inv.warps,
              num_stages=config.inv.stages, name="gdn_ut_inverse")(k, g, beta)[0]


def _chunk_decays(g, C):
  """``(b, to_end)`` of a chunk, ``[C]`` each: g summed from the chunk start to the token,
  and from after the token to the chunk end."""
  r, c = iota((C, C), 0), iota((C, C), 1)
  b = jnp.sum(jnp.where(r <= c, g[:, None], 0.0), axis=0)
  to_end = jnp.sum(jnp.where(r > c, g[:, None], 0.0), axis=0)
  return b, to_end


def _wu_kernel(t_ref, k_ref, v_ref, g_ref, beta_ref, *refs, C, K, V, BD, dt, scale):
  if scale is None:
    w_ref, u_ref, kd_ref, gc_ref = refs
  else:
    q_ref, w_ref, u_ref, kd_ref, gc_ref, qb_ref = refs
  b, hd, n = (pl.program_id(i) for i in range(3))
  t = pl.ds(n * C, C)
  Tm = t_ref[b, t, hd, :]
  beta = beta_ref[b, t, hd].astype(F32)
  gb, to_end = _chunk_decays(g_ref[b, t, hd].astype(F32), C)
  gc_ref[b, t, hd] = gb
  eb, ek = jnp.exp(gb), jnp.exp(to_end)
  for ks in tiles(K, BD):
    k = k_ref[b, t, hd, ks].astype(F32)
    w_ref[b, t, hd, ks] = dot(Tm, (beta * eb)[:, None] * k, dt).astype(w_ref.dtype)
    kd_ref[b, t, hd, ks] = (ek[:, None] * k).astype(kd_ref.dtype)
    if scale is not None:
      qb_ref[b, t, hd, ks] = ((scale * eb)[:, None]
                              * q_ref[b, t, hd, ks].astype(F32)).astype(qb_ref.dtype)
  for vs in tiles(V, BD):
    u_ref[b, t, hd, vs] = dot(Tm, beta[:, None] * v_ref[b, t, hd, vs].astype(F32),
                              dt).astype(u_ref.dtype)


def wu(Tinv, k, v, g, beta, *, chunk_size, config, q=None, scale=None):
  """(w [B, T, H, K], u [B, T, H, V], kd [B, T, H, K] in k's dtype, gc [B, T, H] float32:
  b, g summed from the chunk start), from the inverse T. g, beta float32 ``[B, T, H]``.
  With q and scale (the backward) also ``qb = scale e^{b} q`` in q's dtype."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  kern = functools.partial(_wu_kernel, C=chunk_size, K=K, V=V, BD=config.wu.bv, dt=k.dtype,
                           scale=None if q is None else scale)
  kshape = jax.ShapeDtypeStruct((B, T, H, K), k.dtype)
  out = (kshape, jax.ShapeDtypeStruct((B, T, H, V), k.dtype), kshape,
         jax.ShapeDtypeStruct((B, T, H), F32)) + ((kshape,) if q is not None else ())
  args = (Tinv, k, v, g, beta) + ((q,) if q is not None else ())
  return call(kern, out, (B, H, T // chunk_size), config=config, num_warps=config.wu.warps,
              num_stages=config.wu.stages, name="gdn_wu")(*args)


def _wy_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, gc_ref, ad_ref, *, C, K,
               V, KD, BD, dt, config):
  b, hd, n = (pl.program_id(i) for i in range(3))
  rows, betas, dec, X = _inverse_blocks(k_ref, g_ref, beta_ref, ad_ref, b, hd, n, C=C, K=K,
                                        KD=KD, dt=dt, config=config)
  L = dec.L
  # T as gdn_ut_inverse stores it (in dt): the products below take the same operands as
  # gdn_wu's dots with T, summed block by block.
  X = {IJ: x.astype(dt) for IJ, x in X.items()}
  gb = [dec.b(I) for I in range(L)]
  eb = [jnp.exp(x) for x in gb]
  ek = [jnp.exp(dec.to_end(I)) for I in range(L)]
  for I in range(L):
    gc_ref[b, rows[I], hd] = gb[I]

  def apply_t(rhs):                    # rows of block I of T rhs: sum_{J <= I} X_IJ rhs_J
    out = []
    for I in range(L):
      acc = dot(X[I, 0], rhs[0], dt)
      for J in range(1, I + 1):
        acc = acc + dot(X[I, J], rhs[J], dt)
      out.append(acc)
    return out

  for ks in tiles(K, BD):
    kb = [k_ref[b, r, hd, ks].astype(F32) for r in rows]
    w = apply_t([(betas[J] * eb[J])[:, None] * kb[J] for J in range(L)])
    for I in range(L):
      w_ref[b, rows[I], hd, ks] = w[I].astype(w_ref.dtype)
      kd_ref[b, rows[I], hd, ks] = (ek[I][:, None] * kb[I]).astype(kd_ref.dtype)
  for vs in tiles(V, BD):
    u = apply_t([betas[J][:, None] * v_ref[b, rows[J], hd, vs].astype(F32)
                 for J in range(L)])
    for I in range(L):
      u_ref[b, rows[I], hd, vs] = u[I].astype(u_ref.dtype)


def wy_forward(k, v, g, beta, *, chunk_size, config):
  """The forward's ``(w, u, kd, gc)`` (as :func:`wu`'s) in one program per chunk (kernel
  ``gdn_wy``), T never written: A and the inverse's blocks ``X[I, J]`` (J <= I, ``[16,
  16]`` register tiles) as :func:`inverse` forms them, then per K and V tile of
  ``config.wy.bv`` the rows of block I of w and u as ``sum_{J <= I} X[I, J] rhs[J]`` (rhs
  = beta e^{b} k, beta v by 16-token blocks: L (L + 1) / 2 dots of ``[16, 16] x [16,
  bv]`` a tile, 10 at a chunk of 64), b and to_end per block from :class:`Blocks`. X is
  rounded to k's dtype before the products, as :func:`inverse` stores T, so w and u equal
  :func:`wy`'s up to the order of the float32 accumulation. Spares :func:`inverse` then
  :func:`wu`'s T write and read (``B T H C`` elements of k's dtype each way) and wu's
  second read of k, g and beta: forward 1.16 -> 1.12 ms at B8 T4096 H16 K=V=128 on an
  H100 (``benchmarks/results/gdn_h200.md``). The backward keeps :func:`wy`: written with
  T for ``gdn_dwy`` the fused kernel measured slower there."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  C = chunk_size
  kern = functools.partial(_wy_kernel, C=C, K=K, V=V, KD=config.wy.kd, BD=config.wy.bv,
                           dt=k.dtype, config=config)
  kshape = jax.ShapeDtypeStruct((B, T, H, K), k.dtype)
  out = (kshape, jax.ShapeDtypeStruct((B, T, H, V), k.dtype), kshape,
         jax.ShapeDtypeStruct((B, T, H), F32),
         jax.ShapeDtypeStruct((B, T, H, S), F32))          # + the diagonal blocks' scratch
  return call(kern, out, (B, H, T // C), config=config, num_warps=config.wy.warps,
              num_stages=config.wy.stages, name="gdn_wy")(k, v, g, beta)[:4]


def wy(k, v, g, beta, *, chunk_size, config, q=None, scale=None):
  """:func:`inverse` then :func:`wu`: ``(Tinv, w, u, kd, gc)`` (and ``qb`` with q); the
  backward's (the forward takes :func:`wy_forward`)."""
  Tinv = inverse(k, g, beta, chunk_size=chunk_size, config=config)
  return (Tinv, *wu(Tinv, k, v, g, beta, chunk_size=chunk_size, config=config, q=q,
                    scale=scale))


def _scores(q, k, g, C, dt):
  """``incl_lower(e^{seg}) * q k^T`` of a chunk, float32 ``[C, C]``."""
  r, c = iota((C, C), 0), iota((C, C), 1)
  return masked_exp(r >= c, seg_sums(g, C)) * dot(q, k, dt, tb=True)


def _out_kernel(q_ref, k_ref, g_ref, gc_ref, vn_ref, h_ref, o_ref, *, C, BV, dt, scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  t, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  q = q_ref[b, t, hd, :]
  P = _scores(q, k_ref[b, t, hd, :], g_ref[b, t, hd].astype(F32), C, dt)
  qb = q.astype(F32) * jnp.exp(gc_ref[b, t, hd])[:, None]
  o = dot(qb, h_ref[b, hd, n, :, vs], dt) + dot(P, vn_ref[b, t, hd, vs], dt)
  o_ref[b, t, hd, vs] = (scale * o).astype(o_ref.dtype)


def output(q, k, g, gc, vn, h, *, scale, chunk_size, config):
  """o [B, T, H, V] in v_new's dtype, from the states entering each chunk."""
  B, T, H, K = q.shape
  V = vn.shape[-1]
  BV = block(V, config.out.bv)
  kern = functools.partial(_out_kernel, C=chunk_size, BV=BV, dt=q.dtype, scale=scale)
  return call(kern, jax.ShapeDtypeStruct(vn.shape, vn.dtype), (B, H, T // chunk_size, V // BV),
              config=config, num_warps=config.out.warps, num_stages=config.out.stages,
              name="gdn_output")(q, k, g, gc, vn, h)


# --- backward -----------------------------------------------------------------------------

def _vnew_kernel(q_ref, k_ref, g_ref, w_ref, u_ref, h_ref, do_ref, vn_ref, dvl_ref, *, C,
                 BV, dt, scale):
  b, hd, n, iv = (pl.program_id(i) for i in range(4))
  t, vs = pl.ds(n * C, C), pl.ds(iv * BV, BV)
  vn = u_ref[b, t, hd, vs].astype(F32) - dot(w_ref[b, t, hd, :], h_ref[b, hd, n, :, vs], dt)
  vn_ref[b, t, hd, vs] = vn.astype(vn_ref.dtype)
  P = _scores(q_ref[b, t, hd, :], k_ref[b, t, hd, :], g_ref[b, t, hd].astype(F32), C, dt)
  dvl_ref[b, t, hd, vs] = scale * dot(P, do_ref[b, t, hd, vs], dt, ta=True)


def vnew(q, k, g, w, u, h, do, *, scale, chunk_size, config):
  """(v_new [B, T, H, V] in u's dtype, recomputed from the kept states; the local part of
  its cotangent ``scale P^T do`` float32)."""
  B, T, H, K = q.shape
  V = u.shape[-1]
  BV = block(V, config.vnew.bv)
  kern = functools.partial(_vnew_kernel, C=chunk_size, BV=BV, dt=q.dtype, scale=scale)
  out = (jax.ShapeDtypeStruct(u.shape, u.dtype), jax.ShapeDtypeStruct(u.shape, F32))
  return call(kern, out, (B, H, T // chunk_size, V // BV), config=config,
              num_warps=config.vnew.warps, num_stages=config.vnew.stages,
              name="gdn_vnew")(q, k, g, w, u, h, do)


def _dqk_kernel(q_ref, k_ref, g_ref, gc_ref, vn_ref, dvn_ref, do_ref, h_ref, dh_ref, dq_ref,
                dk_ref, dw_ref, dg_ref, *, C, K, V, KS, BK, BV, dt, scale):
  b, hd, f = (pl.program_id(i) for i in range(3))
  NKS = K // KS                        # programs per chunk, each a K slice of KS channels
  n, kk = f // NKS, f % NKS
  t = pl.ds(n * C, C)
  g, gc = g_ref[b, t, hd].astype(F32), gc_ref[b, t, hd]
  ktiles, vtiles = tiles(K, BK), tiles(V, BV)
  bk = block(KS, BK)
  slices = [pl.ds(kk * KS + i * bk, bk) for i in range(KS // bk)]
  # The chunk-wide [C, C] parts first: do v_new^T over V, and (for dg's part through the
  # decays of q k^T) q k^T over K; with K slices only the first slice's program forms the
  # latter, after its loops.
  def qk_tile():
    qk = jnp.zeros((C, C), F32)
    for ks in ktiles:
      qk = qk + dot(q_ref[b, t, hd, ks], k_ref[b, t, hd, ks], dt, tb=True)
    return qk

  dP = jnp.zeros((C, C), F32)
  for vs in vtiles:
    dP = dP + dot(do_ref[b, t, hd, vs], vn_ref[b, t, hd, vs], dt, tb=True)
  qk = qk_tile() if NKS == 1 else None
  r, c = iota((C, C), 0), iota((C, C), 1)
  dS = scale * dP * masked_exp(r >= c, seg_sums(g, C))       # cotangent of q k^T
  # The decays' part of dg now, so that of the [C, C] tiles only dS stays live in the
  # loops below (with dP, E and q k^T live as well the kernel spilled 1784 bytes of
  # registers for sm_90: benchmarks/results/ptx_sm90.md).
  dg_seg = seg_grad(dS * qk, C) if NKS == 1 else None
  eb = jnp.exp(gc)
  to_end = jnp.sum(jnp.where(r > c, g[:, None], 0.0), axis=0)  # [C]: sum_{m > j} g_m
  ek = jnp.exp(to_end)
  db = jnp.zeros((C,), F32)
  dto_end = jnp.zeros((C,), F32)
  dgam = jnp.float32(0.0)                                     # sum h * dh'
  for ks in slices:
    dqb = jnp.zeros((C, bk), F32)      # do h^T
    dkd = jnp.zeros((C, bk), F32)      # v_new dh'^T
    dwa = jnp.zeros((C, bk), F32)      # dv_new h^T
    for vs in vtiles:
      do, vn, dvn = do_ref[b, t, hd, vs], vn_ref[b, t, hd, vs], dvn_ref[b, t, hd, vs]
      h, dh = h_ref[b, hd, n, ks, vs], dh_ref[b, hd, n, ks, vs]
      dqb = dqb + dot(do, h, dt, tb=True)
      dkd = dkd + dot(vn, dh, dt, tb=True)
      dwa = dwa + dot(dvn, h, dt, tb=True)
      dgam = dgam + jnp.sum(jnp.sum(h.astype(F32) * dh.astype(F32), axis=1), axis=0)
    q, k = q_ref[b, t, hd, ks], k_ref[b, t, hd, ks]
    dq_ref[b, t, hd, ks] = scale * eb[:, None] * dqb + dot(dS, k, dt)
    dk_ref[b, t, hd, ks] = dot(dS, q, dt, ta=True) + ek[:, None] * dkd
    dw_ref[b, t, hd, ks] = (-dwa).astype(dw_ref.dtype)
    db = db + jnp.sum(q.astype(F32) * dqb, axis=1)
    dto_end = dto_end + jnp.sum(k.astype(F32) * dkd, axis=1)
  db = scale * eb * db
  dto_end = ek * dto_end
  if NKS == 1:                         # the terms in the order of the program measured
    dg_ref[b, t, hd] = (revsum(db, C) + dg_seg + exclsum(dto_end, C)
                        + jnp.exp(jnp.sum(g)) * dgam)
    return
  dg = revsum(db, C) + exclsum(dto_end, C) + jnp.exp(jnp.sum(g)) * dgam

  @pl.when(kk == 0)
  def _():                             # the chunk-wide part once, in the first slice's sum
    dg_ref[b, t, hd, kk] = dg + seg_grad(dS * qk_tile(), C)

  @pl.when(kk != 0)
  def _():
    dg_ref[b, t, hd, kk] = dg

def dqk(q, k, g, gc, vn, dvn, do, h, dh, *, scale, chunk_size, config):
  """(dq, dk's output and state part, dw, dg's part) per chunk, float32 but dw (q's
  dtype: :func:`dwy` reads it only as a dot operand of that dtype). A program per
  chunk and K slice of ``config.dqk.kd`` channels, each forming the cotangent of q k^T
  (over V) and its slice's part of dg (summed over the slices here); the first slice's
  also forms q k^T (over K) for dg's part through its decays."""
  B, T, H, K = q.shape
  V = vn.shape[-1]
  KS = block(K, config.dqk.kd)
  kern = functools.partial(_dqk_kernel, C=chunk_size, K=K, V=V, KS=KS, BK=config.dqk.bv,
                           BV=config.dqk.bv, dt=q.dtype, scale=scale)
  f32k = jax.ShapeDtypeStruct((B, T, H, K), F32)
  NKS = K // KS
  out = (f32k, f32k, jax.ShapeDtypeStruct((B, T, H, K), q.dtype),
         jax.ShapeDtypeStruct((B, T, H) + ((NKS,) if NKS > 1 else ()), F32))
  dq, dk, dw, dg = call(kern, out, (B, H, (T // chunk_size) * NKS), config=config,
                        num_warps=config.dqk.warps, num_stages=config.dqk.stages,
                        name="gdn_dqk")(q, k, g, gc, vn, dvn, do, h, dh)
  return dq, dk, dw, (jnp.sum(dg, axis=-1) if NKS > 1 else dg)


def _dwy_kernel(t_ref, k_ref, v_ref, g_ref, beta_ref, dw_ref, du_ref, dk_in_ref, dk_ref, dv_ref,
                dbeta_ref, dg_ref, *, C, K, V, BD, dt):
  """w = T rw, u = T ru (rw = beta e^b k, ru = beta v), T = (I + A)^{-1}: drw = T^T dw,
  dru = T^T du, dT = dw rw^T + du ru^T, dA = strict_lower(-T^T dT T^T). dk is written
  with ``dk_in`` (:func:`dqk`'s part) added, in its output dtype."""
  b, hd, n = (pl.program_id(i) for i in range(3))
  t = pl.ds(n * C, C)
  Tm = t_ref[b, t, hd, :]
  g, beta = g_ref[b, t, hd].astype(F32), beta_ref[b, t, hd].astype(F32)
  gb, _ = _chunk_decays(g, C)
  eb = jnp.exp(gb)
  ktiles, vtiles = tiles(K, BD), tiles(V, BD)
  r, c = iota((C, C), 0), iota((C, C), 1)
  dT = jnp.zeros((C, C), F32)
  for ks in ktiles:
    k = k_ref[b, t, hd, ks]
    dT = dT + dot(dw_ref[b, t, hd, ks], (beta * eb)[:, None] * k.astype(F32), dt, tb=True)
  for vs in vtiles:
    dT = dT + dot(du_ref[b, t, hd, vs], beta[:, None] * v_ref[b, t, hd, vs].astype(F32), dt,
                  tb=True)
  dT = jnp.where(r >= c, dT, 0.0)
  dA = -dot(dot(Tm, dT, dt, ta=True), Tm, dt, tb=True)
  E = masked_exp(r > c, seg_sums(g, C))
  dA = jnp.where(r > c, dA, 0.0)
  # k k^T only now, and dg's pair term before the dk / dv loops: neither [C, C] is live
  # beside dT and the dT products (sm_90: 636 -> 304 bytes spilled; 3.7% / 4.4% off the
  # forward + backward, benchmarks/results/gdn_h200.md).
  kk = jnp.zeros((C, C), F32)
  for ks in ktiles:
    k = k_ref[b, t, hd, ks]
    kk = kk + dot(k, k, dt, tb=True)
  dAE = dA * E
  dkk = beta[:, None] * dAE
  dbeta = jnp.sum(dAE * kk, axis=1)
  dg_pairs = seg_grad(dA * beta[:, None] * E * kk, C)
  t_k = jnp.zeros((C,), F32)
  for ks in ktiles:
    k = k_ref[b, t, hd, ks]
    drw = dot(Tm, dw_ref[b, t, hd, ks], dt, ta=True)
    dk_ref[b, t, hd, ks] = (dk_in_ref[b, t, hd, ks] + (beta * eb)[:, None] * drw
                            + dot(dkk, k, dt) + dot(dkk, k, dt, ta=True)).astype(dk_ref.dtype)
    t_k = t_k + jnp.sum(k.astype(F32) * drw, axis=1)
  for vs in vtiles:
    v = v_ref[b, t, hd, vs]
    dru = dot(Tm, du_ref[b, t, hd, vs], dt, ta=True)
    dv_ref[b, t, hd, vs] = (beta[:, None] * dru).astype(dv_ref.dtype)
    dbeta = dbeta + jnp.sum(v.astype(F32) * dru, axis=1)
  dbeta_ref[b, t, hd] = dbeta + eb * t_k
  db = beta * eb * t_k
  dg_ref[b, t, hd] = revsum(db, C) + dg_pairs


def dwy(Tinv, k, v, g, beta, dw, du, dk_in, *, chunk_size, config):
  """(dk in k's dtype: ``dk_in`` plus the part through A and w; dv in v's dtype; dbeta and
  dg's part, float32) per chunk: the backward of :func:`wy` from the cotangents of w and u
  (v_new's), adding dk's part formed before (:func:`dqk`'s) in the kernel instead of in an
  XLA pass."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  kern = functools.partial(_dwy_kernel, C=chunk_size, K=K, V=V, BD=config.dwy.bv, dt=k.dtype)
  out = (jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
         jax.ShapeDtypeStruct((B, T, H, V), v.dtype),
         jax.ShapeDtypeStruct((B, T, H), F32), jax.ShapeDtypeStruct((B, T, H), F32))
  return call(kern, out, (B, H, T // chunk_size), config=config, num_warps=config.dwy.warps,
              num_stages=config.dwy.stages, name="gdn_dwy")(Tinv, k, v, g, beta, dw, du, dk_in)
