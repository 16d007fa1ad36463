"""``chunk_gla``: the single-device chunked GLA op, with a custom_vjp and backend dispatch.

Backends implement two functions on padded, validated inputs (T a multiple of
``chunk_size``; g float32 ``[B, T, H, K]``; initial_state float32 ``[B, H, K, V]``)::

    fwd(q, k, v, g, *, scale, initial_state, chunk_size) -> (o, final_state)
    bwd(q, k, v, g, do, dht, *, scale, initial_state, chunk_size)
        -> (dq, dk, dv, dg, dh0)

``"jax"`` is :mod:`zeco_jax.chunked` (plain jnp, any platform). ``"pallas"`` is
:mod:`pallas_kernels` (GPU/TPU kernels, interpret mode on CPU). ``"auto"`` picks Pallas
on GPU and TPU when it is available, the jnp path otherwise.
"""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from zeco_jax import _checks
from zeco_jax import chunked
from zeco_jax._vma import match_varying

BACKENDS = ("auto", "jax", "pallas")


def _pallas_backend():
  """The Pallas backend module, or None when it cannot be imported here."""
  try:
    return importlib.import_module("pallas_kernels").backend()
  except (ImportError, AttributeError):
    return None


def resolve_backend(backend: str, *, name: str = "chunk_gla") -> str:
  """Maps ``"auto"`` to a concrete backend for the default platform; validates the name."""
  _checks.check_choice(backend, BACKENDS, arg="backend", name=name)
  if backend == "auto":
    if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") and _pallas_backend() is not None:
      return "pallas"
    return "jax"
  if backend == "pallas" and _pallas_backend() is None:
    raise ValueError(f"{name}: backend='pallas' is not available in this installation "
                     "(pallas_kernels failed to import); use backend='jax' or 'auto'.")
  return backend


def _impl(backend: str):
  return chunked if backend == "jax" else _pallas_backend()


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _chunk_gla_core(q, k, v, g, h0, scale, chunk_size, backend):
  return _impl(backend).fwd(q, k, v, g, scale=scale, initial_state=h0, chunk_size=chunk_size)


def _core_fwd(q, k, v, g, h0, scale, chunk_size, backend):
  impl = _impl(backend)
  kw = dict(scale=scale, initial_state=h0, chunk_size=chunk_size)
  if hasattr(impl, "fwd_res"):      # a backend may keep intermediates for its backward
    out, extra = impl.fwd_res(q, k, v, g, **kw)
  else:
    out, extra = impl.fwd(q, k, v, g, **kw), None
  return out, (q, k, v, g, h0, extra)


def _core_bwd(scale, chunk_size, backend, res, cotangents):
  q, k, v, g, h0, extra = res
  do, dht = cotangents
  impl = _impl(backend)
  kw = dict(scale=scale, initial_state=h0, chunk_size=chunk_size)
  if hasattr(impl, "bwd_res"):
    dq, dk, dv, dg, dh0 = impl.bwd_res(extra, q, k, v, g, do, dht, **kw)
  else:
    dq, dk, dv, dg, dh0 = impl.bwd(q, k, v, g, do, dht, **kw)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype),
          dh0.astype(h0.dtype))


_chunk_gla_core.defvjp(_core_fwd, _core_bwd)


def chunk_gla(q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False,
              chunk_size=64, backend="auto"):
  """Chunked gated linear attention on one device, differentiable.

  ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t`` (token t sees
  itself), computed chunk by chunk (spec section 2). The backward is the chunked backward
  (a reverse state-gradient pass and per-chunk gradients), which recomputes the chunk
  states, so only the inputs are kept for it (the Pallas backend also keeps the float32
  intra-chunk scores, T * H * chunk_size floats): memory O(T * (K + V + chunk_size)),
  never per-token states.

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
    backend: ``"auto"``, ``"jax"`` or ``"pallas"``.

  Returns:
    ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype; final_state float32
    ``[B, H, K, V]`` or None unless ``output_final_state``.
  """
  args = _checks.check_gla_inputs(q, k, v, g, initial_state, scale, name="chunk_gla")
  _checks.check_chunk_size(chunk_size, name="chunk_gla", multiple_of=chunked.SUB_CHUNK)
  backend = resolve_backend(backend)
  B, T, H, K, V = args.B, args.T, args.H, args.K, args.V
  g_full = _checks.full_log_decay(g, B, T, H, K)
  h0 = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  padded = [_checks.pad_time(x, chunk_size) for x in (q, k, v, g_full)]
  # Inside shard_map, give every operand the same varying axes, so the custom_vjp's
  # cotangents match their primals (autodiff of the cast inserts the needed psum).
  padded_h0 = [match_varying(x, *padded, h0) for x in (*padded, h0)]
  o, final = _chunk_gla_core(*padded_h0, args.scale, chunk_size, backend)
  return o[:, :T], (final if output_final_state else None)
