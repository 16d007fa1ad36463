"""Kimi Delta Attention on one device: chunk_kda and the float32 token loop against the
float64 numpy token loop (forward and a hand-written vjp, zeco_jax.ops.kda.reference) on
single rows and packed documents; T below, at and past a chunk, per-channel decays down
to g = -5 per token, beta up to 0.9999, heads of 128; the chunk terms computed a group of
chunks at a time; what the backward keeps; no LAPACK call; argument errors.

Tolerances are relative norms against the float64 truth: forward (o, final state) 1e-5,
gradients (q, k, v, g, beta, h0) 1e-4 in float32; 2e-2 in bf16.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import check_kda_against_float64, check_kda_documents, kda_inputs, rel_err, rel_err64
from zeco_jax import chunk_kda, recurrent_kda
from zeco_jax._linalg import l2norm
from zeco_jax.ops.kda import chunked
from zeco_jax.ops.kda.reference import kda_float64

B, H, K, V = 2, 2, 8, 16
CHUNK64 = functools.partial(chunk_kda, chunk_size=64)     # module-level: one program per shape
CHUNK16 = functools.partial(chunk_kda, chunk_size=16)


def test_recurrent_matches_float64():
  check_kda_against_float64(recurrent_kda, *kda_inputs(0, B, 40, H, K, V))


# T below, at and past one chunk of 64 (the tail chunk padded), with and without an initial
# state. Each program runs twice: the decay mix (30% of the per-channel g in (-5, -1)) and
# g uniform in (-5, 0) with beta in (0.9, 0.9999), whose chunk sums reach about -160 per
# channel: far below float32's exp range, exact only because every exponent is a segment
# sum (never exp(+cumsum), never a difference of cumsums).
@pytest.mark.parametrize("T,initial", [(63, True), (64, False), (65, True)])
def test_chunk_matches_float64_around_a_chunk(T, initial):
  check_kda_against_float64(CHUNK64, *kda_inputs(T, B, T, H, K, V, initial=initial))
  check_kda_against_float64(CHUNK64, *kda_inputs(T + 1, B, T, H, K, V, initial=initial,
                                                 decay="strong", beta_low=0.9))


def test_chunk_terms_a_group_of_chunks_at_a_time(monkeypatch):
  # A budget of two chunks' pairwise decays: 5 chunks (T = 72, chunk 16, a padded tail) go
  # through the lax.map in groups of 2 and a remainder of 1, each group rematerialised in
  # the backward.
  B_, H_, C = B, H, 16
  monkeypatch.setattr(chunked, "TERMS_BYTES_PER_STEP", 2 * 4 * B_ * H_ * C * C * K)
  assert chunked.chunks_per_step(B_, H_, C, K) == 2
  op = functools.partial(chunk_kda, chunk_size=C)
  check_kda_against_float64(op, *kda_inputs(9, B_, 72, H_, K, V, decay="strong"))


def test_grouped_chunk_terms_keep_no_pairwise_decays(monkeypatch):
  # With the map over groups of chunks, the vjp of the chunk terms keeps the inputs (and
  # nothing of size [N, C, C, K]): each group's pairwise decays are recomputed.
  monkeypatch.setattr(chunked, "TERMS_BYTES_PER_STEP", 1)
  N, C = 8, 16
  (q, k, v, g, beta, _), _ = kda_inputs(10, 1, N * C, H, K, V)
  chunks = [jnp.moveaxis(x, 2, 1).reshape((1, H, N, C) + x.shape[3:])
            for x in (q, k, v, g, beta)]
  kept = jax.tree.leaves(jax.eval_shape(     # the vjp's residuals, traced, not computed
      lambda *a: jax.vjp(lambda *b: chunked.chunk_terms_bounded(*b, scale=0.5), *a)[1],
      *chunks))
  pairwise = H * N * C * C * K
  assert max(x.size for x in kept) < pairwise, [x.shape for x in kept]


def test_chunk_bf16():
  inputs, weights = kda_inputs(3, B, 64, H, K, V, dtype=jnp.bfloat16)
  check_kda_against_float64(CHUNK16, inputs, weights, fwd_tol=2e-2, grad_tol=2e-2)


def test_use_qk_l2norm_normalises_inside():
  (q, k, v, g, beta, h0), _ = kda_inputs(4, B, 32, H, K, V)
  raw_k = 3.0 * k + 0.5
  run = functools.partial(jax.jit, static_argnames=("output_final_state", "use_qk_l2norm"))
  o1, s1 = run(CHUNK16)(q, raw_k, v, g, beta, initial_state=h0, output_final_state=True,
                        use_qk_l2norm=True)
  o2, s2 = run(recurrent_kda)(l2norm(q), l2norm(raw_k), v, g, beta, initial_state=h0,
                              output_final_state=True)
  assert rel_err(o1, o2) <= 1e-5 and rel_err(s1, s2) <= 1e-5


def test_backward_keeps_inputs_and_one_state_per_chunk():
  # The custom_vjp keeps the inputs and the state entering each chunk: nothing per token
  # beyond the inputs (a [B, T, H, K, V] state per token would be T / C times more), and no
  # [C, C, K] pairwise decays.
  T, C = 256, 16
  (q, k, v, g, beta, h0), _ = kda_inputs(5, 1, T, H, K, V)
  leaves = jax.tree.leaves(jax.eval_shape(   # the vjp's residuals, traced, not computed
      lambda *a: jax.vjp(lambda *b: chunk_kda(*b[:5], initial_state=b[5], chunk_size=C)[0],
                         *a)[1], q, k, v, g, beta, h0))
  inputs = sum(x.size for x in (q, k, v, g, beta, h0))
  beyond = sum(x.size for x in leaves) - inputs
  assert beyond <= (T // C) * H * K * V, (beyond, [x.shape for x in leaves])
  assert not any(x.size >= T * H * K * V for x in leaves), [x.shape for x in leaves]


# Documents of 1-30 tokens, starts inside and on chunk boundaries (16, 32), padding (-1) in
# the middle and at the end; T = 72, chunk 16 (a padded tail chunk).
DOC_IDS = np.array([[0] * 5 + [1] * 11 + [2] * 16 + [-1] * 3 + [3] * 30 + [4] + [-1] * 6,
                    [7] * 20 + [8] * 12 + [9] * 30 + [10] * 10])


@pytest.mark.parametrize("op", [recurrent_kda, CHUNK16], ids=["recurrent", "chunk"])
def test_segment_ids_match_per_document_float64(op):
  check_kda_documents(op, *kda_inputs(7, B, 72, H, K, V), DOC_IDS)


# Heads of 128 (the size users run; earlier bugs hid outside K <= 32), T at and just past
# one chunk of 64: the gradients under jit, and past the chunk the forward op by op (eager).
@pytest.mark.parametrize("T", [64, 65])
def test_head_size_128_jit_and_eager(T):
  inputs, weights = kda_inputs(11 + T, 1, T, 1, 128, 128)
  check_kda_against_float64(CHUNK64, inputs, weights)
  if T == 64:
    return
  q, k, v, g, beta, h0 = inputs
  o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
  o64, s64, _ = kda_float64(*inputs, *weights)
  assert rel_err64(o, o64) <= 1e-5 and rel_err64(s, s64) <= 1e-5


def test_argument_errors():
  (q, k, v, g, beta, h0), _ = kda_inputs(6, B, 32, H, K, V)
  with pytest.raises(ValueError, match=r"`g` \(log-decay per key channel.*\[B, T, H, K\]"):
    chunk_kda(q, k, v, g[..., 0], beta)
  with pytest.raises(ValueError, match=r"`g` \(log-decay per key channel"):
    chunk_kda(q, k, v, None, beta)
  with pytest.raises(ValueError, match=r"`beta` must be \[B, T, H\]"):
    chunk_kda(q, k, v, g, beta[..., None])
  with pytest.raises(ValueError, match="chunk_size"):
    chunk_kda(q, k, v, g, beta, chunk_size=0)
  with pytest.raises(ValueError, match="initial_state"):
    chunk_kda(q, k, v, g, beta, initial_state=h0[..., :4])
  with pytest.raises(ValueError, match="segment_ids"):
    chunk_kda(q, k, v, g, beta, segment_ids=jnp.zeros((B, 31), jnp.int32))
  with pytest.raises(ValueError, match=r"backend='pallas' needs K \(q.shape\[-1\]\) a power "
                                       r"of two >= 16, got 8"):
    chunk_kda(q, k, v, g, beta, backend="pallas")
  with pytest.raises(ValueError, match="unknown `backend` 'triton'"):
    chunk_kda(q, k, v, g, beta, backend="triton")
  with pytest.raises(ValueError, match="`kernel_config` must be a pallas_kernels.kda.KernelConfig"):
    chunk_kda(q, k, v, g, beta, kernel_config=object())
  with pytest.raises(ValueError, match="`g` \\(log-decay per key channel"):
    recurrent_kda(q, k, v, g[:, :, :1], beta)


def test_chunked_form_has_no_lapack_call():
  """No triangular solve (a LAPACK call on CPU, which waits on the thread pool the
  simulated devices' collectives hold: it hung zeco_gated_delta_rule on jax 0.10.2)."""
  (q, k, v, g, beta, h0), _ = kda_inputs(5, 1, 64, 1, K, V)
  fn = jax.grad(lambda *a: jnp.sum(chunk_kda(*a, initial_state=h0)[0]),
                argnums=(0, 1, 2, 3, 4))
  text = jax.jit(fn).lower(q, k, v, g, beta).as_text()
  assert "triangular_solve" not in text and "custom_call" not in text
