"""Issue 13: packed documents (``segment_ids``) in every GLA op, backend and scan method.

The truth is a float64 per-document recurrence: every document of every row is run alone
through test_decay_range's numpy token loop (forward and its hand-written vjp), from
``initial_state`` for the document holding token 0 and from zero for every other; padding
gets zero outputs and gradients. Bars (relative norm): forward (o, final state) <= 1e-5
and gradients of q, k, v, g, h0 <= 1e-4 in float32; 2e-2 in bfloat16.

The layout (T = 256, chunk 16, shards of 128 / 64 / 32 tokens at P = 2 / 4 / 8) has
documents shorter than a chunk (1, 3, 5, 11 tokens), starting exactly on a chunk boundary
and on a shard boundary for every P (16, 32, 64, 128), straddling shards, longer than a
shard (119 and 197 tokens), padding at the start, middle and end of a row, and an id that
comes back after padding (a new document). One jitted vjp per (op, options), module-wide.
"""
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from test_decay_range import gla64
from test_parallel import _communicates, _find_shard_map
from zeco_jax import (chunk_gla, chunk_gla_reference, recurrent_gla, segments, zeco_gla)
from zeco_jax.runtime.hlo_stats import collective_bytes
from zeco_jax.nn import ShortConvolution

B, T, H, K, V = 2, 256, 2, 16, 16
C = 16
FWD_TOL, GRAD_TOL, BF16_TOL = 1e-5, 1e-4, 2e-2


def _row(runs):
  return np.concatenate([np.full(n, i, np.int32) for i, n in runs])


# (id, length) runs. Row 0: token 0's document (seeded by h0) is 5 long; starts at 5, 16
# (chunk), 37, 38 (a 1-token document), 64 (chunk and shard at P = 4, 8), 100, 128 (shard
# at P = 2, 4, 8), 131; 6 padding tokens at the end (final state: the 119-token document's).
# Row 1: 3 padding tokens first (h0 never reaches a document), a 197-token document over
# shard boundaries, one padding token (another negative id), then id 7 again: a new one.
IDS = np.stack([
    _row([(0, 5), (1, 11), (2, 21), (3, 1), (4, 26), (5, 36), (6, 28), (7, 3), (8, 119),
          (-1, 6)]),
    _row([(-1, 3), (7, 197), (-2, 1), (7, 55)]),
])


def _docs(ids_row):
  """[(start, end)] of the documents of one row."""
  out, t = [], 0
  while t < len(ids_row):
    e = t
    while e < len(ids_row) and ids_row[e] == ids_row[t]:
      e += 1
    if ids_row[t] >= 0:
      out.append((t, e))
    t = e
  return out


def per_document64(q, k, v, g, h0, do, dht, ids, scale):
  """float64 truth: (o, final, grads) with every document run alone (gla64)."""
  f = lambda x: np.asarray(x, np.float64)
  q, k, v, do = map(f, (q, k, v, do))
  Bq, Tq, Hq, Kq = q.shape
  g = np.zeros((Bq, Tq, Hq)) if g is None else f(g)
  h0 = np.zeros((Bq, Hq, Kq, v.shape[-1])) if h0 is None else f(h0)
  dht = np.zeros(h0.shape) if dht is None else f(dht)
  o, final = np.zeros(v.shape), np.array(h0)
  grads = dict(q=np.zeros(q.shape), k=np.zeros(k.shape), v=np.zeros(v.shape),
               g=np.zeros(g.shape), h0=np.array(dht))
  for b in range(Bq):
    docs = _docs(np.asarray(ids[b]))
    for n, (s, e) in enumerate(docs):
      first, last = s == 0, n == len(docs) - 1
      start = h0[b:b + 1] if first else np.zeros((1,) + h0.shape[1:])
      sl = lambda x: x[b:b + 1, s:e]
      o_d, S_d, g_d = gla64(sl(q), sl(k), sl(v), sl(g), start, sl(do),
                            dht[b:b + 1] if last else None, scale)
      o[b, s:e] = o_d[0]
      if last:
        final[b] = S_d[0]
      for name in "qkvg":
        grads[name][b, s:e] = g_d[name][0]
      if first:
        grads["h0"][b] = g_d["h0"][0]
    if docs and docs[0][0] != 0:       # h0 is dropped at the first document start
      grads["h0"][b] = 0.0
  return o, final, grads


def inputs(seed, decay="dim", dtype=jnp.float32, h0=True):
  r = np.random.default_rng(seed)
  x = lambda *s: jnp.asarray(r.standard_normal(s), dtype)
  q, k, v = x(B, T, H, K), x(B, T, H, K), x(B, T, H, V)
  g_shape = {"dim": (B, T, H, K), "scalar": (B, T, H), None: None}[decay]
  g = None if g_shape is None else jnp.asarray(np.log(r.uniform(0.6, 1.0, g_shape)), jnp.float32)
  state = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32) if h0 else None
  do = jnp.asarray(r.standard_normal((B, T, H, V)), jnp.float32)
  dht = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
  return q, k, v, g, state, do, dht


@functools.lru_cache(maxsize=None)
def truth(seed, decay="dim", dtype=jnp.float32, h0=True, ids_key=None):
  q, k, v, g, state, do, dht = inputs(seed, decay, dtype, h0)
  return per_document64(q, k, v, g, state, do, dht, IDS, K ** -0.5)


@functools.lru_cache(maxsize=None)
def vjp_of(op, **kwargs):
  """One jitted (o, final, grads) per op and options, reused across inputs."""
  def run(q, k, v, g, h0, ids, do, dht):
    def f(q, k, v, g, h0):
      return op(q, k, v, g, initial_state=h0, output_final_state=True, segment_ids=ids,
                **kwargs)
    (o, final), pull = jax.vjp(f, q, k, v, g, h0)
    return o, final, pull((do.astype(o.dtype), dht))
  return jax.jit(run)


def check(op, seed=0, decay="dim", dtype=jnp.float32, h0=True, fwd_tol=FWD_TOL,
          grad_tol=GRAD_TOL, **kwargs):
  q, k, v, g, state, do, dht = inputs(seed, decay, dtype, h0)
  o, final, grads = vjp_of(op, **kwargs)(q, k, v, g, state, jnp.asarray(IDS), do, dht)
  o_r, final_r, grads_r = truth(seed, decay, dtype, h0)
  assert o.dtype == v.dtype and o.shape == v.shape
  errs = {"o": rel_err64(o, o_r), "final": rel_err64(final, final_r)}
  for name, got in zip("q k v g h0".split(), grads):
    if got is not None:
      errs["d" + name] = rel_err64(got, grads_r[name])
  bad = {n: e for n, e in errs.items() if e > (fwd_tol if n in ("o", "final") else grad_tol)}
  assert not bad, (bad, errs)
  # padding: zero output and zero gradients there
  pad = jnp.asarray(IDS < 0)
  assert not np.any(np.asarray(o)[np.asarray(pad)]), "padding tokens must output zero"
  for got in grads[:3]:
    assert not np.any(np.asarray(got)[np.asarray(pad)]), "padding must get zero gradients"


def rel_err64(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "result has NaN or Inf"
  nb = np.linalg.norm(b)
  assert nb > 0
  return float(np.linalg.norm(a - b) / nb)


def seq_mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("seq",))


# --- references and the single-device op -----------------------------------------------

def test_references_match_the_per_document_truth():
  check(recurrent_gla)
  check(chunk_gla_reference, chunk_size=C)


@pytest.mark.parametrize("decay,h0", [("dim", True), ("scalar", False), (None, True)])
def test_chunk_gla_jnp(decay, h0):
  check(chunk_gla, decay=decay, h0=h0, chunk_size=C, backend="jax")


def test_chunk_gla_bf16():
  check(chunk_gla, dtype=jnp.bfloat16, fwd_tol=BF16_TOL, grad_tol=BF16_TOL, chunk_size=C,
        backend="jax")


def test_chunk_gla_pallas_gpu_and_tpu_kernels():
  # The Triton-lowered GPU kernels and the Mosaic TPU kernels, both in the interpreter.
  pallas_kernels = pytest.importorskip("pallas_kernels")
  check(chunk_gla, chunk_size=C, backend="pallas")
  tpu = pallas_kernels.KernelConfig(platform="tpu", interpret=True)
  check(chunk_gla, chunk_size=C, backend="pallas", kernel_config=tpu)


def test_without_final_state_or_initial_state():
  q, k, v, g, _, _, _ = inputs(1)
  ids = jnp.asarray(IDS)
  o, final = chunk_gla(q, k, v, g, chunk_size=C, backend="jax", segment_ids=ids)
  o_r, _, _ = per_document64(q, k, v, g, None, np.zeros(v.shape), None, IDS, K ** -0.5)
  assert final is None and rel_err64(o, o_r) <= FWD_TOL


# --- zeco_gla: every method, P in {1, 2, 4, 8} ------------------------------------------

_ZECO = [(1, "all_scan"), (2, "all_scan"), (4, "all_scan"), (8, "all_scan"),
         (8, "all_gather"), (2, "ring"), (8, "ring"), (4, "tree"), (8, "tree")]


@pytest.mark.parametrize("n,method", _ZECO)
def test_zeco_gla_jnp(n, method):
  check(zeco_gla, mesh=seq_mesh(n), method=method, chunk_size=C, backend="jax")


def test_zeco_gla_scalar_decay_no_decay_and_bf16():
  check(zeco_gla, decay="scalar", h0=False, mesh=seq_mesh(4), chunk_size=C, backend="jax")
  check(zeco_gla, decay=None, mesh=seq_mesh(8), method="tree", chunk_size=C, backend="jax")
  check(zeco_gla, dtype=jnp.bfloat16, fwd_tol=BF16_TOL, grad_tol=BF16_TOL, mesh=seq_mesh(4),
        chunk_size=C, backend="jax")


def test_zeco_gla_head_groups_overlapping_the_sends():
  """The local pass in head groups (overlap_pieces, the TPU default) with documents: each
  group's fix-up sees its own slice of the reset decay."""
  check(zeco_gla, mesh=seq_mesh(4), num_blocks=2, overlap_pieces=2, chunk_size=C,
        backend="jax")


@pytest.mark.parametrize("n,method", [(2, "all_scan"), (8, "ring")])
def test_zeco_gla_pallas(n, method):
  pytest.importorskip("pallas_kernels")
  check(zeco_gla, mesh=seq_mesh(n), method=method, chunk_size=C, backend="pallas")


# --- communication and overlap ----------------------------------------------------------

def _grad_hlo_bytes(n, method, with_ids):
  mesh = seq_mesh(n)
  Tn = 16 * n
  shapes = [jax.ShapeDtypeStruct((B, Tn, H, d), jnp.float32) for d in (K, K, V, K)]
  ids = jnp.asarray(np.repeat(np.arange(Tn // 24 + 1, dtype=np.int32), 24)[None, :Tn]
                    .repeat(B, 0))

  def loss(q, k, v, g):
    o, _ = zeco_gla(q, k, v, g, mesh=mesh, method=method, num_blocks=4, chunk_size=16,
                    segment_ids=ids if with_ids else None)
    return jnp.sum(o)

  text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(*shapes).compile().as_text()
  return sum(collective_bytes(text, n).values())


def test_all_scan_still_sends_two_states_per_rank():
  M = B * H * K * V * 4
  for n in (4, 8):
    sent = _grad_hlo_bytes(n, "all_scan", True)
    # forward chain + reverse chain: 2 states, plus the previous rank's last id (B int32).
    assert 2 * M <= sent.max() <= 2 * M + 4 * B, (n, sent / M)


def test_local_pass_does_not_wait_for_the_state_with_segments():
  mesh = seq_mesh(4)
  q, k, v, g, _, _, _ = inputs(2)
  for method, waits in (("all_scan", False), ("all_gather", False), ("ring", True)):
    jaxpr = jax.make_jaxpr(
        lambda q, k, v, g, ids: zeco_gla(q, k, v, g, mesh=mesh, method=method, chunk_size=16,
                                         segment_ids=ids))(q, k, v, g, jnp.asarray(IDS)).jaxpr
    body = _find_shard_map(jaxpr.eqns).params["jaxpr"]
    tainted, local_calls, comm = set(), [], 0
    for eqn in body.eqns:
      ins = [x for x in eqn.invars if isinstance(x, jax.extend.core.Var)]
      communicates = _communicates(eqn)
      if eqn.primitive.name.startswith("custom_vjp") and not communicates:
        local_calls.append(any(x in tainted for x in ins))
      if communicates or any(x in tainted for x in ins):
        comm += communicates
        tainted.update(eqn.outvars)
    assert comm > 1 and local_calls, method
    assert any(local_calls) == waits, method


# --- helpers, the short convolution, errors ---------------------------------------------

def test_cu_seqlens_to_segment_ids():
  ids = segments.cu_seqlens_to_segment_ids(np.array([0, 3, 3, 7]), 10)
  np.testing.assert_array_equal(ids, [[0, 0, 0, 2, 2, 2, 2, -1, -1, -1]])
  full = jax.jit(segments.cu_seqlens_to_segment_ids, static_argnums=1)(jnp.array([0, 4, 6]), 6)
  np.testing.assert_array_equal(full, [[0, 0, 0, 0, 1, 1]])
  starts = segments.document_starts(jnp.asarray([[5, 5, -1, 5, 6, 6]]))
  np.testing.assert_array_equal(starts, [[1, 0, 0, 1, 1, 0]])
  pos = segments.position_in_document(jnp.asarray([[5, 5, -1, 5, 6, 6]]))
  np.testing.assert_array_equal(pos, [[0, 1, 0, 0, 0, 1]])
  for bad in (np.array([1, 3]), np.array([0, 5, 4]), np.array([0, 11])):
    with pytest.raises(ValueError, match="cu_seqlens"):
      segments.cu_seqlens_to_segment_ids(bad, 10)


def test_short_convolution_does_not_read_across_a_start():
  conv = ShortConvolution(3, 4, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 20, 3)), jnp.float32)
  ids = jnp.asarray([[0] * 5 + [1] * 2 + [-1] * 2 + [2] * 11, [3] * 20], jnp.int32)
  y = conv(x, ids)
  for b, spans in ((0, [(0, 5), (5, 7), (7, 9), (9, 20)]), (1, [(0, 20)])):
    for s, e in spans:   # each document alone, as if it began the row
      np.testing.assert_allclose(y[b:b + 1, s:e], conv(x[b:b + 1, s:e]), atol=1e-6)
  assert not np.allclose(y[0], conv(x)[0])


def test_segment_ids_errors():
  q, k, v, g, _, _, _ = inputs(4)
  with pytest.raises(ValueError, match=r"chunk_gla: `segment_ids` must be \[B, T\]"):
    chunk_gla(q, k, v, g, segment_ids=jnp.zeros((B, T - 1), jnp.int32))
  with pytest.raises(ValueError, match="zeco_gla: `segment_ids` must be an integer"):
    zeco_gla(q, k, v, g, mesh=seq_mesh(2), segment_ids=jnp.zeros((B, T), jnp.float32))


def test_layer_on_a_seq_mesh_equals_each_document_alone():
  # GatedLinearAttention (short convolution + zeco_gla over 4 shards) on a packed row equals
  # the layer run on each document by itself; the data x seq mesh keeps B split.
  from zeco_jax.nn import GatedLinearAttention
  layer = GatedLinearAttention(32, 2, use_short_conv=True, chunk_size=16, backend="jax",
                               rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, 32)), jnp.float32)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
  y = jax.jit(lambda x, ids: layer(x, mesh=mesh, segment_ids=ids))(x, jnp.asarray(IDS))
  one_device = jax.jit(lambda x, ids: layer(x, segment_ids=ids))(x, jnp.asarray(IDS))
  assert rel_err64(y, one_device) <= FWD_TOL
  # a document after leading padding, over the shard boundaries 64, 128 and 192 (each
  # length alone compiles once: one is enough here, the op itself is checked above)
  alone = jax.jit(layer)(x[1:2, 3:200])
  assert rel_err64(y[1:2, 3:200], alone) <= FWD_TOL
