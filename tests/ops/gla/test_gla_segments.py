"""Packed documents (``segment_ids``) in GLA's references, chunk_gla (jnp path) and zeco_gla
with every scan method at P = 1, 2, 4, 8, against the float64 truth run document by document
(``helpers.check_documents``): every document of every row alone through
``gla_float64`` (the token loop and its hand-written vjp), from ``initial_state`` for the
document holding token 0 and from zero for every other; padding gets zero outputs and
gradients. Bars (relative norm): forward (o, final state) <= 1e-5 and gradients of q, k,
v, g, h0 <= 1e-4 in float32; 2e-2 in bfloat16. Also: what zeco_gla sends with documents,
and that its local pass still does not wait for the received state.

The layout (``helpers.DOC_IDS``: T = 256, chunk 16, shards of 128 / 64 / 32 tokens at P =
2 / 4 / 8) has documents shorter than a chunk, starting exactly on a chunk boundary and on
a shard boundary for every P, straddling shards, longer than a shard, padding at the
start, middle and end of a row, and an id that comes back after padding. One jitted vjp
per (op, options), shared by the tests of a process.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (DOC_IDS, DOC_SHAPE, check_documents, document_inputs, gla_shapes,
                     local_pass_waits_for_the_state, output_sum_grad, rel_err64, seq_mesh,
                     states_sent_per_rank)
from zeco_jax import chunk_gla, chunk_gla_reference, recurrent_gla, zeco_gla
from zeco_jax.ops.gla.reference import gla_float64_documents

B, T, H, K, V = DOC_SHAPE
C = 16
FWD_TOL, BF16_TOL = 1e-5, 2e-2


# --- references and the single-device op --------------------------------------------------

def test_references_match_the_per_document_truth():
  check_documents(recurrent_gla)
  check_documents(chunk_gla_reference, chunk_size=C)


@pytest.mark.parametrize("decay,h0", [("dim", True), ("scalar", False), (None, True)])
def test_chunk_gla_jnp(decay, h0):
  check_documents(chunk_gla, decay=decay, h0=h0, chunk_size=C, backend="jax")


def test_chunk_gla_bf16():
  check_documents(chunk_gla, dtype=jnp.bfloat16, fwd_tol=BF16_TOL, grad_tol=BF16_TOL,
                  chunk_size=C, backend="jax")


def test_without_final_state_or_initial_state():
  q, k, v, g, _, _, _ = document_inputs(1)
  ids = jnp.asarray(DOC_IDS)
  o, final = jax.jit(lambda *a: chunk_gla(*a, chunk_size=C, backend="jax", segment_ids=ids))(
      q, k, v, g)
  o_r, _, _ = gla_float64_documents(q, k, v, g, None, np.zeros(v.shape), None, DOC_IDS,
                                    K ** -0.5)
  assert final is None and rel_err64(o, o_r) <= FWD_TOL


# --- zeco_gla: every method, P in {1, 2, 4, 8} --------------------------------------------

_ZECO = [(1, "all_scan"), (2, "all_scan"), (4, "all_scan"), (8, "all_scan"),
         (8, "all_gather"), (2, "ring"), (8, "ring"), (4, "tree"), (8, "tree")]


@pytest.mark.parametrize("n,method", _ZECO)
def test_zeco_gla_jnp(n, method):
  check_documents(zeco_gla, mesh=seq_mesh(n), method=method, chunk_size=C, backend="jax")


def test_zeco_gla_two_level_documents_cross_groups():
  # Groups of 3 shards of 32 tokens: documents cross the group boundaries at tokens 96
  # and 192 (row 0's 64..100 and 131..250, row 1's 3..200), and a group boundary.
  check_documents(zeco_gla, mesh=seq_mesh(8), method="all_scan_2level", group_size=3,
                  num_blocks=2, chunk_size=C, backend="jax")


def test_zeco_gla_scalar_decay_no_decay_and_bf16():
  check_documents(zeco_gla, decay="scalar", h0=False, mesh=seq_mesh(4), chunk_size=C,
                  backend="jax")
  check_documents(zeco_gla, decay=None, mesh=seq_mesh(8), method="tree", chunk_size=C,
                  backend="jax")
  check_documents(zeco_gla, dtype=jnp.bfloat16, fwd_tol=BF16_TOL, grad_tol=BF16_TOL,
                  mesh=seq_mesh(4), chunk_size=C, backend="jax")


def test_zeco_gla_head_groups_overlapping_the_sends():
  """The local pass in head groups (overlap_pieces, the TPU default) with documents: each
  group's fix-up sees its own slice of the reset decay."""
  check_documents(zeco_gla, mesh=seq_mesh(4), num_blocks=2, overlap_pieces=2, chunk_size=C,
                  backend="jax")


# --- communication and overlap ------------------------------------------------------------

def test_all_scan_still_sends_two_states_per_rank():
  state = B * H * K * V * 4                          # one float32 state, bytes
  for n in (4, 8):
    Tn = 16 * n                                      # 24-token documents
    ids = jnp.asarray(np.repeat(np.arange(Tn // 24 + 1, dtype=np.int32), 24)[None, :Tn]
                      .repeat(B, 0))
    op = functools.partial(zeco_gla, mesh=seq_mesh(n), method="all_scan", num_blocks=4,
                           chunk_size=16, segment_ids=ids)
    sent = states_sent_per_rank(output_sum_grad(op, 4), gla_shapes(B, Tn, H, K, V), n, state)
    # forward chain + reverse chain: 2 states, plus the previous rank's last id (B int32).
    assert 2 <= sent.max() <= 2 + 4 * B / state, (n, sent)


def test_local_pass_does_not_wait_for_the_state_with_segments():
  q, k, v, g, _, _, _ = document_inputs(2)
  for method, waits in (("all_scan", False), ("all_gather", False), ("ring", True)):
    op = lambda q, k, v, g, ids: zeco_gla(q, k, v, g, mesh=seq_mesh(4), method=method,
                                          chunk_size=16, segment_ids=ids)
    assert local_pass_waits_for_the_state(op, q, k, v, g, jnp.asarray(DOC_IDS),
                                          min_collectives=2) == waits, method


def test_segment_ids_errors():
  q, k, v, g, _, _, _ = document_inputs(4)
  with pytest.raises(ValueError, match=r"chunk_gla: `segment_ids` must be \[B, T\]"):
    chunk_gla(q, k, v, g, segment_ids=jnp.zeros((B, T - 1), jnp.int32))
  with pytest.raises(ValueError, match="zeco_gla: `segment_ids` must be an integer"):
    zeco_gla(q, k, v, g, mesh=seq_mesh(2), segment_ids=jnp.zeros((B, T), jnp.float32))


