"""zeco_gated_delta_rule on simulated CPU devices against the float64 token loop (single
rows and packed documents), its communication read from the compiled HLO, and the local
pass's independence of the state it receives (docs/design.md §9)."""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_comm_worker import grad_bytes
from helpers import (GDN_SHARD_DOC_IDS, assert_fix_up_precision, check_gdn_against_float64,
                     check_gdn_documents, find_eqns, gdn_inputs,
                     local_pass_waits_for_the_state, rel_err, seq_mesh)
from zeco_jax import recurrent_gated_delta_rule
from zeco_jax.ops.gated_delta.parallel import zeco_gated_delta_rule, zeco_gated_delta_rule_local
from zeco_jax.sp.scan import SCAN_METHODS

B, H, K, V = 2, 2, 8, 16


# (P, method, num_blocks, T, initial state): all_scan, all_gather and tree at P = 2, 4, 8
# (P = 1 runs no scan), with and without an initial state; T = 72 on one device and T = 160
# on 8 (20-token segments) are not multiples of the chunk size 16. ring once (it is LASP-1).
_CASES = [
    (1, "all_scan", 1, 72, True),
    (2, "all_scan", 1, 64, False), (2, "all_gather", None, 64, True),
    (2, "tree", None, 64, False),
    (4, "all_scan", 2, 64, True), (4, "all_gather", None, 64, False),
    (4, "tree", None, 64, True), (4, "ring", None, 64, False),
    (8, "all_scan", V, 160, False), (8, "all_scan", None, 128, True),
    (8, "all_gather", None, 128, True), (8, "tree", None, 128, False),
    (8, "all_scan_2level", None, 160, True),
]


def test_cases_cover_every_registered_method():
  assert {case[1] for case in _CASES} == set(SCAN_METHODS)


@pytest.mark.parametrize("n,method,num_blocks,T,initial", _CASES)
def test_matches_float64_recurrence(n, method, num_blocks, T, initial):
  op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(n), method=method,
                         num_blocks=num_blocks, chunk_size=16)
  check_gdn_against_float64(op, *gdn_inputs(n, B, T, H, K, V, initial=initial))


def test_bf16():
  op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(4), num_blocks=2, chunk_size=16)
  inputs, weights = gdn_inputs(20, B, 64, H, K, V, dtype=jnp.bfloat16)
  check_gdn_against_float64(op, inputs, weights, fwd_tol=2e-2, grad_tol=2e-2)


def test_fix_up_precision_follows_the_input_dtype():
  """The fix-up GEMM ``R X`` (and so its backward's two) is float32 at HIGHEST for float32
  inputs and at the default matmul precision for bf16 ones (TF32 on a GPU; the output is
  bf16): read from the jaxpr of its forward and backward."""
  from zeco_jax._chunks import fix_up
  rows, x = jnp.ones((1, 8, 2, 4)), jnp.ones((1, 2, 4, 3))
  assert_fix_up_precision(lambda dtype: (lambda r, x: jnp.sum(fix_up(r, x, dtype)),
                                         (rows.astype(dtype), x)))


def test_no_final_state_and_data_axis_kept():
  # B split over "data" stays split; without output_final_state the state is None.
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
  (q, k, v, g, beta, h0), _ = gdn_inputs(21, B, 64, H, K, V)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "seq")))
  f = jax.jit(functools.partial(zeco_gated_delta_rule, mesh=mesh, chunk_size=16,
                                use_qk_l2norm=True))
  o, final = f(*map(put, (q, k, v, g, beta)), initial_state=h0)
  assert final is None and o.sharding.spec[:2] == ("data", "seq")
  o_r, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
  assert rel_err(o, o_r) <= 1e-5


def test_local_inside_user_shard_map():
  mesh = seq_mesh(4)
  (q, k, v, g, beta, h0), _ = gdn_inputs(22, B, 64, H, K, V)

  def body(q, k, v, g, beta, h0):
    o, after = zeco_gated_delta_rule_local(q, k, v, g, beta, axis_name="seq", chunk_size=16,
                                           initial_state=h0, output_final_state=True)
    return o, after[None]

  s4, s3 = P(None, "seq"), P(None, "seq")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(s4, s4, s4, s3, s3, P()),
                            out_specs=(s4, P("seq")), check_vma=True))
  o, after = f(q, k, v, g, beta, h0)
  o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                        output_final_state=True)
  assert rel_err(o, o_r) <= 1e-5 and rel_err(after[-1], s_r) <= 1e-5
  _, s_half = recurrent_gated_delta_rule(q[:, :32], k[:, :32], v[:, :32], g[:, :32],
                                         beta[:, :32], initial_state=h0,
                                         output_final_state=True)
  assert rel_err(after[1], s_half) <= 1e-5


def test_all_scan_sends_two_states_per_rank_whatever_P():
  # jit(grad) compiled: the All-Scan sends one K x V state forward and one back per rank,
  # and the K x K transition never travels; all_gather gathers every (S_p, M_p) forward and
  # every state's cotangent back (the backward runs the plain pass from X_p, so no
  # cotangent of M_p travels: _chunks._segment_bwd); the tree sends a pair in each of its
  # ceil(log2 P) rounds (plus the shift) forward and less back.
  # In units of one state M = B H K V 4 bytes (gdn_comm_worker.py: B = 1); a K x K
  # transition is K / V = 0.5 of it.
  pair = 1 + K / V
  for n in (4, 8):
    assert grad_bytes("all_scan", n) == 2.0, n
    gathered = grad_bytes("all_gather", n)
    assert gathered == (n - 1) * (pair + 1), (n, gathered)
    rounds = int(np.ceil(np.log2(n)))
    tree = grad_bytes("tree", n)
    assert 2 * rounds * pair - 1 <= tree <= 2 * (rounds * pair + 1), (n, tree)
  # P = 16 and 32 need more simulated devices than this process has: a subprocess.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env = dict(os.environ, XLA_FLAGS=" ".join(flags))     # the worker sets its device count
  worker = os.path.join(os.path.dirname(__file__), "gdn_comm_worker.py")
  out = subprocess.run([sys.executable, worker, "all_scan", "16", "32"], env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == {"16": 2.0, "32": 2.0}


@pytest.mark.parametrize("n,group_size,T", [(8, 3, 160), (4, 2, 64)])
def test_two_level_groups_match_float64_recurrence(n, group_size, T):
  op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(n), method="all_scan_2level",
                         group_size=group_size, num_blocks=2, chunk_size=16)
  check_gdn_against_float64(op, *gdn_inputs(50 + n, B, T, H, K, V, initial=True))


def test_two_level_segment_ids_cross_groups():
  # Groups of 2 shards of 16 tokens: row 1's document 3..48 crosses the group boundary.
  op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(4), method="all_scan_2level",
                         group_size=2, chunk_size=16)
  check_gdn_documents(op, *gdn_inputs(61, B, 64, H, K, V), GDN_SHARD_DOC_IDS)


@pytest.mark.parametrize("n,method", [(4, "all_scan"), (4, "tree"), (8, "all_gather"),
                                      (4, "ring")])
def test_segment_ids_match_per_document_float64(n, method):
  op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(n), method=method,
                         chunk_size=16)
  check_gdn_documents(op, *gdn_inputs(30 + n, B, 64, H, K, V), GDN_SHARD_DOC_IDS)


@pytest.mark.parametrize("n,initial,documents", [(4, True, False), (8, False, True)])
def test_overlap_pieces_match_float64(n, initial, documents):
  """The local pass in head groups, each a block of the All-Scan (the TPU default, asked
  for here on CPU): outputs, final state and gradients as the float64 loop's."""
  op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(n), overlap_pieces=H,
                         chunk_size=16)
  if documents:
    check_gdn_documents(op, *gdn_inputs(40 + n, B, 64, H, K, V), GDN_SHARD_DOC_IDS)
  else:
    check_gdn_against_float64(op, *gdn_inputs(40 + n, B, 64, H, K, V, initial=initial))


def _local_pass_waits(method, segment_ids=None, **options):
  (q, k, v, g, beta, _), _ = gdn_inputs(23, B, 64, H, K, V)
  op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(4), method=method,
                         chunk_size=16, segment_ids=segment_ids, **options)
  return local_pass_waits_for_the_state(op, q, k, v, g, beta)


def test_local_pass_does_not_wait_for_the_state():
  for method in ("all_scan", "all_gather", "tree"):
    assert not _local_pass_waits(method), method
  assert not _local_pass_waits("all_scan_2level", group_size=2)
  # With documents too: the previous rank's last id (a ppermute) reaches only M_p and R.
  assert not _local_pass_waits("all_scan", jnp.asarray(GDN_SHARD_DOC_IDS))
  assert _local_pass_waits("ring")     # LASP-1: compute after receive


def test_backward_runs_the_plain_pass_not_the_widened_one():
  """The forward carries the widened state (V + K columns) through its chunk scan; the
  backward's reverse scan over chunks carries V columns only: it is the plain pass's
  backward from the received state (docs/design.md §9), not autodiff's through the
  widened columns. Read from the jaxpr of grad over every input, at all_scan, all_gather
  and all_scan in head groups (K = 8, V = 16: widened 24)."""
  (q, k, v, g, beta, h0), _ = gdn_inputs(25, B, 64, H, K, V, initial=True)

  def widths(method, pieces=None):
    op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(4), method=method,
                           chunk_size=16, initial_state=h0, overlap_pieces=pieces)
    f = jax.grad(lambda *a: jnp.sum(op(*a)[0] ** 2), argnums=(0, 1, 2, 3, 4))
    scans = find_eqns(jax.make_jaxpr(f)(q, k, v, g, beta), "scan")
    by_direction = {True: set(), False: set()}
    for eqn in scans:      # the state walks' carries: [B, H, K, width], width > K
      by_direction[eqn.params["reverse"]].update(
          x.aval.shape[-1] for x in eqn.outvars
          if x.aval.ndim == 4 and x.aval.shape[-2] == K and x.aval.shape[-1] > K)
    return by_direction

  for method, pieces in (("all_scan", None), ("all_gather", None), ("all_scan", 2)):
    w = widths(method, pieces)
    assert V + K in w[False] and w[True] == {V}, (method, pieces, w)


def test_argument_errors():
  (q, k, v, g, beta, h0), _ = gdn_inputs(24, B, 60, H, K, V)
  mesh = seq_mesh(8)
  with pytest.raises(ValueError, match="not divisible by the size 8"):
    zeco_gated_delta_rule(q, k, v, g, beta, mesh=mesh)
  (q, k, v, g, beta, h0), _ = gdn_inputs(24, B, 64, H, K, V)
  with pytest.raises(ValueError, match="unknown `method` 'lasp3'"):
    zeco_gated_delta_rule(q, k, v, g, beta, mesh=mesh, method="lasp3")
  with pytest.raises(ValueError, match="num_blocks"):
    zeco_gated_delta_rule(q, k, v, g, beta, mesh=mesh, num_blocks=3)
  with pytest.raises(ValueError, match="`beta` must be"):
    zeco_gated_delta_rule(q, k, v, g, beta[:, :32], mesh=mesh)
  with pytest.raises(ValueError, match="no mesh"):
    zeco_gated_delta_rule(q, k, v, g, beta)
  with pytest.raises(ValueError, match="`overlap_pieces` must be a positive int dividing"):
    zeco_gated_delta_rule(q, k, v, g, beta, mesh=mesh, overlap_pieces=3)
  with pytest.raises(ValueError, match="method=.tree. has none to overlap"):
    zeco_gated_delta_rule(q, k, v, g, beta, mesh=mesh, method="tree", overlap_pieces=2)
  with pytest.raises(ValueError, match="`num_blocks`=2 would split them again"):
    zeco_gated_delta_rule(q, k, v, g, beta, mesh=mesh, num_blocks=2, overlap_pieces=2)
