"""``chunk_gla``: the single-device chunked GLA op, with a custom_vjp and backend dispatch.

Backends implement two functions on padded, validated inputs (T a multiple of
``chunk_size``; initial_state float32 ``[B, H, K, V]``; the jnp path also takes None for
no initial state, and ``dht`` None for a final state nobody used)::

    fwd(q, k, v, g, *, scale, initial_state, chunk_size) -> (o, final_state)
    bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size)
        -> (dq, dk, dv, dg, dh0)

g reaches a backend as the caller gave it, in float32: per-dim ``[B, T, H, K]``, per-head
scalar ``[B, T, H]``, or None (no decay); dg comes back in g's shape (None for None). A
backend without a scalar-decay path broadcasts g over K itself and sums dg over K.
Every backend also has ``fwd_res`` (returning ``(out, residual)``; the residual may be
None) and ``bwd_res`` (taking that residual first), to keep intermediates for its backward
(``pallas_kernels.ChunkKernels`` is the protocol).

``"jax"`` is :mod:`zeco_jax.ops.gla.chunked` (plain jnp, any platform). ``"pallas"`` is
``pallas_kernels.backend("gla", platform)``, whose functions also take ``config=`` (a
``pallas_kernels.KernelConfig``): Triton-lowered kernels on GPU, Mosaic TPU kernels on
TPU, the GPU kernels in the Pallas interpreter on CPU. ``"auto"`` picks by the platform the
computation is compiled for (:mod:`zeco_jax.ops._dispatch`, ``docs/design.md`` §8):
Pallas on GPU and TPU; the jnp path on CPU. The Mosaic TPU kernels are compiled by libtpu
ahead of time and checked in the Pallas interpreter; they have not run on a TPU chip here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from zeco_jax import _checks
from zeco_jax import segments
from zeco_jax._vma import match_varying
from zeco_jax.ops import _dispatch
from zeco_jax.ops._dispatch import BACKENDS  # noqa: F401  (re-exported)
from zeco_jax.ops.gla import chunked
from zeco_jax.runtime import target

FAMILY = "gla"


def resolve_backend(backend: str, *, name: str = "chunk_gla", platform=None) -> str:
  """``"jax"`` or ``"pallas"`` for GLA on ``platform`` (:func:`zeco_jax.ops._dispatch.
  resolve_backend`): Pallas on GPU and TPU (Mosaic kernels compiled ahead of time for v5e,
  v5p and v6e and checked in the interpreter: ``docs/design.md`` §8), the jnp path on CPU."""
  return _dispatch.resolve_backend(backend, family=FAMILY, name=name, platform=platform)


def _impl(backend: str, config):
  return chunked if backend == "jax" else _dispatch.kernels(FAMILY, config.platform)


def _options(h0, scale, chunk_size, config):
  if config is not None and h0 is None:     # the kernels take an initial state always
    raise AssertionError("the Pallas backends get a zero initial state from chunk_gla")
  kw = dict(scale=scale, initial_state=h0, chunk_size=chunk_size)
  return kw if config is None else dict(kw, config=config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _chunk_gla_core(q, k, v, g, h0, scale, chunk_size, backend, config):
  return _impl(backend, config).fwd(q, k, v, g, **_options(h0, scale, chunk_size, config))


def _core_fwd(q, k, v, g, h0, scale, chunk_size, backend, config):
  # symbolic_zeros=True: the primals come wrapped (value, perturbed).
  q, k, v, g, h0 = (None if x is None else x.value for x in (q, k, v, g, h0))
  impl = _impl(backend, config)
  kw = _options(h0, scale, chunk_size, config)
  out, extra = impl.fwd_res(q, k, v, g, **kw)   # what it keeps for its backward, or None
  return out, (q, k, v, g, h0, extra)


def _core_bwd(scale, chunk_size, backend, config, res, cotangents):
  """A cotangent that is a symbolic zero (an output nobody used) reaches the jnp path as
  None for the final state, so it computes nothing from it (one chunk: ``chunked.
  _known_zero``), and as zeros elsewhere."""
  q, k, v, g, h0, extra = res
  do, dht = cotangents
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(do.shape, do.dtype)
  if isinstance(dht, SymbolicZero):
    dht = None if config is None else jnp.zeros(dht.shape, dht.dtype)
  impl = _impl(backend, config)
  kw = _options(h0, scale, chunk_size, config)
  dq, dk, dv, dg, dh0 = impl.bwd_res(extra, q, k, v, g, do, dht, **kw)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None if g is None else dg.astype(g.dtype), None if h0 is None else dh0.astype(h0.dtype))


_chunk_gla_core.defvjp(_core_fwd, _core_bwd, symbolic_zeros=True)


def _check_kernel_config(kernel_config, *, name):
  if kernel_config is None:
    return
  if not _dispatch.kernels_installed() or not isinstance(
      kernel_config, _dispatch.kernel_package().KernelConfig):
    raise ValueError(f"{name}: `kernel_config` must be a pallas_kernels.KernelConfig or None "
                     f"(the default for the target and shape), got {kernel_config!r}. Build "
                     "one with pallas_kernels.default_config(platform, B, T, H, K, V, dtype) "
                     "and change fields with its .replace(out_bv=..., ...).")


def chunk_gla(q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False,
              chunk_size=64, backend="auto", kernel_config=None, segment_ids=None):
  """Chunked gated linear attention on one device, differentiable.

  ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t`` (token t sees
  itself), computed chunk by chunk (``docs/design.md`` §2). The backward is the chunked
  backward (a reverse state-gradient pass and per-chunk gradients), which recomputes the
  chunk states, so only the inputs are kept for it (the Pallas backend also keeps the
  float32 intra-chunk scores, T * H * chunk_size floats): memory O(T * (K + V +
  chunk_size)), never per-token states.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; one floating dtype (bf16 or float32).
    g: log-decay ``[B, T, H, K]`` (per-dim, GLA), ``[B, T, H]`` (scalar per head: simple
      GLA, Mamba2, RetNet, Lightning) or None (plain linear attention). Must be <= 0, the
      log of a decay in (0, 1]; positive values overflow (see
      :func:`zeco_jax.debug.checked` to catch them).
    scale: score scale, default ``K ** -0.5``.
    initial_state: ``[B, H, K, V]`` state before the first token, or None for zeros.
    output_final_state: also return the float32 state after the last token.
    chunk_size: tokens per chunk, a multiple of 16. Any T works (padded internally with
      tokens that leave the state unchanged).
    backend: ``"auto"``, ``"jax"`` or ``"pallas"``, resolved for the platform the inputs
      are compiled for (:func:`resolve_backend`).
    kernel_config: a ``pallas_kernels.KernelConfig`` for the Pallas backend (which
      platform's kernels, the interpreter or not, launch parameters), or None for
      ``pallas_kernels.default_config`` of the target and shape. It is a static argument
      of the op's custom_vjp: each configuration compiles its own program. Ignored by the
      jnp path.
    segment_ids: None (one sequence per row) or integer ``[B, T]``: packed documents
      (:mod:`zeco_jax.segments`, ``docs/design.md`` §10). A document starts at t = 0 and
      where the id changes; the state resets to zero at every start t > 0, so
      ``initial_state`` seeds the document holding token 0 and the final state is the
      last document's. Negative ids are padding: no write, zero output, state unchanged,
      zero gradients.

  Returns:
    ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state float32
    ``[B, H, K, V]`` or None unless ``output_final_state``.
  """
  name = "chunk_gla"
  args = _checks.check_gla_inputs(q, k, v, g, initial_state, scale, name=name)
  _checks.check_chunk_size(chunk_size, name=name, multiple_of=chunked.SUB_CHUNK)
  _check_kernel_config(kernel_config, name=name)
  if segment_ids is not None:
    segments.check_segment_ids(segment_ids, args.B, args.T, name=name)
    q, k, g = segments.apply(q, k, g, segment_ids)
  found = target.target_of(q, k, v, g, initial_state)
  backend = resolve_backend(backend, name=name, platform=found.platform)
  B, H, K, V = args.B, args.H, args.K, args.V
  config = None
  if backend == "pallas":
    config = kernel_config or _dispatch.kernel_package().default_config(
        found.platform, B, args.T, H, K, V, q.dtype, sm_count=found.num_cores)
  # No initial state: None on the jnp path (which then computes nothing from it), zeros
  # for the kernels.
  h0 = None if initial_state is None else initial_state.astype(jnp.float32)
  if h0 is None and backend == "pallas":
    h0 = jnp.zeros((B, H, K, V), jnp.float32)
  g = None if g is None else g.astype(jnp.float32)
  padded = [None if x is None else _checks.pad_time(x, chunk_size) for x in (q, k, v, g)]
  # Inside shard_map, give every operand the same varying axes, so the custom_vjp's
  # cotangents match their primals (autodiff of the cast inserts the needed psum).
  arrays = [x for x in (*padded, h0) if x is not None]
  padded_h0 = [None if x is None else match_varying(x, *arrays) for x in (*padded, h0)]
  o, final = _chunk_gla_core(*padded_h0, args.scale, chunk_size, backend, config)
  return o[:, :args.T], (final if output_final_state else None)
