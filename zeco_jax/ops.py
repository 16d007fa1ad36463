"""``chunk_gla``: the single-device chunked GLA op, with a custom_vjp and backend dispatch.

Backends implement two functions on padded, validated inputs (T a multiple of
``chunk_size``; initial_state float32 ``[B, H, K, V]``)::

    fwd(q, k, v, g, *, scale, initial_state, chunk_size) -> (o, final_state)
    bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size)
        -> (dq, dk, dv, dg, dh0)

g reaches a backend as the caller gave it, in float32: per-dim ``[B, T, H, K]``, per-head
scalar ``[B, T, H]``, or None (no decay); dg comes back in g's shape (None for None). A
backend without a scalar-decay path broadcasts g over K itself and sums dg over K.
A backend may also offer ``fwd_res`` (returning ``(out, residual)``) and ``bwd_res``
(taking that residual first) to keep intermediates for its backward.

``"jax"`` is :mod:`zeco_jax.chunked` (plain jnp, any platform). ``"pallas"`` is
:mod:`pallas_kernels`, whose functions also take ``config=`` (a
``pallas_kernels.KernelConfig``): Triton-lowered kernels on GPU, Mosaic TPU kernels on
TPU, the GPU kernels in the Pallas interpreter on CPU. ``"auto"`` picks by the platform the
computation is compiled for (:func:`zeco_jax.target.platform_of`, ``docs/design.md`` §8):
Pallas on GPU and TPU; the jnp path on CPU. The Mosaic TPU kernels are compiled by libtpu
ahead of time and checked in the Pallas interpreter; they have not run on a TPU chip here.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings

import jax
import jax.numpy as jnp

from zeco_jax import _checks
from zeco_jax import chunked
from zeco_jax import segments
from zeco_jax import target
from zeco_jax._vma import match_varying

BACKENDS = ("auto", "jax", "pallas")
_KERNELS = "pallas_kernels"


def _kernels_installed() -> bool:
  return importlib.util.find_spec(_KERNELS) is not None


def _kernel_package():
  """pallas_kernels; any error inside it (a broken install) propagates."""
  return importlib.import_module(_KERNELS)


@functools.lru_cache(maxsize=None)
def _say_jax_fallback(platform: str, reason: str) -> None:
  """Warns once per process, platform and reason that "auto" runs the jnp path."""
  warnings.warn(f"zeco_jax: backend='auto' on {platform} runs the jnp path: {reason}. Pass "
                "backend='jax' to choose it explicitly (and silence this), or "
                "backend='pallas' to use the kernels anyway.", stacklevel=3)


def resolve_backend(backend: str, *, name: str = "chunk_gla", platform=None) -> str:
  """Maps ``backend`` to ``"jax"`` or ``"pallas"`` for the target ``platform``.

  ``platform``: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``zeco_jax.target.platform_of(...)`` of
  the inputs or the mesh); None: :func:`zeco_jax.target.platform_of` of the context.
  ``"auto"`` is Pallas on GPU and TPU (Mosaic kernels, compiled ahead of time for v5e, v5p
  and v6e and checked in the interpreter: ``docs/design.md`` §8), the jnp path on CPU
  (silently) and without the kernel package (said once per process). ``"pallas"`` imports the platform's kernels
  here, so a broken kernel package raises instead of falling back.
  """
  _checks.check_choice(backend, BACKENDS, arg="backend", name=name)
  if platform is None:
    platform = target.platform_of()
  _checks.check_choice(platform, target.PLATFORMS, arg="platform", name=name)
  if backend == "jax" or (backend == "auto" and platform == "cpu"):
    return "jax"
  if not _kernels_installed():
    if backend == "auto":
      _say_jax_fallback(platform, f"the kernel package `{_KERNELS}` is not installed")
      return "jax"
    raise ValueError(f"{name}: backend='pallas' needs the kernel package `{_KERNELS}`, which "
                     "is not installed; reinstall zeco-jax, or use backend='jax'.")
  _kernel_package().backend(platform)
  return "pallas"


def _impl(backend: str, config):
  return chunked if backend == "jax" else _kernel_package().backend(config.platform)


def _options(h0, scale, chunk_size, config):
  kw = dict(scale=scale, initial_state=h0, chunk_size=chunk_size)
  return kw if config is None else dict(kw, config=config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _chunk_gla_core(q, k, v, g, h0, scale, chunk_size, backend, config):
  return _impl(backend, config).fwd(q, k, v, g, **_options(h0, scale, chunk_size, config))


def _core_fwd(q, k, v, g, h0, scale, chunk_size, backend, config):
  impl = _impl(backend, config)
  kw = _options(h0, scale, chunk_size, config)
  if hasattr(impl, "fwd_res"):      # a backend may keep intermediates for its backward
    out, extra = impl.fwd_res(q, k, v, g, **kw)
  else:
    out, extra = impl.fwd(q, k, v, g, **kw), None
  return out, (q, k, v, g, h0, extra)


def _core_bwd(scale, chunk_size, backend, config, res, cotangents):
  q, k, v, g, h0, extra = res
  do, dht = cotangents
  impl = _impl(backend, config)
  kw = _options(h0, scale, chunk_size, config)
  if hasattr(impl, "bwd_res"):
    dq, dk, dv, dg, dh0 = impl.bwd_res(extra, q, k, v, g, do, dht, **kw)
  else:
    dq, dk, dv, dg, dh0 = impl.bwd(q, k, v, g, do, dht, **kw)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None if g is None else dg.astype(g.dtype), dh0.astype(h0.dtype))


_chunk_gla_core.defvjp(_core_fwd, _core_bwd)


def _check_kernel_config(kernel_config, *, name):
  if kernel_config is None:
    return
  if not _kernels_installed() or not isinstance(kernel_config,
                                                _kernel_package().KernelConfig):
    raise ValueError(f"{name}: `kernel_config` must be a pallas_kernels.KernelConfig or None "
                     f"(the default for the target and shape), got {kernel_config!r}. Build "
                     "one with pallas_kernels.default_config(platform, B, T, H, K, V, dtype) "
                     "and change fields with dataclasses.replace.")


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
    config = kernel_config or _kernel_package().default_config(
        found.platform, B, args.T, H, K, V, q.dtype, sm_count=found.num_cores)
  h0 = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  g = None if g is None else g.astype(jnp.float32)
  padded = [None if x is None else _checks.pad_time(x, chunk_size) for x in (q, k, v, g)]
  # Inside shard_map, give every operand the same varying axes, so the custom_vjp's
  # cotangents match their primals (autodiff of the cast inserts the needed psum).
  arrays = [x for x in (*padded, h0) if x is not None]
  padded_h0 = [None if x is None else match_varying(x, *arrays) for x in (*padded, h0)]
  o, final = _chunk_gla_core(*padded_h0, args.scale, chunk_size, backend, config)
  return o[:, :args.T], (final if output_final_state else None)
