"""The delta-rule families' kernel path (Gated DeltaNet, Kimi Delta Attention): which
backend runs (:func:`kernel_setup`), the kernels behind one custom_vjp
(:func:`kernel_recurrence`: keeps the inputs and what the kernels' forward keeps, the
chunk states with ``save_states``), and the sequence-parallel local pass on the kernels
(:func:`local_pass_ops`: the widened state's forward, the plain backward).

A family's kernels are ``pallas_kernels.backend(family, platform)`` (``fwd`` / ``fwd_res``
/ ``bwd_res`` on padded inputs, g and beta float32, an initial state always given) with
the family's ``KernelConfig``; its op checks its own arguments first.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from zeco_jax import _checks
from zeco_jax import _chunks
from zeco_jax._vma import match_varying
from zeco_jax.ops import _dispatch
from zeco_jax.runtime import target
from zeco_jax.runtime.target import platform_of


def check_kernel_config(kernel_config, *, family, name):
  """None, or the family's ``pallas_kernels.<family>.KernelConfig``."""
  if kernel_config is None:
    return
  if not _dispatch.kernels_installed() or not isinstance(
      kernel_config, _dispatch.kernel_package().config_type(family)):
    raise ValueError(f"{name}: `kernel_config` must be a pallas_kernels.{family}."
                     f"KernelConfig or None (the default for the target and shape), got "
                     f"{kernel_config!r}. Build one with pallas_kernels.{family}."
                     "default_config(platform, B, T, H, K, V, dtype).")


def kernel_setup(backend, kernel_config, arrays, B, T, H, K, V, dtype, *, chunk_size, family,
                 name):
  """``(backend, config)``: the backend resolved for the platform ``arrays`` are compiled
  for (:func:`zeco_jax.ops._dispatch.resolve_backend`), and the kernels' launch
  configuration (None on the jnp path; None given: the family's default for the target,
  shape, dtype and ``chunk_size``)."""
  check_kernel_config(kernel_config, family=family, name=name)
  found = target.target_of(*arrays)
  backend = _dispatch.resolve_backend(backend, family=family, name=name,
                                      platform=found.platform)
  if backend == "jax":
    return backend, None
  return backend, kernel_config or _dispatch.kernel_package().family_default_config(
      family, found.platform, B, T, H, K, V, dtype, sm_count=found.num_cores,
      chunk_size=chunk_size)


def check_kernel_dims(K, V, chunk_size, *, name):
  """The kernels' shape contract, as a ValueError at trace time."""
  for arg, d in (("K (q.shape[-1])", K), ("chunk_size", chunk_size)):
    if d < 16 or d & (d - 1):
      raise ValueError(f"{name}: backend='pallas' needs {arg} a power of two >= 16, got {d}; "
                       "use backend='jax' for other sizes.")
  if V < 16 or V % 16:
    raise ValueError(f"{name}: backend='pallas' needs V (v.shape[-1]) a multiple of 16, got "
                     f"{V}; use backend='jax' for other sizes.")


def _kernels(family, config):
  return _dispatch.kernels(family, config.platform)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _core(q, k, v, g, beta, h0, scale, chunk_size, family, config):
  """The family's kernels on padded inputs: ``(o, final_state)``."""
  return _kernels(family, config).fwd(q, k, v, g, beta, scale=scale, initial_state=h0,
                                      chunk_size=chunk_size, config=config)


def _core_fwd(q, k, v, g, beta, h0, scale, chunk_size, family, config):
  q, k, v, g, beta, h0 = (x.value for x in (q, k, v, g, beta, h0))
  out, res = _kernels(family, config).fwd_res(q, k, v, g, beta, scale=scale, initial_state=h0,
                                              chunk_size=chunk_size, config=config)
  return out, (q, k, v, g, beta, h0, res)   # the inputs (and one state per chunk, if kept)


def _core_bwd(scale, chunk_size, family, config, res, cotangents):
  q, k, v, g, beta, h0, kept = res
  do, dht = cotangents
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(do.shape, do.dtype)
  if isinstance(dht, SymbolicZero):
    dht = jnp.zeros(dht.shape, dht.dtype)
  V = v.shape[-1]                      # the backward takes v as wide as the state
  wide_v = jnp.pad(v, ((0, 0),) * 3 + ((0, h0.shape[-1] - V),))
  dq, dk, dv, dg, dbeta, dh0 = _kernels(family, config).bwd_res(
      kept, q, k, wide_v, g, beta, do, dht, scale=scale, initial_state=h0,
      chunk_size=chunk_size, config=config)
  dv = dv[..., :V]
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype),
          dbeta.astype(beta.dtype), dh0.astype(h0.dtype))


_core.defvjp(_core_fwd, _core_bwd, symbolic_zeros=True)


def kernel_recurrence(q, k, v, g, beta, h0, scale, C, config, *, family):
  """``(o [B, T, H, V] in v's dtype, final float32)`` by the family's kernels: pads T to a
  multiple of C (tokens that change nothing) and g, beta to float32; h0 None means zeros.
  A given h0 may have more value columns than v (the widened local pass): they get no
  values, and o and the final state have h0's columns."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  h0 = jnp.zeros((B, H, K, V), jnp.float32) if h0 is None else h0.astype(jnp.float32)
  o, final = _core(*_kernel_inputs(C, (q, k, v, g, beta), h0), scale, C, family, config)
  return o[:, :T], final


def _kernel_inputs(C, tokens, *others):
  """The kernels' inputs: the per-token arrays ``tokens`` (q, k, v, g, beta, then any
  more) with T padded to a multiple of C (tokens that change nothing), g and beta float32,
  then ``others`` as they are; all varying over the same manual axes."""
  q, k, v, g, beta, *more = tokens
  arrays = [_checks.pad_time(x, C) for x in (q, k, v, g.astype(jnp.float32),
                                             beta.astype(jnp.float32), *more)]
  arrays += others
  return [match_varying(x, *arrays) for x in arrays]


def _widened_state(v, K):
  """The initial state ``[0, I]`` ``[B, H, K, V + K]``: the widened state, which carries
  the prefix products of the chunk transitions (the segment transition and the fix-up
  rows of the local pass) in its last K columns. v stays as it is: the kernels give the
  state's columns past v's no values (u is zero there), which is what K zero columns of
  v would give, without writing them or forming u on them."""
  B, _, H, V = v.shape
  return jnp.concatenate([jnp.zeros((B, H, K, V), jnp.float32),
                          jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))], -1)


def _kernel_local_pass(family, wide, plain, scale, C, chunked_op):
  """:class:`zeco_jax._chunks.LocalPass` on the family's kernels: the widened pass with the
  launch configuration ``wide`` (V + K columns), the plain backward with ``plain``. With
  ``wide.save_states`` (and always on TPU, whose backward kernel reads kept states) the
  widened pass keeps its chunk states ``[B, H, N, K, V + K]`` and the plain backward's are
  formed from them; else it keeps none and the plain backward walks its states again from
  the received state, as the op's backward does with ``save_states`` off."""
  keep = wide.save_states or wide.platform == "tpu"
  wide = wide.replace(save_states=keep)

  def widened(q, k, v, g, beta):
    h0 = _widened_state(v, q.shape[-1])
    return kernel_recurrence(q, k, v, g, beta, h0, scale, C, wide, family=family)

  def widened_res(q, k, v, g, beta):
    if not keep:
      return widened(q, k, v, g, beta), None
    T = q.shape[1]
    h0 = _widened_state(v, q.shape[-1])
    *arrays, h0 = _kernel_inputs(C, (q, k, v, g, beta), h0)
    (o, final), res = _kernels(family, wide).fwd_res(*arrays, scale=scale, initial_state=h0,
                                                     chunk_size=C, config=wide)
    return (o[:, :T], final), res.h

  def backward(q, k, v, g, beta, h0, states, do, dht):
    T = q.shape[1]
    kept = () if states is None else (states,)
    padded = _kernel_inputs(C, (q, k, v, g, beta, do.astype(v.dtype)), h0,
                            dht.astype(jnp.float32), *kept)
    pq, pk, pv, pg, pbeta, pdo, h0, dht = padded[:8]
    states = padded[8] if kept else None
    impl = _kernels(family, plain)
    res = impl.Residual(states)              # the chunk states h, or None: walked again
    grads = impl.bwd_res(res, pq, pk, pv, pg, pbeta, pdo, dht, scale=scale, initial_state=h0,
                         chunk_size=C, config=plain)[:5]
    return tuple(d[:, :T].astype(x.dtype) for d, x in zip(grads, (q, k, v, g, beta)))

  return _chunks.LocalPass(widened=widened, widened_res=widened_res, backward=backward,
                           chunked_op=chunked_op)


def sharded_backend(backend, kernel_config, q, mesh, args, chunk_size, *, family, name):
  """A sequence-parallel op's backend, resolved for the mesh's platform (its arguments
  checked at trace time, before the shard_map)."""
  check_kernel_config(kernel_config, family=family, name=name)
  backend = _dispatch.resolve_backend(backend, family=family, name=name,
                                      platform=platform_of(q, mesh=mesh))
  if backend == "pallas":
    check_kernel_dims(args.K, args.V, chunk_size, name=name)
  return backend


def local_pass_ops(backend, kernel_config, q, args, chunk_size, *, family, name, terms,
                   chunked_op):
  """A delta-rule family's local pass (:class:`zeco_jax._chunks.LocalPass`) on the jnp
  chunked form (``terms``, the family's chunk terms taking ``scale=``) or on its kernels:
  the widened pass with a configuration for V + K columns (``kernel_config`` is for that
  width), the backward with the default for V columns; the op with ``backend="pallas"``
  for LASP-1's ring. Without a ``kernel_config`` the widened pass keeps no chunk states
  (``save_states`` off, whatever the op's default): its kept states, ``[K, V + K]`` a
  chunk, have not been timed with the forward live (``docs/kernels.md``)."""
  backend, wide = kernel_setup(backend, kernel_config, (q,), args.B, args.T, args.H, args.K,
                               args.V + args.K, q.dtype, chunk_size=chunk_size, family=family,
                               name=name)
  if backend == "jax":
    return _chunks.jnp_local_pass(functools.partial(terms, scale=args.scale), chunk_size,
                                  chunked_op)
  if kernel_config is None:
    wide = wide.replace(save_states=False)
  check_kernel_dims(args.K, args.V, chunk_size, name=name)
  _, plain = kernel_setup(backend, None, (q,), args.B, args.T, args.H, args.K, args.V, q.dtype,
                          chunk_size=chunk_size, family=family, name=name)
  return _kernel_local_pass(family, wide, plain, args.scale, chunk_size,
                            functools.partial(chunked_op, backend="pallas",
                                              kernel_config=kernel_config))
