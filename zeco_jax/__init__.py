"""zeco-jax: ZeCO sequence parallelism for gated linear attention in JAX.

Public API:
  recurrent_gla, chunk_gla_reference   plain-jnp references (the spec)
  chunk_gla                            single-device chunked GLA (custom_vjp; jnp or Pallas)
"""
from zeco_jax.ops import chunk_gla
from zeco_jax.reference import chunk_gla_reference, recurrent_gla

__all__ = ["chunk_gla", "chunk_gla_reference", "recurrent_gla"]
__version__ = "0.1.0"
