"""ZeCO sequence-parallel GLA: ``zeco_gla`` over a mesh axis, and its per-shard body.

Forward on the rank holding tokens ``[pL, (p+1)L)`` (spec section 3):

1. local chunked GLA with a zero initial state -> local outputs and the local final
   state ``S_p``; segment decay ``lam_p = exp(sum of g over the segment)``;
2. All-Scan of ``(S_p, lam_p)`` -> ``X_p``, the true state entering the segment;
3. fix-up, one GEMM: ``o += scale * (q * exp(c)) @ X_p`` with ``c`` the cumulative
   log-decay from the segment start.

Nothing in step 1's output path depends on ``X_p``, so XLA can run the intra-chunk work
while the All-Scan's point-to-point sends are in flight. The backward composes the parts'
own backwards (spec section 5): the fix-up's transpose gives ``dX_loc``, the All-Scan's
custom_vjp runs the reverse All-Scan on it, and the local chunked backward receives the
segment's final-state cotangent ``D_p`` through ``S_p``. Beyond the inputs, only ``X_p``
(one state per layer, independent of T and P) is saved for it.

Peers, for measurement: ``method="all_gather"`` (LASP-2) and ``"ring"`` (LASP-1: the
local output is computed only after the state has arrived, so nothing overlaps).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from zeco_jax import _checks
from zeco_jax import scan as _all_scan
from zeco_jax import chunked
from zeco_jax.ops import chunk_gla, resolve_backend

METHODS = ("all_scan", "all_gather", "ring", "tree")
_SCAN_METHOD = {"all_scan": "pipeline", "all_gather": "all_gather", "ring": "serial",
                "tree": "tree"}
_HI = lax.Precision.HIGHEST


def _resolve_num_blocks(num_blocks, method, P_size, B, H, K, V, *, name):
  if method != "all_scan":
    return 1
  if num_blocks is None:
    return _all_scan.default_num_blocks(P_size, 4 * B * H * K * V, V)
  if (not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1
      or V % num_blocks):
    raise ValueError(f"{name}: `num_blocks` must be a positive int dividing the value dim "
                     f"V = {V} (the state is split along V), got {num_blocks!r}. Try one of "
                     f"{[d for d in range(1, V + 1) if V % d == 0]} or None for the default.")
  return num_blocks


def _check_args(q, k, v, g, initial_state, scale, chunk_size, method, backend, *, name):
  """The trace-time checks zeco_gla and zeco_gla_local share: (checked args, backend)."""
  args = _checks.check_gla_inputs(q, k, v, g, initial_state, scale, name=name)
  _checks.check_chunk_size(chunk_size, name=name, multiple_of=chunked.SUB_CHUNK)
  _checks.check_choice(method, METHODS, arg="method", name=name)
  return args, resolve_backend(backend, name=name)


def zeco_gla_local(q, k, v, g=None, *, axis_name, method="all_scan", num_blocks=None,
                   chunk_size=64, scale=None, initial_state=None, output_final_state=False,
                   backend="auto"):
  """The per-shard body of :func:`zeco_gla`, for code already inside its own shard_map.

  Takes this rank's contiguous segment of the sequence (``q, k [B, L, H, K]``, ...) and
  the mesh axis name the sequence is split over; ``initial_state`` is the state before
  the whole sequence (the same on every rank of ``axis_name``).

  Returns ``(o, state_after_segment)``: o for this segment, and (if
  ``output_final_state``) the float32 state after this rank's last token. On the last
  rank of the axis that is the final state of the whole sequence.
  """
  name = "zeco_gla_local"
  args, backend = _check_args(q, k, v, g, initial_state, scale, chunk_size, method, backend,
                              name=name)
  B, L, H, K, V, scale = args.B, args.T, args.H, args.K, args.V, args.scale
  P_size = lax.axis_size(axis_name)
  nb = _resolve_num_blocks(num_blocks, method, P_size, B, H, K, V, name=name)

  f32 = jnp.float32
  g_full = _checks.full_log_decay(g, B, L, H, K)
  seg_decay = jnp.exp(jnp.sum(g_full, axis=1))      # lam_p, [B, H, K]
  scan = functools.partial(_all_scan.all_scan, axis_name=axis_name, num_blocks=nb,
                           method=_SCAN_METHOD[method], initial=initial_state)
  local = functools.partial(chunk_gla, scale=scale, chunk_size=chunk_size, backend=backend)

  if method == "ring":
    # LASP-1: the segment's state from one GEMM (exp(c_L - c_t) <= 1), the serial chain,
    # then the whole local pass starting from the received state: compute after receive.
    c = jnp.cumsum(g_full, axis=1)
    seg_state = jnp.einsum("bthk,bthv->bhkv", k.astype(f32) * jnp.exp(c[:, -1:] - c),
                           v.astype(f32), precision=_HI)
    entering, after = scan(seg_state, seg_decay)
    o, _ = local(q, k, v, g, initial_state=entering)
  else:
    o_local, seg_state = local(q, k, v, g, output_final_state=True)
    entering, after = scan(seg_state, seg_decay)
    o = (o_local.astype(f32) + _fix_up(q, g_full, entering, scale)).astype(v.dtype)
  return o, (after if output_final_state else None)


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _fix_up(q, g_full, entering, scale):
  """scale * (q * exp(c)) @ X_p, c the log-decay from the segment start (exp(c) <= 1).

  Rematerialized in the backward, so that only X_p (one state) is kept for it beyond the
  inputs the local pass keeps anyway.
  """
  c = jnp.cumsum(g_full, axis=1)
  return scale * jnp.einsum("bthk,bhkv->bthv", q.astype(jnp.float32) * jnp.exp(c), entering,
                            precision=_HI)


def _axes_in(entry) -> set:
  if entry is None:
    return set()
  return set(entry) if isinstance(entry, tuple) else {entry}


def _explicit_batch_head(q, mesh, seq_axis):
  """How q's B and H axes are split over Explicit mesh axes (None, None when not explicit)."""
  sharding = getattr(jax.typeof(q), "sharding", None)
  axis_types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * 4
  explicit = lambda e: e is not None and e != seq_axis and all(
      "Explicit" in str(axis_types.get(a)) for a in _axes_in(e))
  return (spec[0] if explicit(spec[0]) else None), (spec[2] if explicit(spec[2]) else None)


def _mesh_or_context(mesh, *, name):
  if mesh is not None:
    return mesh
  ctx = jax.sharding.get_abstract_mesh()
  if ctx is None or getattr(ctx, "empty", True) or not ctx.axis_names:
    raise ValueError(f"{name}: no mesh. Pass `mesh=` or call inside `with jax.set_mesh(mesh):`.")
  return ctx


def zeco_gla(q, k, v, g=None, *, mesh=None, seq_axis="seq", method="all_scan",
             num_blocks=None, chunk_size=64, scale=None, initial_state=None,
             output_final_state=False, backend="auto"):
  """Sequence-parallel GLA over the mesh axis ``seq_axis`` (ZeCO, spec sections 3-5).

  Args:
    q, k: ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]``, ``[B, T, H]`` or None
      (log-decay, <= 0): global arrays whose T axis is (or will be) split contiguously over
      ``seq_axis``. Other mesh axes (say B over ``data``, H over ``tensor``) are left to
      the compiler as they are: the shard_map is manual over ``seq_axis`` only.
    mesh: a ``jax.sharding.Mesh``; default: the mesh set with ``jax.set_mesh``.
    seq_axis: the mesh axis the sequence is split over; T must be divisible by its size.
    method: ``"all_scan"`` (ZeCO's pipelined All-Scan), ``"all_gather"`` (LASP-2),
      ``"ring"`` (LASP-1, no overlap) or ``"tree"`` (recursive doubling).
    num_blocks: blocks the state is split into along V for ``"all_scan"``; must divide V.
      None picks the alpha-beta optimum (see :func:`zeco_jax.scan.default_num_blocks`).
    chunk_size, scale, initial_state, output_final_state, backend: as in
      :func:`zeco_jax.chunk_gla`.

  Returns:
    ``(o, final_state)`` as :func:`zeco_jax.chunk_gla`: o sharded like q over T; the final
    state of the whole sequence (float32) or None.
  """
  name = "zeco_gla"
  args, backend = _check_args(q, k, v, g, initial_state, scale, chunk_size, method, backend,
                              name=name)
  mesh = _mesh_or_context(mesh, name=name)
  if seq_axis not in mesh.axis_names:
    raise ValueError(f"{name}: the mesh has no axis `seq_axis`={seq_axis!r}; its axes are "
                     f"{tuple(mesh.axis_names)}. Pass seq_axis= one of them.")
  P_size = mesh.shape[seq_axis]
  if args.T % P_size:
    raise ValueError(f"{name}: sequence length T = {args.T} is not divisible by the size "
                     f"{P_size} of mesh axis {seq_axis!r}; pad T to a multiple of {P_size}.")
  _resolve_num_blocks(num_blocks, method, P_size, args.B, args.H, args.K, args.V, name=name)

  batch_spec, head_spec = _explicit_batch_head(q, mesh, seq_axis)
  manual = {seq_axis} | _axes_in(batch_spec) | _axes_in(head_spec)
  seq4 = P(batch_spec, seq_axis, head_spec, None)
  g_spec = None if g is None else P(batch_spec, seq_axis, *([head_spec, None][:g.ndim - 2]))
  h0_spec = None if initial_state is None else P(batch_spec, head_spec, None, None)
  if manual != {seq_axis}:
    # Explicit mesh axes: B and H stay split as the caller split them, by making the
    # shard_map manual over those axes too (each shard then works on its own rows / heads).
    q, k, v = (jax.sharding.reshard(x, seq4) for x in (q, k, v))
    g = None if g is None else jax.sharding.reshard(g, g_spec)
    if initial_state is not None:
      initial_state = jax.sharding.reshard(initial_state, h0_spec)

  def body(q, k, v, g, h0):
    o, after = zeco_gla_local(q, k, v, g, axis_name=seq_axis, method=method,
                              num_blocks=num_blocks, chunk_size=chunk_size, scale=scale,
                              initial_state=h0, output_final_state=True, backend=backend)
    return o, after[None]

  # Pallas calls (and the Pallas interpreter on CPU) do not carry shard_map's varying-axes
  # types through their bodies, so that check is off around them; JAX then inserts the
  # psums for replicated inputs itself.
  run = jax.shard_map(body, mesh=mesh, in_specs=(seq4, seq4, seq4, g_spec, h0_spec),
                      out_specs=(seq4, P(seq_axis, batch_spec, head_spec)), axis_names=manual,
                      check_vma=(backend != "pallas"))
  o, after_each = run(q, k, v, g, initial_state)
  if not output_final_state:
    return o, None
  if manual != {seq_axis}:   # explicit sharding: slicing one seq shard needs it replicated
    after_each = jax.sharding.reshard(after_each, P(None, batch_spec, head_spec))
  return o, after_each[-1]
