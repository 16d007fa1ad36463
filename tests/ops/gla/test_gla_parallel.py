"""zeco_gla on 8 simulated CPU devices against the token-by-token reference: every scan
method at P = 1, 2, 4, 8, every decay kind, bf16, a data axis, a context mesh of Explicit
axes, the per-shard function inside a user's shard_map; causality across shard boundaries;
what it sends (read from the compiled HLO), that its local pass does not wait for the
received state, what its backward keeps, and its argument errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import (assert_fix_up_precision, check_gla_against_recurrence,
                     collective_operand_shapes, cotangents, gla_inputs, gla_shapes,
                     local_pass_waits_for_the_state, loss_and_grads, output_sum_grad,
                     rel_err, seq_mesh, states_sent_per_rank)
from zeco_jax import recurrent_gla, transitions, zeco_gla, zeco_gla_local
from zeco_jax.ops.gla.parallel import segment_transition
from zeco_jax.sp.scan import SCAN_METHODS

B, H, K, V = 2, 2, 8, 16


# (P, method, num_blocks, T): every method, P in {1, 2, 4, 8}, num_blocks 1, 2 and V.
# T = 160 on 8 devices gives segments of 20 tokens: not a multiple of the chunk size.
_CASES = [
    (1, "all_scan", 1, 72), (2, "all_scan", 1, 64), (4, "all_scan", 2, 64),
    (8, "all_scan", V, 128), (8, "all_scan", None, 160), (8, "all_gather", None, 128),
    (4, "ring", None, 64), (8, "tree", None, 128), (8, "all_scan_2level", None, 160),
]


def test_cases_cover_every_registered_method():
  assert {case[1] for case in _CASES} == set(SCAN_METHODS)


@pytest.mark.parametrize("n,method,num_blocks,T", _CASES)
def test_zeco_gla_matches_recurrence(n, method, num_blocks, T):
  op = functools.partial(zeco_gla, mesh=seq_mesh(n), method=method, num_blocks=num_blocks,
                         chunk_size=16)
  check_gla_against_recurrence(op, n, B, T, H, K, V)


@pytest.mark.parametrize("n,group_size,decay,initial", [
    (8, 3, "dim", True), (8, 4, "scalar", False), (4, 2, None, True), (2, 1, "dim", True)])
def test_zeco_gla_two_level_groups(n, group_size, decay, initial):
  # Groups of 3 leave a short last group; 4 and 2 cut P in equal groups; groups of one
  # rank at P = 2 leave all to level 2.
  op = functools.partial(zeco_gla, mesh=seq_mesh(n), method="all_scan_2level",
                         group_size=group_size, num_blocks=2, chunk_size=16)
  check_gla_against_recurrence(op, 40 + n, B, 160 if n == 8 else 64, H, K, V, decay=decay,
                               initial=initial)


@pytest.mark.parametrize("decay,initial", [("scalar", False), (None, True)])
def test_zeco_gla_decay_kinds(decay, initial):
  op = functools.partial(zeco_gla, mesh=seq_mesh(4), num_blocks=2, chunk_size=16)
  check_gla_against_recurrence(op, 3, B, 64, H, K, V, decay=decay, initial=initial)


def test_segment_transition_keeps_the_decay_kind():
  # The transition handed to the scan: per-dim [B, H, K], per-head [B, H] (never
  # broadcast to K), none for g=None.
  _, _, _, g, _ = gla_inputs(3, B, 32, H, K, V)
  _, _, _, g_head, _ = gla_inputs(3, B, 32, H, K, V, decay="scalar")
  per_dim, per_head = segment_transition(g), segment_transition(g_head)
  assert isinstance(per_dim, transitions.DiagonalDecay) and per_dim.value.shape == (B, H, K)
  assert isinstance(per_head, transitions.ScalarDecay) and per_head.value.shape == (B, H)
  np.testing.assert_allclose(per_head.value, np.exp(np.sum(g_head, axis=1)), rtol=1e-6)
  assert isinstance(segment_transition(None), transitions.Identity)
  # In zeco_gla's compiled collective the per-head decay travels as [B, H].
  q, k, v, _, _ = gla_inputs(3, B, 64, H, K, V)
  g_head = jnp.concatenate([g_head, g_head], axis=1)
  jaxpr = jax.make_jaxpr(lambda *a: zeco_gla(*a, mesh=seq_mesh(4), method="tree",
                                             chunk_size=16))(q, k, v, g_head)
  moved = collective_operand_shapes(jaxpr)
  assert (B, H) in moved and (B, H, K) not in moved, moved


def test_zeco_gla_bf16():
  op = functools.partial(zeco_gla, mesh=seq_mesh(4), num_blocks=2, chunk_size=16)
  check_gla_against_recurrence(op, 4, B, 64, H, K, V, dtype=jnp.bfloat16, fwd_tol=2e-2,
                               grad_tol=2e-2)


def test_fix_up_precision_follows_the_input_dtype():
  """GLA's fix-up ``scale (q e^c) X_p`` (and its backward's GEMMs): float32 at HIGHEST for
  float32 inputs, the default matmul precision for bf16 ones (the delta rule's likewise:
  tests/ops/gated_delta/test_gated_delta_parallel.py)."""
  from zeco_jax.ops.gla.parallel import _fix_up
  q, g, x = jnp.ones((1, 8, 2, 4)), -jnp.ones((1, 8, 2, 4)), jnp.ones((1, 2, 4, 3))
  assert_fix_up_precision(lambda dtype: (lambda q, x: jnp.sum(_fix_up(q, g, x, 0.5)),
                                         (q.astype(dtype), x)))


def test_data_axis_shards_batch_and_is_kept():
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
  q, k, v, g, h0 = gla_inputs(5, B, 64, H, K, V)
  placed = [jax.device_put(x, NamedSharding(mesh, P("data", "seq"))) for x in (q, k, v, g)]
  h0 = jax.device_put(h0, NamedSharding(mesh, P("data")))
  op = functools.partial(zeco_gla, mesh=mesh, num_blocks=2, chunk_size=16)
  o, final = jax.jit(lambda *a: op(*a, initial_state=h0, output_final_state=True))(*placed)
  assert o.sharding.spec[:2] == ("data", "seq")
  o_r, s_r = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
  assert rel_err(o, o_r) <= 1e-5 and rel_err(final, s_r) <= 1e-5
  check_gla_against_recurrence(op, 5, B, 64, H, K, V)


def test_mesh_from_set_mesh_and_explicit_axes():
  # jax.make_mesh gives Explicit axes: B stays split over "data" as the caller split it.
  mesh = jax.make_mesh((2, 4), ("data", "seq"))
  q, k, v, g, h0 = gla_inputs(6, B, 64, H, K, V)
  w_o, w_s = cotangents(6, B, 64, H, K, V)
  _, _, g_r = loss_and_grads(recurrent_gla, q, k, v, g, h0, w_o, w_s)
  o_r, s_r = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
  with jax.set_mesh(mesh):
    placed = [jax.device_put(x, P("data", "seq")) for x in (q, k, v, g)]
    o, final = jax.jit(lambda *a: zeco_gla(*a, chunk_size=16, initial_state=h0,
                                           output_final_state=True))(*placed)
    assert o.sharding.spec[:2] == ("data", "seq")
    _, _, g_z = loss_and_grads(functools.partial(zeco_gla, chunk_size=16), *placed, h0,
                               w_o, w_s)
  assert rel_err(o, o_r) <= 1e-5 and rel_err(final, s_r) <= 1e-5
  for name in g_r:
    assert rel_err(g_z[name], g_r[name]) <= 1e-4, name


def test_local_inside_user_shard_map():
  # A user already inside shard_map(check_vma=True) calls the per-shard function.
  mesh = seq_mesh(4)
  q, k, v, g, h0 = gla_inputs(7, B, 64, H, K, V)
  spec = P(None, "seq")

  def body(q, k, v, g, h0):
    o, after = zeco_gla_local(q, k, v, g, axis_name="seq", chunk_size=16, initial_state=h0,
                              output_final_state=True)
    return o, after[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4 + (P(),),
                            out_specs=(spec, P("seq")), check_vma=True))
  o, after = f(q, k, v, g, h0)
  o_r, s_r = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
  assert rel_err(o, o_r) <= 1e-5
  assert rel_err(after[-1], s_r) <= 1e-5           # the last rank holds the final state
  _, s_half = recurrent_gla(q[:, :32], k[:, :32], v[:, :32], g[:, :32], initial_state=h0,
                            output_final_state=True)
  assert rel_err(after[1], s_half) <= 1e-5         # rank 1: the state after token 32


def test_causal_across_shard_boundaries():
  # Outputs before t do not change when inputs at and after t do, with t inside shard 1
  # and inside the last shard.
  f = jax.jit(functools.partial(zeco_gla, mesh=seq_mesh(4), chunk_size=16))
  q, k, v, g, _ = gla_inputs(8, B, 64, H, K, V)
  o, no_state = f(q, k, v, g)
  assert no_state is None                          # final state only when asked
  r = np.random.default_rng(9)
  for t in (21, 50):
    bump = lambda x: x.at[:, t:].set(jnp.asarray(r.standard_normal(x[:, t:].shape), x.dtype))
    o2 = f(bump(q), bump(k), bump(v), jnp.minimum(bump(g), 0.0))[0]
    np.testing.assert_array_equal(np.asarray(o2[:, :t]), np.asarray(o[:, :t]))
    assert not np.allclose(np.asarray(o2[:, t:]), np.asarray(o[:, t:]))


def _states_sent(n, method):
  """States each rank sends in jit(grad) of zeco_gla on n devices (T = 16 n)."""
  op = functools.partial(zeco_gla, mesh=seq_mesh(n), method=method, num_blocks=4,
                         chunk_size=16)
  return states_sent_per_rank(output_sum_grad(op, 4), gla_shapes(B, 16 * n, H, K, V), n,
                              B * H * K * V * 4)     # one float32 state


def test_all_scan_sends_two_states_per_rank_whatever_P():
  for n in (4, 8):
    pipeline = _states_sent(n, "all_scan")
    # forward chain + its reverse in the backward: at most 2 states per rank.
    assert pipeline.max() == 2, (n, pipeline)
    gathered = _states_sent(n, "all_gather")
    # all-gather forward + reduce-scatter backward: each (P - 1) states.
    assert gathered.min() >= 2 * (n - 1), (n, gathered)


def test_zeco_gla_argument_errors():
  q, k, v, g, h0 = gla_inputs(10, B, 60, H, K, V)
  mesh = seq_mesh(8)
  with pytest.raises(ValueError, match="not divisible by the size 8"):
    zeco_gla(q, k, v, g, mesh=mesh)
  q, k, v, g, h0 = gla_inputs(10, B, 64, H, K, V)
  with pytest.raises(ValueError, match="no axis `seq_axis`='sequence'"):
    zeco_gla(q, k, v, g, mesh=mesh, seq_axis="sequence")
  with pytest.raises(ValueError, match="num_blocks"):
    zeco_gla(q, k, v, g, mesh=mesh, num_blocks=3)
  with pytest.raises(ValueError, match="zeco_gla: unknown `method` 'lasp3'; choose one of "
                     "'all_scan', 'all_gather', 'ring', 'tree'"):
    zeco_gla(q, k, v, g, mesh=mesh, method="lasp3")
  with pytest.raises(ValueError, match="'serial' is now 'ring'"):
    zeco_gla(q, k, v, g, mesh=mesh, method="serial")
  with pytest.raises(ValueError, match="initial_state"):
    zeco_gla(q, k, v, g, mesh=mesh, initial_state=h0[..., :4])
  with pytest.raises(ValueError, match="no mesh"):
    zeco_gla(q, k, v, g)
  with pytest.raises(ValueError, match="zeco_gla: `group_size`=2 is for a grouped scan"):
    zeco_gla(q, k, v, g, mesh=mesh, group_size=2)


def _local_pass_waits(method, **options):
  q, k, v, g, _ = gla_inputs(11, B, 64, H, K, V)
  op = functools.partial(zeco_gla, mesh=seq_mesh(4), method=method, chunk_size=16, **options)
  return local_pass_waits_for_the_state(op, q, k, v, g)


def test_local_pass_does_not_wait_for_the_state():
  # ZeCO and LASP-2: the chunked local pass is free of the received state, so XLA may run
  # it while the sends are in flight. LASP-1 ("ring") computes only after it receives.
  assert not _local_pass_waits("all_scan")
  assert not _local_pass_waits("all_gather")
  assert not _local_pass_waits("all_scan_2level", group_size=2)
  assert _local_pass_waits("ring")


def test_backward_keeps_inputs_and_a_few_states():
  # Beyond the inputs, zeco_gla's backward keeps the received state X_p (and the segment
  # decay), independent of T and P: the fix-up is rematerialized and the All-Scan's
  # custom_vjp keeps X_p alone.
  mesh = seq_mesh(4)
  q, k, v, g, h0 = gla_inputs(12, 1, 256, H, K, V)
  f = lambda *a: zeco_gla(*a[:4], initial_state=a[4], mesh=mesh, num_blocks=2,
                         chunk_size=16)[0]
  # Traced, not run: the residual's shapes (jax.eval_shape of the vjp's pytree).
  leaves = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], q, k, v, g, h0))
  inputs = sum(x.size for x in (q, k, v, g))
  beyond = sum(x.size for x in leaves) - inputs
  per_rank_state = 1 * H * K * V
  assert beyond <= 3 * 4 * per_rank_state, (beyond, per_rank_state)
  assert not any(x.shape[-3:] == (64, H, K) or x.shape[1:] == (256, H, K)
                 for x in leaves[4:]), [x.shape for x in leaves]
