"""zeco-jax: ZeCO sequence parallelism for gated linear attention in JAX.

Public API:
  recurrent_gla, chunk_gla_reference   plain-jnp references (the spec)
  chunk_gla                            single-device chunked GLA (custom_vjp; jnp or Pallas)
  all_scan                             the exclusive state scan over a mesh axis (in shard_map)
  zeco_gla, zeco_gla_local             sequence-parallel GLA over a mesh axis
  debug.checked                        checkify wrapper that reports positive log-decays
"""
from zeco_jax import debug
from zeco_jax.scan import all_scan
from zeco_jax.ops import chunk_gla
from zeco_jax.parallel import zeco_gla, zeco_gla_local
from zeco_jax.reference import chunk_gla_reference, recurrent_gla

__all__ = ["all_scan", "chunk_gla", "chunk_gla_reference", "debug", "recurrent_gla",
           "zeco_gla", "zeco_gla_local"]
__version__ = "0.1.0"
