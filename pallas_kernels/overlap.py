"""Sequential state walks side by side with chunk-parallel work, in one launch.

A state pass has only ``B * H * (K / BK) * (V / BV)`` programs (64 at the benchmark's
first shape, on a 132-SM GPU) and walks all N chunks in order, so by itself it leaves
most of the GPU idle. These kernels put it in one flat grid with a stage that does not
depend on it: its programs come first (the GPU starts blocks roughly in order), and the
chunk-parallel programs fill the remaining SMs.

* forward: state pass | off-diagonal scores (``intra.scores_off_body``);
* backward: state pass | state-gradient pass | diagonal dq/dk terms
  (``grads.diag_grad_body``); without the state pass when the forward kept the states.

Both are launch options (``TUNE["overlap_fwd"]``, ``TUNE["overlap_bwd"]``); the results
are the same as the separate launches'.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm
from pallas_kernels import grads
from pallas_kernels import intra
from pallas_kernels import state


def _fwd_kernel(k_ref, v_ref, q_ref, bc_ref, h0_ref, h_ref, ht_ref, a_ref, *, state_grid,
                off_grid, state_kw, off_kw):
  p = pl.program_id(0)
  G = cm.prod(state_grid)

  def walk():
    state._state_walk(k_ref, v_ref, bc_ref, h0_ref, h_ref, ht_ref, *cm.unravel(p, state_grid),
                      **state_kw)

  def off():
    intra.scores_off_body(q_ref, k_ref, bc_ref, a_ref, *cm.unravel(p - G, off_grid), **off_kw)

  jax.lax.cond(p < G, walk, off)


def state_and_scores_off(q, k, v, bc, h0, *, chunk_size):
  """(h, final, A without its diagonal blocks) in one launch."""
  B, T, H, _ = q.shape
  C = chunk_size
  N = T // C
  state_grid, state_kw = state.walk_params(k, v, chunk_size=C)
  off_grid = (B, H, N)
  kern = functools.partial(_fwd_kernel, state_grid=state_grid, off_grid=off_grid,
                           state_kw=state_kw, off_kw=intra.scores_off_params(q, chunk_size=C))
  out = state.walk_outputs(k, v, chunk_size=C, states=True, grads=False) + (
      jax.ShapeDtypeStruct((B, H, N, C, C), cm.F32),)
  return state.walk_call(kern, out, (cm.prod(state_grid) + cm.prod(off_grid),),
                         "gla_state_pass_scores")(k, v, q, bc, h0)


def _bwd_kernel(*refs, states, state_grid, diag_grid, state_kw, scale, diag_kw):
  if states:
    (k_ref, v_ref, q_ref, do_ref, bc_ref, h0_ref, dht_ref, da_ref,
     h_ref, ht_ref, dh_ref, dh0_ref, dqd_ref, dkd_ref) = refs
  else:
    k_ref, q_ref, do_ref, bc_ref, dht_ref, da_ref, dh_ref, dh0_ref, dqd_ref, dkd_ref = refs
  p = pl.program_id(0)
  G = cm.prod(state_grid)
  W = 2 * G if states else G                  # programs of the walks, first in the grid

  def grad_walk(i):
    state._grad_walk(q_ref, do_ref, bc_ref, dht_ref, dh_ref, dh0_ref,
                     *cm.unravel(i, state_grid), scale=scale, **state_kw)

  def walks():
    if states:
      jax.lax.cond(
          p < G,
          lambda: state._state_walk(k_ref, v_ref, bc_ref, h0_ref, h_ref, ht_ref,
                                    *cm.unravel(p, state_grid), **state_kw),
          lambda: grad_walk(p - G))
    else:
      grad_walk(p)

  def diag():
    grads.diag_grad_body(q_ref, k_ref, bc_ref, da_ref, dqd_ref, dkd_ref,
                         *cm.unravel(p - W, diag_grid), **diag_kw)

  jax.lax.cond(p < W, walks, diag)


def passes_and_diag_grads(q, k, v, do, bc, h0, dht, dA, *, scale, chunk_size, states=True):
  """(h, dH, dh0, (dq_d, dk_d)) in one launch. With ``states=False`` (the chunk states
  kept from the forward) only the state-gradient walk runs beside the diagonal terms, and
  h is returned as None."""
  C = chunk_size
  state_grid, state_kw = state.walk_params(k, v, chunk_size=C, walks=2 if states else 1)
  diag_grid, diag_kw = grads.diag_grad_grid(q, chunk_size=C)
  kern = functools.partial(_bwd_kernel, states=states, state_grid=state_grid,
                           diag_grid=diag_grid, state_kw=state_kw, scale=scale,
                           diag_kw=diag_kw)
  part = jax.ShapeDtypeStruct(q.shape, cm.diag_grads_dtype(q.dtype))
  out = state.walk_outputs(k, v, chunk_size=C, states=states, grads=True) + (part, part)
  walks = (2 if states else 1) * cm.prod(state_grid)
  call = state.walk_call(kern, out, (walks + cm.prod(diag_grid),),
                         "gla_state_passes_diag_grads" if states else "gla_state_grads_diag")
  if not states:
    dH, dh0, dq_d, dk_d = call(k, q, do, bc, dht, dA)
    return None, dH, dh0, (dq_d, dk_d)
  h, _, dH, dh0, dq_d, dk_d = call(k, v, q, do, bc, h0, dht, dA)
  return h, dH, dh0, (dq_d, dk_d)
