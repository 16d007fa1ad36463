"""The causal depthwise short convolution with SiLU (flash-linear-attention's
``ShortConvolution`` / ``causal_conv1d``), forward and backward, as Pallas kernels lowered
through Triton (with ``config.interpret`` the same kernels run in the Pallas interpreter).

    y[t, c] = silu(pre[t, c]),  pre[t, c] = sum_{j < W} ok_j[t] x[t - j, c] w[W - 1 - j, c]

x ``[B, T, C]`` (C = heads x head dim, contiguous), w ``[W, C]``, ``ok_j[t]`` zero where
tap j would read a token before the start of the row or of t's document (``segment_ids``
``[B, T]``: tokens t - j + 1 .. t all continue the document of the token before them).
Sums and the SiLU in float32, y in x's dtype. The backward recomputes ``pre`` from x and
returns ``dx`` (x's dtype) and ``dw`` (float32, ``[W, C]``):

    dpre[t] = dy[t] silu'(pre[t]),  dx[s] = sum_j ok_j[s + j] dpre[s + j] w[W - 1 - j],
    dw[W - 1 - j] = sum_t ok_j[t] dpre[t] x[t - j]

One pass over the tokens each way (whether that beats XLA's fusions of the same sums on a
GPU is not measured yet: ``docs/kernels.md``). The forward's program is a ``[bt, bc]``
tile of tokens and channels; the backward's walks ``rows`` tokens in ``[bwd_bt, bc]``
tiles, so that its weight-gradient partial sums ``[B, T / rows, W, C]`` stay small, and
each tile loads x at the 2W - 1 row offsets its taps and the next W - 1 rows' need (from
L1 / L2: one pass from memory).

A tap before the row's start is a masked load at a negative row on the GPU; the
interpreter returns NaN for any slice that starts outside the array (masked or not), so
there the wrapper pads the rows by W - 1 on each side and the kernels add that offset:
the kernels' code is the same. This module never imports ``zeco_jax``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._launch import F32, block, call, iota


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  """The short convolution's launch: the forward's ``bt`` x ``bc`` tiles (tokens x
  channels; bc a cap, the largest power of two dividing C is used), the backward's
  ``bwd_bt`` x ``bc`` tiles (it holds 2W - 1 tiles of x: at 32 x 64 on 4 warps it used 255
  registers and spilled on sm_90, at 16 x 64 168 and none), ``rows`` tokens a backward
  program (a multiple of both), Triton's ``warps``; ``interpret`` runs the Pallas
  interpreter."""
  bt: int = 32
  bwd_bt: int = 16
  bc: int = 64
  rows: int = 512
  warps: int = 4
  interpret: bool = False

  def __post_init__(self):
    for name in ("bt", "bwd_bt", "bc", "rows", "warps"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ConvConfig: `{name}` must be a positive int, got {value!r}.")
    for name in ("bt", "bwd_bt", "bc"):
      value = getattr(self, name)
      if value & (value - 1) or value < 16:
        raise ValueError(f"ConvConfig: `{name}` must be a power of two >= 16 (a Triton "
                         f"tile), got {value}.")
    for name in ("bt", "bwd_bt"):
      tile = getattr(self, name)
      if self.rows % tile:
        raise ValueError(f"ConvConfig: `rows`={self.rows} must be a multiple of `{name}`="
                         f"{tile}; use rows={max(1, self.rows // tile) * tile}.")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"ConvConfig: `interpret` must be True or False, got "
                       f"{self.interpret!r}.")


def _masked_load(ref, b, start, rows, cols, mask, pad):
  """``ref[b, start + pad : start + pad + rows, cols]`` (``cols`` None: a ``[B, T]`` ref's
  row), zero where ``mask`` is off."""
  from jax.experimental.pallas import triton as pltriton
  if cols is None:
    return pltriton.load(ref.at[b, pl.ds(start + pad, rows)], mask=mask, other=0)
  return pltriton.load(ref.at[b, pl.ds(start + pad, rows), cols], mask=mask, other=0)


def _ok_masks(ids_ref, b, r0, W, T, pad, bt, has_ids):
  """``ok[j]`` (j < W) for rows ``r0 .. r0 + bt``: ``[bt, 1]`` bools (None: always), tap j
  reads a row >= 0 of the same document."""
  if not has_ids:              # a tap before the row's start reads x's masked zeros
    return [None] * W
  rows = r0 + iota((bt,), 0)
  oks = [None]
  load = lambda d: _masked_load(ids_ref, b, r0 + d, bt, None,
                                (rows + d >= 0) & (rows + d < T), pad)
  ids = {0: load(0)}
  ok = rows >= 0
  for j in range(1, W):
    ids[-j] = load(-j)
    ok = ok & (rows >= j) & (ids[-j] == ids[-j + 1])
    oks.append(ok[:, None])
  return oks


def _pre(x_taps, w_rows, oks):
  """``sum_j ok_j x_taps[j] w_rows[W - 1 - j]`` in float32 (x_taps[j]: x at t - j)."""
  W = len(w_rows)
  acc = x_taps[0] * w_rows[W - 1]
  for j in range(1, W):
    term = x_taps[j] * w_rows[W - 1 - j]
    acc = acc + (term if oks[j] is None else jnp.where(oks[j], term, 0.0))
  return acc


def _fwd_kernel(*refs, T, W, bt, bc, pad, has_ids):
  if has_ids:
    x_ref, w_ref, ids_ref, y_ref = refs
  else:
    (x_ref, w_ref, y_ref), ids_ref = refs, None
  b, it, ic = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t0 = it * bt
  cols = pl.ds(ic * bc, bc)
  rows = t0 + iota((bt, bc), 0)
  w_rows = [w_ref[j, cols].astype(F32)[None, :] for j in range(W)]
  x_taps = [_masked_load(x_ref, b, t0 - j, bt, cols, (rows - j >= 0) & (rows - j < T),
                         pad).astype(F32) for j in range(W)]
  pre = _pre(x_taps, w_rows, _ok_masks(ids_ref, b, t0, W, T, pad, bt, has_ids))
  y = pre * jax.nn.sigmoid(pre)
  from jax.experimental.pallas import triton as pltriton
  if pad:
    y_ref[b, pl.ds(t0, bt), cols] = y.astype(y_ref.dtype)
  else:
    pltriton.store(y_ref.at[b, pl.ds(t0, bt), cols], y.astype(y_ref.dtype), mask=rows < T)


def _bwd_kernel(*refs, T, W, bt, bc, rows_per, pad, has_ids):
  if has_ids:
    x_ref, w_ref, ids_ref, dy_ref, dx_ref, dw_ref = refs
  else:
    (x_ref, w_ref, dy_ref, dx_ref, dw_ref), ids_ref = refs, None
  b, ip, ic = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(ic * bc, bc)
  w_rows = [w_ref[j, cols].astype(F32)[None, :] for j in range(W)]

  def tile(i, dw):
    s0 = ip * rows_per + i * bt
    rows = s0 + iota((bt, bc), 0)
    # x at rows s + d, d in -(W - 1) .. W - 1: every tap of pre at s .. s + W - 1.
    xs = {d: _masked_load(x_ref, b, s0 + d, bt, cols, (rows + d >= 0) & (rows + d < T),
                          pad).astype(F32) for d in range(-(W - 1), W)}
    dx = jnp.zeros((bt, bc), F32)
    for j in range(W):                   # pre and dpre at rows s + j
      oks = _ok_masks(ids_ref, b, s0 + j, W, T, pad, bt, has_ids)
      pre = _pre([xs[j - i] for i in range(W)], w_rows, oks)
      dy = _masked_load(dy_ref, b, s0 + j, bt, cols, rows + j < T, pad).astype(F32)
      sig = jax.nn.sigmoid(pre)
      dpre = dy * sig * (1.0 + pre * (1.0 - sig))
      dx = dx + (dpre if oks[j] is None else jnp.where(oks[j], dpre, 0.0)) * w_rows[W - 1 - j]
      if j == 0:                         # rows s: each tap's weight gradient, summed over
        dw = [dw[i] + dpre * (xs[-i] if oks[i] is None   # the rows once, after the walk
                              else jnp.where(oks[i], xs[-i], 0.0)) for i in range(W)]
    from jax.experimental.pallas import triton as pltriton
    if pad:
      dx_ref[b, pl.ds(s0, bt), cols] = dx.astype(dx_ref.dtype)
    else:
      pltriton.store(dx_ref.at[b, pl.ds(s0, bt), cols], dx.astype(dx_ref.dtype),
                     mask=rows < T)
    return dw

  n = rows_per // bt
  dw = [jnp.zeros((bt, bc), F32) for _ in range(W)]
  if n == 1:
    dw = tile(0, dw)
  else:
    dw = jax.lax.fori_loop(0, n, tile, dw)
  for i in range(W):                     # dw[W - 1 - i] is tap i's
    dw_ref[b, ip, W - 1 - i, cols] = jnp.sum(dw[i], axis=0)


def _padded(config, W, covered, *arrays):
  """The interpreter's inputs: rows padded by W - 1 before and after the ``covered`` rows
  the grid reaches (module docstring); on the GPU the arrays as they are."""
  if not config.interpret:
    return 0, arrays
  pad = W - 1
  out = []
  for a in arrays:
    widths = [(0, 0)] * a.ndim
    widths[1] = (pad, covered - a.shape[1] + pad)
    out.append(jnp.pad(a, widths))
  return pad, tuple(out)


def _tiles(config, T, C, bt):
  """(bc, the backward program's rows) for C channels and T tokens."""
  bc = block(C, config.bc)
  if bc < 16:
    raise ValueError(f"short_conv: the channels C = {C} need a power-of-two divisor >= 16 "
                     "for the kernels' tiles; use a multiple of 16 channels.")
  return bc, min(config.rows, pl.cdiv(T, bt) * bt)


def conv_silu_fwd(x, w, segment_ids, *, config: ConvConfig):
  """``silu(causal depthwise conv(x, w))`` ``[B, T, C]`` in x's dtype (module docstring)."""
  B, T, C = x.shape
  W = w.shape[0]
  bt = config.bt
  bc, _ = _tiles(config, T, C, bt)
  has_ids = segment_ids is not None
  args = (x,) + ((segment_ids.astype(jnp.int32),) if has_ids else ())
  pad, args = _padded(config, W, pl.cdiv(T, bt) * bt, *args)
  kernel = functools.partial(_fwd_kernel, T=T, W=W, bt=bt, bc=bc, pad=pad, has_ids=has_ids)
  Tp = pl.cdiv(T, bt) * bt if pad else T
  out = jax.ShapeDtypeStruct((B, Tp, C), x.dtype)
  y = call(kernel, out, (B, pl.cdiv(T, bt), C // bc), config=config, num_warps=config.warps,
           num_stages=1, name="short_conv_fwd")(args[0], w, *args[1:])
  return y[:, :T]


def conv_silu_bwd(x, w, segment_ids, dy, *, config: ConvConfig):
  """``(dx in x's dtype, dw float32 [W, C])`` of :func:`conv_silu_fwd` for ``dy``."""
  B, T, C = x.shape
  W = w.shape[0]
  bt = config.bwd_bt
  bc, rows = _tiles(config, T, C, bt)
  has_ids = segment_ids is not None
  n_prog = pl.cdiv(T, rows)
  ids = (segment_ids.astype(jnp.int32),) if has_ids else ()
  pad, padded = _padded(config, W, n_prog * rows, x, *ids, dy.astype(x.dtype))
  kernel = functools.partial(_bwd_kernel, T=T, W=W, bt=bt, bc=bc, rows_per=rows, pad=pad,
                             has_ids=has_ids)
  Tp = n_prog * rows if pad else T
  out = (jax.ShapeDtypeStruct((B, Tp, C), x.dtype),
         jax.ShapeDtypeStruct((B, n_prog, W, C), F32))
  dx, dw = call(kernel, out, (B, n_prog, C // bc), config=config, num_warps=config.warps,
                num_stages=1, name="short_conv_bwd")(padded[0], w, *padded[1:])
  return dx[:, :T], dw.sum(axis=(0, 1))
