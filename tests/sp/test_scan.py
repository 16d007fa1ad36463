"""all_scan (zeco_jax.sp.scan) on simulated devices: every method equals a plain Python
scan, values and grads, for elementwise decays, no decay and a dense K x K transition; a
per-head decay travels as [B, H]; the compiled forward sends one state per rank (the
two-level scan at most two, as its model says); the method registry, its cost model and
the argument errors."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import collective_operand_shapes, rel_err, seq_mesh, states_sent_per_rank
from zeco_jax import all_scan
from zeco_jax.sp import scan as scan_lib
from zeco_jax.sp.transitions import DenseTransition, Identity

B, H, K, V = 2, 2, 4, 8


def python_scan(S, lam, h0, reverse):
  """X_0 = h0, X_{p+1} = lam_p * X_p + S_p over the leading (rank) axis."""
  n = S.shape[0]
  lam = lam[..., None] if lam.ndim == S.ndim - 1 else lam[..., None, None]
  X, exclusive, inclusive = h0, [None] * n, [None] * n
  for p in (range(n - 1, -1, -1) if reverse else range(n)):
    exclusive[p] = X
    X = lam[p] * X + S[p]
    inclusive[p] = X
  return jnp.stack(exclusive), jnp.stack(inclusive)


def scans_on_mesh(n, method, num_blocks):
  """One compiled function: forward and reverse scans, per-dim and per-head decay."""
  mesh = seq_mesh(n)

  def body(S, lam_dim, lam_head, h0):
    outs = []
    for lam in (lam_dim, lam_head):
      for reverse in (False, True):
        outs += all_scan(S[0], lam[0], "seq", num_blocks=num_blocks, method=method,
                         initial=h0, reverse=reverse)
    return tuple(x[None] for x in outs)

  return jax.shard_map(body, mesh=mesh, in_specs=(P("seq"),) * 3 + (P(),),
                       out_specs=(P("seq"),) * 8)


def expected(S, lam_dim, lam_head, h0):
  outs = []
  for lam in (lam_dim, lam_head):
    for reverse in (False, True):
      outs += python_scan(S, lam, h0, reverse)
  return tuple(outs)


# (4, "all_scan", 2) is not listed: the All-Scan is one _chains_scan over a chain of P
# ranks, whose Python branches (a send at every step but the last, nb blocks through the
# pipeline) are the same at P = 4 and P = 8, so (8, "all_scan", 2) runs its paths.
@pytest.mark.parametrize("n,method,num_blocks", [
    (1, "all_scan", 2), (2, "all_scan", 1), (8, "all_scan", V),
    (8, "all_scan", 2), (3, "tree", 1), (8, "tree", 1), (4, "all_gather", 1),
    (8, "all_gather", 1), (8, "ring", 1),
])
def test_all_scan_matches_python_scan(n, method, num_blocks):
  r = np.random.default_rng(n * 10 + num_blocks)
  S = jnp.asarray(r.standard_normal((n, B, H, K, V)), jnp.float32)
  lam_dim = jnp.asarray(r.uniform(0.3, 1.0, (n, B, H, K)), jnp.float32)
  lam_head = jnp.asarray(r.uniform(0.3, 1.0, (n, B, H)), jnp.float32)
  h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
  weights = [jnp.asarray(r.standard_normal((n, B, H, K, V)), jnp.float32) for _ in range(8)]
  loss = lambda f: lambda *a: sum(jnp.sum(w * x) for w, x in zip(weights, f(*a)))

  ours = scans_on_mesh(n, method, num_blocks)
  outs, grads = jax.jit(lambda *a: (ours(*a), jax.grad(loss(ours), (0, 1, 2, 3))(*a)))(
      S, lam_dim, lam_head, h0)
  ref_outs = expected(S, lam_dim, lam_head, h0)
  ref_grads = jax.grad(loss(expected), (0, 1, 2, 3))(S, lam_dim, lam_head, h0)
  for ours_x, ref_x in zip(outs, ref_outs):
    assert rel_err(ours_x, ref_x) <= 1e-5
  for ours_g, ref_g in zip(grads, ref_grads):
    assert rel_err(ours_g, ref_g) <= 1e-5


def dense_python_scan(S, M, h0, reverse):
  """X_0 = h0, X_{p+1} = M_p @ X_p + S_p over the leading (rank) axis."""
  n = S.shape[0]
  X, exclusive, inclusive = h0, [None] * n, [None] * n
  for p in (range(n - 1, -1, -1) if reverse else range(n)):
    exclusive[p] = X
    X = jnp.einsum("bhij,bhjv->bhiv", M[p], X, precision=jax.lax.Precision.HIGHEST) + S[p]
    inclusive[p] = X
  return jnp.stack(exclusive), jnp.stack(inclusive)


# The collective knows transitions only through their interface: a dense K x K matrix
# (the delta-rule family) runs through every method's code unchanged, forward and backward.
@pytest.mark.parametrize("n,method,num_blocks", [
    (4, "all_scan", 2), (8, "all_scan", V), (5, "tree", 1), (4, "all_gather", 1),
    (4, "ring", 1),
])
def test_dense_transition_matches_python_scan(n, method, num_blocks):
  r = np.random.default_rng(100 + n)
  S = jnp.asarray(r.standard_normal((n, B, H, K, V)), jnp.float32)
  M = jnp.asarray(0.9 * r.standard_normal((n, B, H, K, K)) / np.sqrt(K), jnp.float32)
  h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
  weights = [jnp.asarray(r.standard_normal((n, B, H, K, V)), jnp.float32) for _ in range(6)]
  loss = lambda f: lambda *a: sum(jnp.sum(w * x) for w, x in zip(weights, f(*a)))
  mesh = seq_mesh(n)

  def body(S, M, h0):
    outs = []
    for reverse in (False, True):
      outs += all_scan(S[0], DenseTransition(M[0]), "seq", num_blocks=num_blocks,
                       method=method, initial=h0, reverse=reverse)
    outs += all_scan(S[0], Identity(), "seq", num_blocks=num_blocks, method=method,
                     initial=h0)
    return tuple(x[None] for x in outs)

  def expected(S, M, h0):
    eye = jnp.broadcast_to(jnp.eye(K), M.shape)
    return (*dense_python_scan(S, M, h0, False), *dense_python_scan(S, M, h0, True),
            *dense_python_scan(S, eye, h0, False))

  ours = jax.shard_map(body, mesh=mesh, in_specs=(P("seq"), P("seq"), P()),
                       out_specs=(P("seq"),) * 6)
  outs, grads = jax.jit(lambda *a: (ours(*a), jax.grad(loss(ours), (0, 1, 2))(*a)))(S, M, h0)
  ref_grads = jax.grad(loss(expected), (0, 1, 2))(S, M, h0)
  for ours_x, ref_x in zip(outs, expected(S, M, h0)):
    assert rel_err(ours_x, ref_x) <= 1e-5
  for ours_g, ref_g in zip(grads, ref_grads):
    assert rel_err(ours_g, ref_g) <= 1e-5


def test_scalar_decay_stays_scalar_in_the_collective():
  # A per-head decay travels as [B, H], never broadcast to [B, H, K].
  n = 4
  mesh = seq_mesh(n)
  S = jnp.ones((n, B, H, K, V))
  lam = jnp.full((n, B, H), 0.5)
  for method in ("tree", "all_gather"):
    f = jax.shard_map(lambda S, lam: all_scan(S[0], lam[0], "seq", method=method)[0][None],
                      mesh=mesh, in_specs=(P("seq"), P("seq")), out_specs=P("seq"))
    moved = collective_operand_shapes(jax.make_jaxpr(f)(S, lam))
    assert (B, H) in moved and not any(s[-3:] == (B, H, K) for s in moved), (method, moved)


def test_registry_is_the_one_vocabulary():
  assert scan_lib.method_names() == tuple(scan_lib.SCAN_METHODS)
  assert set(scan_lib.SCAN_METHODS) == {"all_scan", "all_gather", "ring", "tree",
                                        "all_scan_2level"}
  for name, spec in scan_lib.SCAN_METHODS.items():
    assert spec.name == name and spec.summary
  assert [m for m, s in scan_lib.SCAN_METHODS.items() if not s.overlaps_local] == ["ring"]
  assert [m for m, s in scan_lib.SCAN_METHODS.items() if s.blocked] == ["all_scan",
                                                                         "all_scan_2level"]
  assert [m for m, s in scan_lib.SCAN_METHODS.items() if s.grouped] == ["all_scan_2level"]
  M, m_A = 1 << 20, 1 << 12
  # All-Scan and ring send one state per rank, and no transition; the peers send it.
  for P_ in (2, 8, 256):
    assert scan_lib.bytes_sent_per_rank(P_, M, "all_scan", m_A) == M
    assert scan_lib.bytes_sent_per_rank(P_, M, "ring", m_A) == M
    assert scan_lib.bytes_sent_per_rank(P_, M, "all_gather", m_A) == (P_ - 1) * (M + m_A)
  assert scan_lib.bytes_sent_per_rank(8, M, "tree") == 4 * M
  assert scan_lib.predicted_time(8, 4, M, method="ring") == scan_lib.predicted_time(
      8, 1, M, method="all_scan")
  assert scan_lib.default_num_blocks(64, M, 128, method="tree") == 1
  with pytest.raises(ValueError, match="unknown `method` 'serial'.*'ring'"):
    scan_lib.predicted_time(8, 1, M, method="serial")


def test_pipeline_sends_one_state_per_rank():
  # The compiled forward scan: every rank sends exactly one state (the last sends nothing),
  # whatever num_blocks is, and with a dense K x K transition too (the matrix stays on its
  # rank); all_gather sends P - 1 states.
  n = 8
  mesh = seq_mesh(n)
  S = jax.ShapeDtypeStruct((n, B, H, K, V), jnp.float32)
  lam = jax.ShapeDtypeStruct((n, B, H, K), jnp.float32)
  mat = jax.ShapeDtypeStruct((n, B, H, K, K), jnp.float32)
  M = B * H * K * V * 4                # one float32 state, bytes
  for method, nb, A in (("all_scan", 1, lam), ("all_scan", 4, lam), ("all_scan", 4, mat),
                        ("all_gather", 1, lam)):
    as_transition = DenseTransition if A is mat else (lambda x: x)
    f = jax.shard_map(lambda S, A: all_scan(S[0], as_transition(A[0]), "seq", num_blocks=nb,
                                            method=method)[0][None],
                      mesh=mesh, in_specs=(P("seq"), P("seq")), out_specs=P("seq"))
    total = states_sent_per_rank(f, (S, A), n, M)
    if method == "all_scan":
      assert list(total) == [1] * (n - 1) + [0]
    else:
      assert min(total) >= n - 1


def test_default_num_blocks_follows_the_model():
  M = 1 << 20
  assert scan_lib.default_num_blocks(2, M, 128) == 1        # no pipeline to fill at P = 2
  nb8 = scan_lib.default_num_blocks(8, M, 128)
  nb256 = scan_lib.default_num_blocks(256, M, 128)
  assert 128 % nb8 == 0 and 128 % nb256 == 0 and nb256 > nb8 >= 1
  # The model's choice is no worse than its neighbours.
  t = lambda nb: scan_lib.predicted_time(8, nb, M)
  assert t(nb8) <= min(t(max(nb8 // 2, 1)), t(min(nb8 * 2, 128)))


def test_bad_arguments():
  mesh = seq_mesh(2)
  S = jnp.ones((2, B, H, K, V))
  run = lambda **kw: jax.shard_map(lambda S, lam: all_scan(S[0], lam[0], "seq", **kw)[0][None],
                                   mesh=mesh, in_specs=(P("seq"), P("seq")),
                                   out_specs=P("seq"))
  with pytest.raises(ValueError, match="num_blocks"):
    run(num_blocks=3)(S, jnp.ones((2, B, H, K)))
  with pytest.raises(ValueError, match="`method` 'ring_of_fire'; choose one of 'all_scan', "
                     "'all_gather', 'ring', 'tree', 'all_scan_2level'"):
    run(method="ring_of_fire")(S, jnp.ones((2, B, H, K)))
  with pytest.raises(ValueError, match="'pipeline' is now 'all_scan'"):
    run(method="pipeline")(S, jnp.ones((2, B, H, K)))
  with pytest.raises(ValueError, match=r"DenseTransition for state .* must be \(2, 2, 4, 4\)"):
    jax.shard_map(
        lambda S: all_scan(S[0], DenseTransition(jnp.ones((B, H, K, V))), "seq")[0][None],
        mesh=mesh, in_specs=P("seq"), out_specs=P("seq"))(S)
  with pytest.raises(ValueError, match="decay"):
    run()(S, jnp.ones((2, B, H, V)))
  with pytest.raises(ValueError, match="`group_size`=2 is for a grouped scan method "
                     "\\('all_scan_2level'\\); method='tree' has no groups"):
    run(method="tree", group_size=2)(S, jnp.ones((2, B, H, K)))
  with pytest.raises(ValueError, match="`group_size` must be a positive int .* got 0"):
    run(method="all_scan_2level", group_size=0)(S, jnp.ones((2, B, H, K)))


# --- the two-level All-Scan --------------------------------------------------------------
# (P, group size, num_blocks): groups of 1 (level 2 is the whole chain), of P (level 1 is),
# equal groups, a shorter last group (of 3 ranks: 5 + 3; of one rank: 3 + 3 + 1, P not a
# power of two). Groups of 1 at P = 2 are not listed: _two_level_scan then takes the same
# branches as at P = 8 (no level 1, no transition products, no spread: every group has one
# rank) and level 2's _chains_scan the same ones over a chain of 2 as of 8.
@pytest.mark.parametrize("n,G,num_blocks", [
    (8, 2, 4), (8, 4, 1), (7, 3, 2), (8, 5, 2), (8, 1, 2), (4, 4, 2),
])
def test_two_level_matches_python_scan(n, G, num_blocks):
  """Forward and reverse, from an initial state, for a per-dimension, a per-head, a dense
  and no transition: values and gradients (of S, the transitions and h0) <= 1e-5."""
  r = np.random.default_rng(200 + 10 * n + G)
  S = jnp.asarray(r.standard_normal((n, B, H, K, V)), jnp.float32)
  lam_dim = jnp.asarray(r.uniform(0.3, 1.0, (n, B, H, K)), jnp.float32)
  lam_head = jnp.asarray(r.uniform(0.3, 1.0, (n, B, H)), jnp.float32)
  M = jnp.asarray(0.9 * r.standard_normal((n, B, H, K, K)) / np.sqrt(K), jnp.float32)
  h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
  weights = [jnp.asarray(r.standard_normal((n, B, H, K, V)), jnp.float32) for _ in range(14)]
  loss = lambda f: lambda *a: sum(jnp.sum(w * x) for w, x in zip(weights, f(*a)))

  def body(S, lam_dim, lam_head, M, h0):
    outs = []
    for A in (lam_dim[0], lam_head[0], DenseTransition(M[0])):
      for reverse in (False, True):
        outs += all_scan(S[0], A, "seq", num_blocks=num_blocks, method="all_scan_2level",
                         group_size=G, initial=h0, reverse=reverse)
    outs += all_scan(S[0], Identity(), "seq", num_blocks=num_blocks,
                     method="all_scan_2level", group_size=G, initial=h0)
    return tuple(x[None] for x in outs)

  def expected(S, lam_dim, lam_head, M, h0):
    outs = []
    for lam in (lam_dim, lam_head):
      for reverse in (False, True):
        outs += python_scan(S, lam, h0, reverse)
    eye = jnp.broadcast_to(jnp.eye(K), M.shape)
    return (*outs, *dense_python_scan(S, M, h0, False), *dense_python_scan(S, M, h0, True),
            *dense_python_scan(S, eye, h0, False))

  ours = jax.shard_map(body, mesh=seq_mesh(n), in_specs=(P("seq"),) * 4 + (P(),),
                       out_specs=(P("seq"),) * 14)
  args = (S, lam_dim, lam_head, M, h0)
  outs, grads = jax.jit(lambda *a: (ours(*a), jax.grad(loss(ours), range(5))(*a)))(*args)
  ref_grads = jax.grad(loss(expected), range(5))(*args)
  for ours_x, ref_x in zip(outs, expected(*args)):
    assert rel_err(ours_x, ref_x) <= 1e-5
  for ours_g, ref_g in zip(grads, ref_grads):
    assert rel_err(ours_g, ref_g) <= 1e-5


def test_two_level_sends_at_most_two_states_per_rank():
  """The compiled forward at P = 8: each rank sends what the model says (a member one
  state, its prefix transition and its shares of the spread; a group's last rank its
  level-2 state and the spread), at most two states; forward and backward together at most
  twice the All-Scan's two. V = 64 columns against K = 16 keep the transition small."""
  n, b, h, k, v = 8, 1, 2, 16, 64
  mesh = seq_mesh(n)
  M, m_A = b * h * k * v * 4, b * h * k * 4
  S = jax.ShapeDtypeStruct((n, b, h, k, v), jnp.float32)
  lam = jax.ShapeDtypeStruct((n, b, h, k), jnp.float32)
  for G in (2, 3, 4):
    f = jax.shard_map(lambda S, A: all_scan(S[0], A[0], "seq", num_blocks=2,
                                            method="all_scan_2level", group_size=G)[0][None],
                      mesh=mesh, in_specs=(P("seq"), P("seq")), out_specs=P("seq"))
    fwd = states_sent_per_rank(f, (S, lam), n, M)
    model = scan_lib.two_level_cost(n, G, 2, M, m_A, 1e-6, 1e-11).bytes_per_rank / M
    assert max(fwd) == pytest.approx(model, rel=1e-6) and max(fwd) <= 2.0, (G, fwd)
    both = states_sent_per_rank(jax.grad(lambda S, A: jnp.sum(f(S, A) ** 2), (0, 1)),
                                (S, lam), n, M)
    assert max(both) <= 4.0, (G, both)


def test_two_level_model_at_scale():
  """v5p's figures (alpha 1 us, 100 GB/s) and gla_340m's 512 KiB state: the model's group
  size keeps two states per rank, its hops within 2 (G + nb + log2(P / G)), and its time
  at P = 2048 under a quarter of the All-Scan's; at P <= 16 it picks the All-Scan itself
  (groups of one rank)."""
  M, alpha, beta, V = 512 * 1024, 1e-6, 1 / 100e9, 256
  for P_ in (8, 16):
    assert scan_lib.default_group_size(P_, M, alpha, beta) == 1
  for P_ in (64, 256, 1024, 2048):
    G = scan_lib.default_group_size(P_, M, alpha, beta)
    nb = scan_lib.default_num_blocks(P_, M, V, alpha, beta, method="all_scan_2level")
    cost = scan_lib.two_level_cost(P_, G, nb, M, M / V, alpha, beta)
    assert 1 < G < P_ and cost.bytes_per_rank <= 2 * M
    assert cost.hops <= 2 * (G + nb + math.log2(P_ / G)), (P_, G, nb, cost)
    assert cost.time == scan_lib.predicted_time(P_, nb, M, alpha, beta, "all_scan_2level",
                                                M / V)
  all_scan_time = scan_lib.predicted_time(
      2048, scan_lib.default_num_blocks(2048, M, V, alpha, beta), M, alpha, beta)
  assert cost.time <= all_scan_time / 4


@pytest.mark.parametrize("n,G,initial", [(4, 3, True), (2, 4, False)])
def test_pieces_transpose_is_the_chains_vjp(n, G, initial):
  """all_scan_of_pieces_transpose (the reverse chain for fixed transitions, with work
  beside its sends) equals jax's vjp of all_scan_of_pieces with respect to the blocks'
  states and the initial blocks, on random states, transitions and cotangents; each
  block's work gets that block's whole state cotangent."""
  rng = np.random.default_rng(n + G)
  rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  S, M = rand(n, G, B, H, K, V), 0.5 * rand(n, G, B, H, K, K)
  d_ent, d_aft, h0 = rand(n, G, B, H, K, V), rand(n, G, B, H, K, V), rand(G, B, H, K, V)

  def body(S, M, d_ent, d_aft, h0):
    S, M, d_ent, d_aft = S[0], M[0], d_ent[0], d_aft[0]
    init = [h0[j] for j in range(G)] if initial else None

    def chain(states, init):
      pieces = [(lambda s, m=M[j]: (s, DenseTransition(m), None), (states[j],))
                for j in range(G)]
      return scan_lib.all_scan_of_pieces(pieces, "seq", initial=init)[:2]

    blocks = [S[j] for j in range(G)]
    cts = ([d_ent[j] for j in range(G)], [d_aft[j] for j in range(G)])
    if initial:
      want_S, want_init = jax.vjp(chain, blocks, init)[1](cts)
    else:
      want_S, = jax.vjp(lambda b: chain(b, None), blocks)[1](cts)
      want_init = [jnp.zeros_like(h0[0])] * G
    got_S, got_init, results = scan_lib.all_scan_of_pieces_transpose(
        [DenseTransition(M[j]) for j in range(G)], *cts, "seq", initial_like=init,
        pieces=[(lambda d, c: c * d, (float(j + 1),)) for j in range(G)])
    got_init = got_init if initial else [jnp.zeros_like(h0[0])] * G
    return (jnp.stack(want_S)[None], jnp.stack(got_S)[None], jnp.stack(results)[None],
            jnp.stack(want_init), jnp.stack(got_init))

  f = jax.jit(jax.shard_map(body, mesh=seq_mesh(n), in_specs=(P("seq"),) * 4 + (P(),),
                            out_specs=(P("seq"),) * 3 + (P(),) * 2))
  want_S, got_S, results, want_init, got_init = f(S, M, d_ent, d_aft, h0)
  assert rel_err(got_S, want_S) <= 1e-6
  assert rel_err(results, got_S * jnp.arange(1, G + 1.0)[:, None, None, None, None]) <= 1e-6
  if initial:
    assert rel_err(got_init, want_init) <= 1e-6
  assert float(jnp.abs(want_S).max()) > 0.1         # a nontrivial case
