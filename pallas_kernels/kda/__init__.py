"""Kimi Delta Attention's Pallas kernels (Gated DeltaNet with a decay per key channel),
for ``zeco_jax.chunk_kda``.

Modules: ``config`` (:class:`~pallas_kernels.kda.config.KernelConfig`,
:func:`~pallas_kernels.kda.config.default_config`); ``chunk`` (the per-chunk kernels:
the per-channel intra-chunk matrices A and P with the blocked UT inverse, the WY factors,
the output, and their backwards); ``walk`` (the forward state walk and the state-gradient
walk, the state decayed per key row); ``gpu`` (their composition, Triton lowering or the
interpreter). No TPU kernels yet.
"""
from pallas_kernels.kda.config import KernelConfig, default_config

__all__ = ["KernelConfig", "default_config"]
