"""Gated DeltaNet's Pallas kernels (``docs/design.md`` §9), plugged into
``zeco_jax.chunk_gated_delta_rule``.

Modules: ``config`` (:class:`~pallas_kernels.gated_delta.config.KernelConfig`,
:func:`~pallas_kernels.gated_delta.config.default_config`); ``chunk`` (the per-chunk
kernels: the WY factors with the blocked UT inverse, the output, and their backwards);
``walk`` (the forward state walk and the state-gradient walk); ``gpu`` (their composition,
Triton lowering or the interpreter).
"""
from pallas_kernels.gated_delta.config import KernelConfig, default_config

__all__ = ["KernelConfig", "default_config"]
