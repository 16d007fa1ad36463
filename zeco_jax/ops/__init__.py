"""The op families, one folder each (FLA's shape): ``reference`` (the spec, and the float64
truths tests and benchmarks share), ``chunked`` (the chunked form in plain jnp), ``op``
(the public op: argument checks, custom_vjp, backend dispatch) and ``parallel`` (the
family's local pass and fix-up over the shared sequence-parallel layer, :mod:`zeco_jax.sp`).

* :mod:`zeco_jax.ops.gla`: gated linear attention (GLA, simple GLA / Mamba2, RetNet,
  Lightning: per-dim, per-head or no decay);
* :mod:`zeco_jax.ops.gated_delta`: Gated DeltaNet (the delta rule with a per-head decay);
* :mod:`zeco_jax.ops.kda`: Kimi Delta Attention (the delta rule with a per-channel decay;
  ``gate`` holds FLA's KDA gate; plain jnp, no kernels yet);
* :mod:`zeco_jax.ops.attention`: softmax attention (reference, the one-device op, and the
  sequence-parallel methods of hybrid models; no state, so no scan).

A family never imports another family's names; what they share is in ``zeco_jax.sp``,
``zeco_jax._linalg``, ``zeco_jax._checks``, ``zeco_jax.segments``,
:mod:`zeco_jax.ops._dispatch` and, for the delta-rule families, ``zeco_jax._chunks`` (the
chunk layout, segment sums, the UT transform and the recurrence over dense chunk
transitions).
"""
