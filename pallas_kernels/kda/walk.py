"""Kimi Delta Attention's two sequential walks over chunks: the delta-rule walks of
:mod:`pallas_kernels._delta` with a decay per key row, given as ``eg = e^{gamma}``
``[B, H, N, K]`` (:func:`pallas_kernels.kda.chunk.wu`'s):

  state_walk(w, u, kd, eg, h0, *, chunk_size, config, store_dtype) -> (h, v_new, final)
  grad_walk(qb, eg, w, kd, do, dvl, dht, *, chunk_size, config, store_dtype)
      -> (dH, dv_new, dh0)
"""
import functools

from pallas_kernels import _delta

state_walk = functools.partial(_delta.state_walk, prefix="kda")
grad_walk = functools.partial(_delta.grad_walk, prefix="kda")
