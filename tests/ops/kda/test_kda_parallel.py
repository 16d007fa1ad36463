"""zeco_kda on simulated CPU devices against the float64 token loop (single rows and packed
documents crossing shard boundaries) at P = 1, 2, 4, 8 with every scan method, its
communication read from the compiled HLO, and the local pass's independence of the state
it receives (docs/design.md §13).

Tolerances are relative norms against the float64 truth: forward 1e-5, gradients 1e-4
in float32; 2e-2 in bf16.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import (GDN_SHARD_DOC_IDS, check_kda_against_float64, check_kda_documents,
                     gla_shapes, kda_inputs, local_pass_waits_for_the_state, output_sum_grad,
                     rel_err, seq_mesh, states_sent_per_rank)
from zeco_jax import recurrent_kda
from zeco_jax.ops.kda.parallel import zeco_kda, zeco_kda_local
from zeco_jax.sp.scan import SCAN_METHODS

B, H, K, V = 2, 2, 8, 16


# (P, method, num_blocks, group_size, T, initial state): every method, P = 1, 2, 4, 8, with
# and without an initial state; T = 72 on one device and T = 160 on 8 (20-token segments)
# are not multiples of the chunk size 16; ring once (it is LASP-1); the two-level All-Scan
# with groups of 3 at P = 8 (a short last group) and of 2 at P = 4.
_CASES = [
    (1, "all_scan", 1, None, 72, True),
    (2, "all_scan", 1, None, 64, False), (2, "tree", None, None, 64, True),
    (4, "all_scan", 2, None, 64, True), (4, "all_gather", None, None, 64, False),
    (4, "ring", None, None, 64, True), (4, "all_scan_2level", 2, 2, 64, False),
    (8, "all_scan", V, None, 160, False), (8, "all_gather", None, None, 128, True),
    (8, "tree", None, None, 128, False), (8, "all_scan_2level", 2, 3, 160, True),
]


def test_cases_cover_every_registered_method():
  assert {case[1] for case in _CASES} == set(SCAN_METHODS)
  assert {case[0] for case in _CASES} == {1, 2, 4, 8}


@pytest.mark.parametrize("n,method,num_blocks,group_size,T,initial", _CASES)
def test_matches_float64_recurrence(n, method, num_blocks, group_size, T, initial):
  op = functools.partial(zeco_kda, mesh=seq_mesh(n), method=method, num_blocks=num_blocks,
                         group_size=group_size, chunk_size=16)
  check_kda_against_float64(op, *kda_inputs(n, B, T, H, K, V, initial=initial))


# GDN_SHARD_DOC_IDS (T = 64): documents spanning ranks, starts on a rank's first token (t =
# 16 and 48 at P = 4, also 8 and 40 at P = 8), inside ranks, padding across the boundary
# at t = 32; the two-level scan's groups of 2 ranks split row 1's document 3..48.
@pytest.mark.parametrize("n,method,group_size", [(4, "all_scan", None), (8, "tree", None),
                                                 (8, "all_gather", None), (4, "ring", None),
                                                 (4, "all_scan_2level", 2)])
def test_segment_ids_match_per_document_float64(n, method, group_size):
  op = functools.partial(zeco_kda, mesh=seq_mesh(n), method=method, group_size=group_size,
                         chunk_size=16)
  check_kda_documents(op, *kda_inputs(30 + n, B, 64, H, K, V), GDN_SHARD_DOC_IDS)


@pytest.mark.parametrize("documents", [False, True], ids=["initial", "documents"])
def test_overlap_pieces_match_float64(documents):
  """The local pass in head groups, each a block of the All-Scan (the TPU default, asked
  for here on CPU), P = 4: outputs, final state and gradients as the float64 loop's."""
  op = functools.partial(zeco_kda, mesh=seq_mesh(4), overlap_pieces=H, chunk_size=16)
  if documents:
    check_kda_documents(op, *kda_inputs(50, B, 64, H, K, V), GDN_SHARD_DOC_IDS)
  else:
    check_kda_against_float64(op, *kda_inputs(51, B, 64, H, K, V, initial=True))


def test_chunk_terms_in_groups_inside_shard_map(monkeypatch):
  # The long-sequence path on every rank: 40-token segments of 3 chunks, the chunk terms
  # one chunk at a time (lax.map under jax.checkpoint, inside shard_map).
  from zeco_jax.ops.kda import chunked
  monkeypatch.setattr(chunked, "TERMS_BYTES_PER_STEP", 4 * B * H * 16 * 16 * K)
  op = functools.partial(zeco_kda, mesh=seq_mesh(4), chunk_size=16)
  check_kda_against_float64(op, *kda_inputs(25, B, 160, H, K, V))


def test_bf16():
  op = functools.partial(zeco_kda, mesh=seq_mesh(4), num_blocks=2, chunk_size=16)
  inputs, weights = kda_inputs(20, B, 64, H, K, V, dtype=jnp.bfloat16)
  check_kda_against_float64(op, inputs, weights, fwd_tol=2e-2, grad_tol=2e-2)


def test_no_final_state_and_data_axis_kept():
  # B split over "data" stays split; without output_final_state the state is None.
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
  (q, k, v, g, beta, h0), _ = kda_inputs(21, B, 64, H, K, V)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "seq")))
  f = jax.jit(functools.partial(zeco_kda, mesh=mesh, chunk_size=16, use_qk_l2norm=True))
  o, final = f(*map(put, (q, k, v, g, beta)), initial_state=h0)
  assert final is None and o.sharding.spec[:2] == ("data", "seq")
  o_r, _ = recurrent_kda(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
  assert rel_err(o, o_r) <= 1e-5


def test_local_inside_user_shard_map():
  mesh = seq_mesh(4)
  (q, k, v, g, beta, h0), _ = kda_inputs(22, B, 64, H, K, V)

  def body(q, k, v, g, beta, h0):
    o, after = zeco_kda_local(q, k, v, g, beta, axis_name="seq", chunk_size=16,
                              initial_state=h0, output_final_state=True)
    return o, after[None]

  s4, s3 = P(None, "seq"), P(None, "seq")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(s4, s4, s4, s4, s3, P()),
                            out_specs=(s4, P("seq")), check_vma=True))
  o, after = f(q, k, v, g, beta, h0)
  o_r, s_r = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
  assert rel_err(o, o_r) <= 1e-5 and rel_err(after[-1], s_r) <= 1e-5
  _, s_half = recurrent_kda(*(x[:, :32] for x in (q, k, v, g, beta)), initial_state=h0,
                            output_final_state=True)
  assert rel_err(after[1], s_half) <= 1e-5


def test_all_scan_sends_two_states_per_rank_whatever_P():
  # jit(grad) compiled: the All-Scan sends one K x V state forward and one back per rank,
  # and the K x K transition never travels (B = 1, H = 2, K = 8, V = 16; chunk 16).
  Bc, C = 1, 16
  for n in (4, 8):
    shapes = gla_shapes(Bc, C * n, H, K, V) + [jax.ShapeDtypeStruct((Bc, C * n, H),
                                                                    jnp.float32)]
    op = functools.partial(zeco_kda, mesh=seq_mesh(n), method="all_scan", num_blocks=4,
                           chunk_size=C)
    sent = states_sent_per_rank(output_sum_grad(op, 5), shapes, n, Bc * H * K * V * 4)
    assert float(sent.max()) == 2.0, (n, sent)


def _local_pass_waits(method, segment_ids=None, **options):
  (q, k, v, g, beta, _), _ = kda_inputs(23, B, 64, H, K, V)
  op = functools.partial(zeco_kda, mesh=seq_mesh(4), method=method, chunk_size=16,
                         segment_ids=segment_ids, **options)
  return local_pass_waits_for_the_state(op, q, k, v, g, beta)


def test_local_pass_does_not_wait_for_the_state():
  for method in ("all_scan", "all_gather", "tree"):
    assert not _local_pass_waits(method), method
  assert not _local_pass_waits("all_scan_2level", group_size=2)
  # With documents too: the previous rank's last id (a ppermute) reaches only M_p and R.
  assert not _local_pass_waits("all_scan", jnp.asarray(GDN_SHARD_DOC_IDS))
  assert _local_pass_waits("ring")     # LASP-1: compute after receive


def test_argument_errors():
  (q, k, v, g, beta, h0), _ = kda_inputs(24, B, 60, H, K, V)
  mesh = seq_mesh(8)
  with pytest.raises(ValueError, match="not divisible by the size 8"):
    zeco_kda(q, k, v, g, beta, mesh=mesh)
  (q, k, v, g, beta, h0), _ = kda_inputs(24, B, 64, H, K, V)
  with pytest.raises(ValueError, match="unknown `method` 'lasp3'"):
    zeco_kda(q, k, v, g, beta, mesh=mesh, method="lasp3")
  with pytest.raises(ValueError, match="num_blocks"):
    zeco_kda(q, k, v, g, beta, mesh=mesh, num_blocks=3)
  with pytest.raises(ValueError, match="group_size"):
    zeco_kda(q, k, v, g, beta, mesh=mesh, group_size=2)
  with pytest.raises(ValueError, match="`beta` must be"):
    zeco_kda(q, k, v, g, beta[:, :32], mesh=mesh)
  with pytest.raises(ValueError, match=r"`g` \(log-decay per key channel"):
    zeco_kda(q, k, v, g[..., 0], beta, mesh=mesh)
  with pytest.raises(ValueError, match="no mesh"):
    zeco_kda(q, k, v, g, beta)
  with pytest.raises(ValueError, match="`overlap_pieces` must be a positive int dividing"):
    zeco_kda(q, k, v, g, beta, mesh=mesh, overlap_pieces=0)
