"""zeco_gla on 8 simulated CPU devices against the token-by-token reference."""
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import cotangents, gla_inputs, loss_and_grads, rel_err, sub_jaxprs
from zeco_jax import recurrent_gla, transitions, zeco_gla, zeco_gla_local
from zeco_jax.runtime.hlo_stats import collective_bytes
from zeco_jax.ops.gla.parallel import segment_transition
from zeco_jax.sp.scan import SCAN_METHODS

B, H, K, V = 2, 2, 8, 16


def seq_mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("seq",))


def check_against_reference(op, T, decay="dim", initial=True, seed=0, fwd_tol=1e-5,
                            grad_tol=1e-4, dtype=jnp.float32):
  q, k, v, g, h0 = gla_inputs(seed, B, T, H, K, V, decay=decay, initial_state=initial,
                              dtype=dtype)
  w_o, w_s = cotangents(seed, B, T, H, K, V)
  o_r, s_r, g_r = loss_and_grads(recurrent_gla, q, k, v, g, h0, w_o, w_s)
  o_z, s_z, g_z = loss_and_grads(op, q, k, v, g, h0, w_o, w_s)
  assert o_z.dtype == v.dtype and o_z.shape == o_r.shape
  assert rel_err(o_z, o_r) <= fwd_tol
  assert rel_err(s_z, s_r) <= fwd_tol
  assert set(g_z) == set(g_r)
  for name in g_r:
    assert rel_err(g_z[name], g_r[name]) <= grad_tol, name


# (P, method, num_blocks, T): every method, P in {1, 2, 4, 8}, num_blocks 1, 2 and V.
# T = 160 on 8 devices gives segments of 20 tokens: not a multiple of the chunk size.
_CASES = [
    (1, "all_scan", 1, 72), (2, "all_scan", 1, 64), (4, "all_scan", 2, 64),
    (8, "all_scan", V, 128), (8, "all_scan", None, 160), (8, "all_gather", None, 128),
    (4, "ring", None, 64), (8, "tree", None, 128),
]


def test_cases_cover_every_registered_method():
  assert {case[1] for case in _CASES} == set(SCAN_METHODS)


@pytest.mark.parametrize("n,method,num_blocks,T", _CASES)
def test_zeco_gla_matches_recurrence(n, method, num_blocks, T):
  op = functools.partial(zeco_gla, mesh=seq_mesh(n), method=method, num_blocks=num_blocks,
                         chunk_size=16)
  check_against_reference(op, T, seed=n)


@pytest.mark.parametrize("decay,initial", [("scalar", False), (None, True)])
def test_zeco_gla_decay_kinds(decay, initial):
  op = functools.partial(zeco_gla, mesh=seq_mesh(4), num_blocks=2, chunk_size=16)
  check_against_reference(op, 64, decay=decay, initial=initial, seed=3)


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
                                             chunk_size=16))(q, k, v, g_head).jaxpr
  moved = []

  def walk(eqns):
    for eqn in eqns:
      if eqn.primitive.name in _COLLECTIVES:
        moved.extend(tuple(x.aval.shape) for x in eqn.invars)
      for inner in sub_jaxprs(eqn):
        walk(inner.eqns)

  walk(jaxpr.eqns)
  assert (B, H) in moved and (B, H, K) not in moved, moved


def test_zeco_gla_bf16():
  op = functools.partial(zeco_gla, mesh=seq_mesh(4), num_blocks=2, chunk_size=16)
  check_against_reference(op, 64, seed=4, fwd_tol=2e-2, grad_tol=2e-2, dtype=jnp.bfloat16)


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
  check_against_reference(op, 64, seed=5)


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


def _grad_hlo_bytes(n, method):
  mesh = seq_mesh(n)
  T = 16 * n
  shapes = [jax.ShapeDtypeStruct((B, T, H, d), jnp.float32) for d in (K, K, V, K)]

  def loss(q, k, v, g):
    o, _ = zeco_gla(q, k, v, g, mesh=mesh, method=method, num_blocks=4, chunk_size=16)
    return jnp.sum(o)

  text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(*shapes).compile().as_text()
  return collective_bytes(text, n)


def test_all_scan_sends_two_states_per_rank_whatever_P():
  M = B * H * K * V * 4            # one float32 state
  for n in (4, 8):
    pipeline = sum(_grad_hlo_bytes(n, "all_scan").values())
    # forward chain + its reverse in the backward: at most 2 states per rank.
    assert pipeline.max() == 2 * M, (n, pipeline / M)
    gathered = sum(_grad_hlo_bytes(n, "all_gather").values())
    # all-gather forward + reduce-scatter backward: each (P - 1) states.
    assert gathered.min() >= 2 * (n - 1) * M, (n, gathered / M)


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


_COLLECTIVES = ("ppermute", "all_gather")


def _communicates(eqn) -> bool:
  """Whether the equation is, or contains, a collective (e.g. the All-Scan's custom_vjp)."""
  return eqn.primitive.name in _COLLECTIVES or any(
      _communicates(e) for j in sub_jaxprs(eqn) for e in j.eqns)


def _find_shard_map(eqns):
  """The first shard_map equation, also inside a jit (zeco_gla jits its shard_map)."""
  for eqn in eqns:
    if eqn.primitive.name == "shard_map":
      return eqn
    for inner in sub_jaxprs(eqn):
      found = _find_shard_map(inner.eqns)
      if found is not None:
        return found
  return None


def _local_pass_depends_on_received_state(method):
  """Does any input of the local chunked pass depend on a collective's result?"""
  mesh = seq_mesh(4)
  q, k, v, g, _ = gla_inputs(11, B, 64, H, K, V)
  jaxpr = jax.make_jaxpr(lambda *a: zeco_gla(*a, mesh=mesh, method=method, chunk_size=16))(
      q, k, v, g).jaxpr
  body = _find_shard_map(jaxpr.eqns).params["jaxpr"]
  tainted, local_calls, comm = set(), [], 0
  for eqn in body.eqns:
    ins = [x for x in eqn.invars if isinstance(x, jax.extend.core.Var)]
    communicates = _communicates(eqn)
    if eqn.primitive.name.startswith("custom_vjp") and not communicates:
      local_calls.append(any(x in tainted for x in ins))      # the chunked local pass
    if communicates or any(x in tainted for x in ins):
      comm += communicates
      tainted.update(eqn.outvars)
  assert comm > 0 and local_calls, "expected collectives and a chunked local pass"
  return any(local_calls)


def test_local_pass_does_not_wait_for_the_state():
  # ZeCO and LASP-2: the chunked local pass is free of the received state, so XLA may run
  # it while the sends are in flight. LASP-1 ("ring") computes only after it receives.
  assert not _local_pass_depends_on_received_state("all_scan")
  assert not _local_pass_depends_on_received_state("all_gather")
  assert _local_pass_depends_on_received_state("ring")


def test_backward_keeps_inputs_and_a_few_states():
  # Beyond the inputs, zeco_gla's backward keeps the received state X_p (and the segment
  # decay), independent of T and P: the fix-up is rematerialized and the All-Scan's
  # custom_vjp keeps X_p alone.
  mesh = seq_mesh(4)
  q, k, v, g, h0 = gla_inputs(12, 1, 256, H, K, V)
  _, vjp_fn = jax.vjp(lambda *a: zeco_gla(*a[:4], initial_state=a[4], mesh=mesh, num_blocks=2,
                                          chunk_size=16)[0], q, k, v, g, h0)
  leaves = jax.tree.leaves(vjp_fn)
  inputs = sum(x.size for x in (q, k, v, g))
  beyond = sum(x.size for x in leaves) - inputs
  per_rank_state = 1 * H * K * V
  assert beyond <= 3 * 4 * per_rank_state, (beyond, per_rank_state)
  assert not any(x.shape[-3:] == (64, H, K) or x.shape[1:] == (256, H, K)
                 for x in leaves[4:]), [x.shape for x in leaves]


def test_zeco_gla_with_pallas_local_pass():
  # The local pass through the Pallas kernels (interpret mode on CPU) inside zeco_gla.
  pytest.importorskip("pallas_kernels")
  op = functools.partial(zeco_gla, mesh=seq_mesh(2), num_blocks=2, chunk_size=16,
                         backend="pallas")
  q, k, v, g, h0 = gla_inputs(13, 1, 64, 2, 16, 16)
  w_o, w_s = cotangents(13, 1, 64, 2, 16, 16)
  o_r, s_r, g_r = loss_and_grads(recurrent_gla, q, k, v, g, h0, w_o, w_s)
  o_z, s_z, g_z = loss_and_grads(op, q, k, v, g, h0, w_o, w_s)
  assert rel_err(o_z, o_r) <= 1e-5 and rel_err(s_z, s_r) <= 1e-5
  for name in g_r:
    assert rel_err(g_z[name], g_r[name]) <= 1e-4, name
