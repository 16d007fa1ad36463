"""all_scan on simulated devices: every method equals a plain Python scan, values and grads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from helpers import rel_err
from zeco_jax import all_scan
from zeco_jax import scan as scan_lib

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
  mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))

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


@pytest.mark.parametrize("n,method,num_blocks", [
    (1, "pipeline", 2), (2, "pipeline", 1), (4, "pipeline", 2), (8, "pipeline", V),
    (8, "pipeline", 2), (3, "tree", 1), (8, "tree", 1), (4, "all_gather", 1),
    (8, "all_gather", 1), (8, "serial", 1),
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


def test_pipeline_sends_one_state_per_rank():
  # The compiled forward scan: every rank sends exactly M bytes (the last sends nothing),
  # whatever num_blocks is; all_gather sends (P - 1) M.
  from zeco_jax.hlo_stats import collective_bytes
  n = 8
  mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
  S = jax.ShapeDtypeStruct((n, B, H, K, V), jnp.float32)
  lam = jax.ShapeDtypeStruct((n, B, H, K), jnp.float32)
  M = B * H * K * V * 4
  for method, nb in (("pipeline", 1), ("pipeline", 4), ("all_gather", 1)):
    f = jax.shard_map(lambda S, lam: all_scan(S[0], lam[0], "seq", num_blocks=nb,
                                              method=method)[0][None],
                      mesh=mesh, in_specs=(P("seq"), P("seq")), out_specs=P("seq"))
    sent = collective_bytes(jax.jit(f).lower(S, lam).compile().as_text(), n)
    total = sum(sent.values())
    if method == "pipeline":
      assert list(total) == [M] * (n - 1) + [0]
    else:
      assert min(total) >= (n - 1) * M


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
  mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
  S = jnp.ones((2, B, H, K, V))
  run = lambda **kw: jax.shard_map(lambda S, lam: all_scan(S[0], lam[0], "seq", **kw)[0][None],
                                   mesh=mesh, in_specs=(P("seq"), P("seq")),
                                   out_specs=P("seq"))
  with pytest.raises(ValueError, match="num_blocks"):
    run(num_blocks=3)(S, jnp.ones((2, B, H, K)))
  with pytest.raises(ValueError, match="method"):
    run(method="ring_of_fire")(S, jnp.ones((2, B, H, K)))
  with pytest.raises(ValueError, match="decay"):
    run()(S, jnp.ones((2, B, H, V)))
