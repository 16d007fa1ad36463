"""Gated DeltaNet's two sequential walks over chunks: the delta-rule walks of
:mod:`pallas_kernels._delta` with one decay per head and chunk, ``eg = e^{gamma}`` ``[B, H,
N]`` (:func:`chunk_decay` of the wu kernel's ``gc``):

  state_walk(w, u, kd, eg, h0, *, chunk_size, config, store_dtype) -> (h, v_new, final)
  grad_walk(qb, eg, w, kd, do, dvl, dht, *, chunk_size, config, store_dtype)
      -> (dH, dv_new, dh0)
"""
import functools

import jax.numpy as jnp

from pallas_kernels import _delta

state_walk = functools.partial(_delta.state_walk, prefix="gdn")
grad_walk = functools.partial(_delta.grad_walk, prefix="gdn")


def chunk_decay(gc, chunk_size: int):
  """``e^{gamma}`` per chunk, float32 ``[B, H, N]``, from ``gc`` ``[B, T, H]`` (g summed
  from the chunk start, :func:`pallas_kernels.gated_delta.chunk.wu`'s): its last entry in
  each chunk, g summed over the whole chunk."""
  return jnp.exp(gc[:, chunk_size - 1::chunk_size, :]).transpose(0, 2, 1)
