"""Gated DeltaNet's two sequential walks over chunks: the delta-rule walks of
:mod:`pallas_kernels._delta` with the decay per head, given as ``gc`` ``[B, T, H]`` (b, g
summed from the chunk start; its last entry in a chunk is gamma, the state's decay):

  state_walk(w, u, kd, gc, h0, *, chunk_size, config, store_dtype) -> (h, v_new, final)
  grad_walk(qb, gc, w, kd, do, dvl, dht, *, chunk_size, config, store_dtype)
      -> (dH, dv_new, dh0)
"""
import functools

from pallas_kernels import _delta

state_walk = functools.partial(_delta.state_walk, prefix="gdn")
grad_walk = functools.partial(_delta.grad_walk, prefix="gdn")
