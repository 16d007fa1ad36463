"""GLA's Pallas kernels (``docs/design.md`` §2), plugged into ``zeco_jax.chunk_gla``.

Modules: ``config`` (:class:`~pallas_kernels.gla.config.KernelConfig`, grouped per stage,
and :func:`~pallas_kernels.gla.config.default_config`); ``state`` (chunk cumsums and the
decayed q, k; the sequential state pass and state-gradient pass, also in one launch);
``intra`` (intra-chunk scores by tensor-core dots, the 16 x 16 diagonal blocks too where the
decay allows, else exact in log space; output); ``grads`` (dv; dq, dk, dg, with dA formed
inside and the diagonal terms exact in log space where the decay is too strong for dots);
``gpu`` (their composition into fwd / bwd, Triton lowering); ``tpu`` (the Mosaic TPU
variant); ``_common`` (the decay bookkeeping they share).
"""
