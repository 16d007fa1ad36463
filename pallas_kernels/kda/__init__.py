"""Kimi Delta Attention's Pallas kernels (Gated DeltaNet with a decay per key channel),
for ``zeco_jax.chunk_kda``.

Modules: ``config`` (:class:`~pallas_kernels.kda.config.KernelConfig`,
:func:`~pallas_kernels.kda.config.default_config`); ``chunk`` (the per-chunk kernels:
the WY factors, the output, and their backwards); ``pairs`` (the per-channel intra-chunk
matrices A and P with the blocked UT inverse, and their backward); ``walk`` (the forward
state walk and the state-gradient walk, the state decayed per key row); ``gpu`` (their
composition, Triton lowering or the interpreter); ``tpu`` (Mosaic TPU kernels: one fused
forward and one reverse backward kernel, compiled for v5e / v5p / v6e, not run on a chip).
"""
from pallas_kernels.kda.config import KernelConfig, default_config

__all__ = ["KernelConfig", "default_config"]
