"""What the tests share: inputs, the checks every fast path runs against its reference,
and the program checks (what a compiled program sends, what a traced one waits for).

* Paths and meshes: the repository root, a 1-D ``seq`` mesh of the simulated devices, an
  abstract GPU or TPU device to trace or lower for that target on this CPU host.
* Errors: :func:`rel_err` (float32 results against any reference), :func:`rel_err64`
  (against a float64 truth kept in float64), :func:`assert_within` (a table of errors).
* GLA, Gated DeltaNet and Kimi Delta Attention: random inputs (never zeros), the value
  and gradients of one scalar loss, the comparison with the float64 truth of
  ``zeco_jax.ops.*.reference`` (the token-by-token recurrence); packed documents and mixed
  log-decays in float64.
* Programs: the equations of a jaxpr, whether the local pass waits for a collective, and
  how many K x V states each rank sends in a compiled program.
* The trainer: the tiny config, ``train.py`` as a subprocess, a persistent compilation
  cache (the ``compile_cache`` fixture of ``conftest.py`` uses it).

Nothing here is a test; a test module never imports another test module.
"""
import contextlib
import functools
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository root (train.py, configs/, models/): the working folder of subprocesses."""


# --- meshes -------------------------------------------------------------------------------

def seq_mesh(n):
  """A mesh of the first ``n`` devices on one axis, ``seq`` (Auto axes)."""
  return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("seq",))


def abstract_mesh(platform, kind, cores):
  """A one-device AbstractMesh (axis "x") of a ``platform`` device of ``kind`` with
  ``cores`` cores; skips the test on a jax without ``jax.sharding.AbstractDevice``."""
  device_cls = getattr(jax.sharding, "AbstractDevice", None)
  if device_cls is None:
    pytest.skip("this jax has no jax.sharding.AbstractDevice")
  device = device_cls(device_kind=kind, num_cores=cores, platform=platform)
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


# --- errors -------------------------------------------------------------------------------

def rel_err(a, b):
  """||a - b|| / ||b||, in float64 on the host: the tolerance measure every test states."""
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  denom = np.linalg.norm(b)
  assert denom > 0, "reference is all zeros: the comparison would prove nothing"
  assert np.all(np.isfinite(a)), "result has NaN or Inf"
  return float(np.linalg.norm(a - b) / denom)


def rel_err64(a, b):
  """:func:`rel_err` against a float64 truth ``b`` that is not rounded to float32 first."""
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "result has NaN or Inf"
  denom = np.linalg.norm(b)
  assert denom > 0, "reference is all zeros: the comparison would prove nothing"
  return float(np.linalg.norm(a - b) / denom)


def assert_within(errors, fwd_tol, grad_tol):
  """Every error of ``errors`` ({name: error}) within its bar: ``fwd_tol`` for the
  forward outputs ``o`` and ``final``, ``grad_tol`` for the rest (the gradients)."""
  bad = {n: e for n, e in errors.items() if e > (fwd_tol if n in ("o", "final") else grad_tol)}
  assert not bad, (bad, errors)


# --- GLA ----------------------------------------------------------------------------------

def gla_inputs(seed, B=2, T=64, H=2, K=8, V=16, decay="dim", dtype=jnp.float32,
               initial_state=True, low=0.6, loss_weights=False):
  """q, k, v, g, h0 drawn at random; g = log of a decay uniform in (low, 1). With
  ``loss_weights``, also the cotangents do ``[B, T, H, V]`` and dht ``[B, H, K, V]``
  (float32), drawn after the others from the same generator."""
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.standard_normal((B, T, H, K)), dtype)
  k = jnp.asarray(r.standard_normal((B, T, H, K)), dtype)
  v = jnp.asarray(r.standard_normal((B, T, H, V)), dtype)
  g_shape = {"dim": (B, T, H, K), "scalar": (B, T, H), None: None}[decay]
  g = None if g_shape is None else jnp.asarray(np.log(r.uniform(low, 1.0, g_shape)), jnp.float32)
  h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32) if initial_state else None
  if not loss_weights:
    return q, k, v, g, h0
  do = jnp.asarray(r.standard_normal((B, T, H, V)), jnp.float32)
  dht = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
  return q, k, v, g, h0, do, dht


def gla_shapes(B, T, H, K, V, dtype=jnp.float32):
  """Abstract q, k, v and per-dim g (ShapeDtypeStructs): to lower a program, not run it."""
  return [jax.ShapeDtypeStruct((B, T, H, d), dtype) for d in (K, K, V, K)]


def cotangents(seed, B, T, H, K, V):
  """Random weights for a scalar loss sum(o * w_o) + sum(final * w_s)."""
  r = np.random.default_rng(seed + 1000)
  return (jnp.asarray(r.standard_normal((B, T, H, V)), jnp.float32),
          jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32))


def _state_loss_and_grads(op, args, h0, w_o, w_s, names, kwargs):
  """o, final and the gradients of sum(o * w_o) + sum(final * w_s) w.r.t. every array of
  ``args`` (the op's positional inputs, called ``names``) and of ``h0``: one jitted program."""
  def loss(*xs):
    o, final = op(*xs[:-1], initial_state=xs[-1], output_final_state=True, **kwargs)
    return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(final * w_s), (o, final)

  inputs = (*args, h0)
  argnums = tuple(i for i, x in enumerate(inputs) if x is not None)
  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
  (_, (o, final)), grads = grad_fn(*inputs)
  present = [n for n, x in zip((*names, "h0"), inputs) if x is not None]
  return o, final, dict(zip(present, grads))


def loss_and_grads(op, q, k, v, g, h0, w_o, w_s, **kwargs):
  """Value and gradients of sum(o * w_o) + sum(final * w_s) w.r.t. every array input of
  a GLA op: (o, final, {"q": dq, "k": dk, "v": dv, "g": dg, "h0": dh0}), None inputs left out."""
  return _state_loss_and_grads(op, (q, k, v, g), h0, w_o, w_s, ("q", "k", "v", "g"), kwargs)


def assert_outputs_match(got, want, fwd_tol=1e-5, grad_tol=1e-4):
  """Two (o, final, grads) of :func:`loss_and_grads` (or :func:`gdn_loss_and_grads`) agree:
  o and the final state within ``fwd_tol``, the same gradients, each within ``grad_tol``.
  A float64 ``want`` (:func:`gla_truth`) is compared as it is (:func:`rel_err64`)."""
  (o, s, grads), (o_r, s_r, grads_r) = got, want
  err = rel_err64 if isinstance(o_r, np.ndarray) and o_r.dtype == np.float64 else rel_err
  assert o.shape == o_r.shape, (o.shape, o_r.shape)
  assert err(o, o_r) <= fwd_tol and err(s, s_r) <= fwd_tol
  assert set(grads) == set(grads_r)
  for name in grads_r:
    assert grads[name].shape == grads_r[name].shape, name
    assert err(grads[name], grads_r[name]) <= grad_tol, name


def gla_truth(q, k, v, g, h0, w_o, w_s):
  """:func:`loss_and_grads`' (o, final, grads) from the token-by-token recurrence in
  float64 (``gla_float64``: numpy, nothing to compile); a None g (no decay) or h0 (a zero
  state) gets no gradient, as in :func:`loss_and_grads`; bf16 inputs: their values."""
  from zeco_jax.ops.gla.reference import gla_float64
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  B, T, H, K = q.shape
  g64 = np.zeros((B, T, H)) if g is None else f64(g)
  s64 = np.zeros((B, H, K, v.shape[-1])) if h0 is None else f64(h0)
  o, final, grads = gla_float64(f64(q), f64(k), f64(v), g64, s64, f64(w_o), f64(w_s),
                                K ** -0.5)
  given = ["q", "k", "v"] + ["g"] * (g is not None) + ["h0"] * (h0 is not None)
  return o, final, {n: grads[n] for n in given}


def check_gla_against_recurrence(op, seed, B, T, H, K, V, *, decay="dim", initial=True,
                                 dtype=jnp.float32, fwd_tol=1e-5, grad_tol=1e-4, **kwargs):
  """A GLA op against the token-by-token recurrence in float64 (:func:`gla_truth`) on
  :func:`gla_inputs`: o (v's dtype), the final state and every gradient."""
  q, k, v, g, h0 = gla_inputs(seed, B, T, H, K, V, decay=decay, initial_state=initial,
                              dtype=dtype)
  w_o, w_s = cotangents(seed, B, T, H, K, V)
  got = loss_and_grads(op, q, k, v, g, h0, w_o, w_s, **kwargs)
  assert got[0].dtype == v.dtype
  assert_outputs_match(got, gla_truth(q, k, v, g, h0, w_o, w_s), fwd_tol, grad_tol)


@functools.lru_cache(maxsize=None)
def jitted_vjp(op, with_state=True, **kwargs):
  """One jitted ``(q, k, v, g, h0, do, dht, segment_ids=None) -> (o, final, grads)`` per op
  and options, reused across inputs: the vjp of (do, dht) for q, k, v, g and h0. With
  ``with_state`` False: no initial or final state; the vjp of do for q, k, v, g."""
  def run(q, k, v, g, h0, do, dht, segment_ids=None):
    options = dict(kwargs) if segment_ids is None else dict(kwargs, segment_ids=segment_ids)
    if not with_state:
      o, pull = jax.vjp(lambda q, k, v, g: op(q, k, v, g, **options)[0], q, k, v, g)
      return o, None, pull(do.astype(o.dtype))
    (o, final), pull = jax.vjp(
        lambda q, k, v, g, h0: op(q, k, v, g, initial_state=h0, output_final_state=True,
                                  **options), q, k, v, g, h0)
    return o, final, pull((do.astype(o.dtype), dht))
  return jax.jit(run)


# --- GLA with mixed log-decays in [-1e4, 0], against the float64 token loop ---------------

# B, T, H, K, V. "reported": the shape of the first reported input (one head, K = V = 16);
# "multi": T not a multiple of the chunk, two heads, K != V.
DECAY_SHAPES = {"reported": (1, 128, 1, 16, 16), "multi": (1, 100, 2, 16, 32)}
DECAY_KINDS = (-1e4, -100.0, -10.0, "mix")


def abs_or_rel_err(a, b):
  """||a - b|| / ||b|| in float64; absolute ||a - b|| where the exact value is ~0 (dh0 when
  token 0 carries a -1e4 or -100 log-decay: exp(g_0) underflows in float32 too)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "result has NaN or Inf"
  nb = np.linalg.norm(b)
  return float(np.linalg.norm(a - b) / (nb if nb > 1e-20 else 1.0))


def mixed_decay(kind, B, T, H, K, per_dim, seed=0):
  """Log-decays ``[B, T, H(, K)]``: -0.05 with ``kind`` (a number) every 7th token from
  token 0, or for ``"mix"`` a fraction at -1e4, some in [-300, -10], the rest log-uniform
  in [-5, -1e-3]."""
  shape = (B, T, H, K) if per_dim else (B, T, H)
  if kind != "mix":
    return jnp.full(shape, -0.05, jnp.float32).at[:, ::7].set(kind)
  r = np.random.default_rng(seed)
  g = -np.exp(r.uniform(np.log(1e-3), np.log(5.0), shape))
  u = r.uniform(size=shape)
  g = np.where(u < 0.15, -1e4, np.where(u < 0.25, -r.uniform(10.0, 300.0, shape), g))
  return jnp.asarray(g, jnp.float32)


def _decay_range_inputs(shape, seed=0):
  B, T, H, K, V = DECAY_SHAPES[shape]
  r = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return dict(q=n(B, T, H, K), k=n(B, T, H, K), v=n(B, T, H, V), h0=n(B, H, K, V),
              do=n(B, T, H, V), dht=n(B, H, K, V))


def check_decay_range(op, shape, kind, per_dim, with_state=True, fwd_tol=1e-5, grad_tol=1e-4):
  """A GLA op (``(q, k, v, g, initial_state=, output_final_state=)``) on :func:`mixed_decay`
  log-decays of ``kind`` at ``DECAY_SHAPES[shape]``, against ``gla_float64`` (the token loop
  and its hand-written vjp in float64 numpy): o and the final state within ``fwd_tol``, the
  gradients of q, k, v, g (and h0) within ``grad_tol`` (:func:`abs_or_rel_err`)."""
  from zeco_jax.ops.gla.reference import gla_float64
  x = _decay_range_inputs(shape)
  B, T, H, K, V = DECAY_SHAPES[shape]
  g = mixed_decay(kind, B, T, H, K, per_dim)
  h0 = x["h0"] if with_state else jnp.zeros_like(x["h0"])
  dht = x["dht"] if with_state else None
  o, final, grads = jitted_vjp(op, with_state)(x["q"], x["k"], x["v"], g, h0, x["do"], x["dht"])
  o64, final64, grads64 = gla_float64(x["q"], x["k"], x["v"], g, h0, x["do"], dht, K ** -0.5)
  errors = {"o": abs_or_rel_err(o, o64)}
  if with_state:
    errors["final"] = abs_or_rel_err(final, final64)
  names = "q k v g h0".split() if with_state else "q k v g".split()
  errors.update({"d" + n: abs_or_rel_err(d, grads64[n]) for n, d in zip(names, grads)})
  assert_within(errors, fwd_tol, grad_tol)
  return errors


# --- GLA on packed documents, against the float64 truth run document by document ----------

DOC_SHAPE = (2, 256, 2, 16, 16)       # B, T, H, K, V


def _doc_row(runs):
  return np.concatenate([np.full(n, i, np.int32) for i, n in runs])


# (id, length) runs. Row 0: token 0's document (seeded by h0) is 5 long; starts at 5, 16
# (chunk), 37, 38 (a 1-token document), 64 (chunk and shard at P = 4, 8), 100, 128 (shard
# at P = 2, 4, 8), 131; 6 padding tokens at the end (final state: the 119-token document's).
# Row 1: 3 padding tokens first (h0 never reaches a document), a 197-token document over
# shard boundaries, one padding token (another negative id), then id 7 again: a new one.
DOC_IDS = np.stack([
    _doc_row([(0, 5), (1, 11), (2, 21), (3, 1), (4, 26), (5, 36), (6, 28), (7, 3), (8, 119),
              (-1, 6)]),
    _doc_row([(-1, 3), (7, 197), (-2, 1), (7, 55)]),
])
"""Segment ids ``[2, 256]``: documents shorter than a chunk (1, 3, 5, 11 tokens), starting
on a chunk boundary and on a shard boundary for every P (16, 32, 64, 128), straddling
shards, longer than a shard (119 and 197 tokens), padding at the start, middle and end of
a row, and an id that comes back after padding (a new document)."""


def document_inputs(seed, decay="dim", dtype=jnp.float32, h0=True):
  """q, k, v, g, h0, do, dht of :func:`gla_inputs` at ``DOC_SHAPE``."""
  return gla_inputs(seed, *DOC_SHAPE, decay=decay, dtype=dtype, initial_state=h0,
                    loss_weights=True)


@functools.lru_cache(maxsize=None)
def _document_truth(seed, decay, dtype, h0):
  q, k, v, g, state, do, dht = document_inputs(seed, decay, dtype, h0)
  from zeco_jax.ops.gla.reference import gla_float64_documents
  return gla_float64_documents(q, k, v, g, state, do, dht, DOC_IDS, DOC_SHAPE[3] ** -0.5)


def check_documents(op, seed=0, decay="dim", dtype=jnp.float32, h0=True, fwd_tol=1e-5,
                    grad_tol=1e-4, **kwargs):
  """A GLA op with ``segment_ids=DOC_IDS`` (and ``kwargs``) against
  :func:`gla_float64_documents`: o and the final state within ``fwd_tol``, the gradients
  of q, k, v, g, h0 within ``grad_tol``; zero outputs and q, k, v gradients on padding."""
  q, k, v, g, state, do, dht = document_inputs(seed, decay, dtype, h0)
  o, final, grads = jitted_vjp(op, **kwargs)(q, k, v, g, state, do, dht, jnp.asarray(DOC_IDS))
  o_r, final_r, grads_r = _document_truth(seed, decay, dtype, h0)
  assert o.dtype == v.dtype and o.shape == v.shape
  errors = {"o": rel_err64(o, o_r), "final": rel_err64(final, final_r)}
  for name, got in zip("q k v g h0".split(), grads):
    if got is not None:
      errors["d" + name] = rel_err64(got, grads_r[name])
  assert_within(errors, fwd_tol, grad_tol)
  pad = DOC_IDS < 0
  assert not np.any(np.asarray(o)[pad]), "padding tokens must output zero"
  for got in grads[:3]:
    assert not np.any(np.asarray(got)[pad]), "padding must get zero gradients"


# --- Gated DeltaNet -----------------------------------------------------------------------

def gdn_inputs(seed, B, T, H, K, V, *, g_low=-0.5, beta_low=0.05, beta_high=0.999,
               dtype=jnp.float32, initial=True):
  """Random q, v, l2-normalised k, log-decay g in (g_low, 0), beta in (beta_low, beta_high),
  h0 and the loss weights (do, dht): ``(q, k, v, g, beta, h0), (do, dht)``."""
  from zeco_jax.ops.gated_delta.op import l2norm
  r = np.random.default_rng(seed)
  n = lambda *s: r.standard_normal(s)
  q = jnp.asarray(n(B, T, H, K), dtype)
  k = l2norm(jnp.asarray(n(B, T, H, K), jnp.float32)).astype(dtype)
  v = jnp.asarray(n(B, T, H, V), dtype)
  g = jnp.asarray(r.uniform(g_low, 0.0, (B, T, H)), jnp.float32)
  beta = jnp.asarray(r.uniform(beta_low, beta_high, (B, T, H)), dtype)
  h0 = jnp.asarray(n(B, H, K, V), jnp.float32) if initial else None
  do, dht = jnp.asarray(n(B, T, H, V), jnp.float32), jnp.asarray(n(B, H, K, V), jnp.float32)
  return (q, k, v, g, beta, h0), (do, dht)


def gdn_loss_and_grads(op, inputs, weights):
  """o, final and the gradients of sum(o * do) + sum(final * dht) for every array input
  of ``inputs`` = (q, k, v, g, beta, h0), ``weights`` = (do, dht)."""
  *args, h0 = inputs
  return _state_loss_and_grads(op, args, h0, *weights, ("q", "k", "v", "g", "beta"), {})


def check_gdn_against_float64(op, inputs, weights, fwd_tol=1e-5, grad_tol=1e-4):
  """A Gated DeltaNet op on :func:`gdn_inputs` against ``gdn_float64``: o (v's dtype and
  shape) and the final state within ``fwd_tol``, every gradient within ``grad_tol``."""
  from zeco_jax.ops.gated_delta.reference import gdn_float64
  o64, s64, g64 = gdn_float64(*inputs, *weights)
  o, s, grads = gdn_loss_and_grads(op, inputs, weights)
  assert o.dtype == inputs[2].dtype and o.shape == o64.shape
  assert rel_err(o, o64) <= fwd_tol and rel_err(s, s64) <= fwd_tol
  assert set(grads) == set(g64)
  errs = {nm: rel_err(grads[nm], g64[nm]) for nm in g64}
  assert all(e <= grad_tol for e in errs.values()), errs


def check_gdn_documents(op, inputs, weights, ids, tol=(1e-5, 1e-4)):
  """A Gated DeltaNet op with ``segment_ids=ids`` against ``gdn_float64_documents``."""
  from zeco_jax.ops.gated_delta.reference import gdn_float64_documents
  o64, s64, g64 = gdn_float64_documents(*inputs, *weights, ids)
  o, s, grads = gdn_loss_and_grads(functools.partial(op, segment_ids=jnp.asarray(ids)),
                                   inputs, weights)
  assert rel_err(o, o64) <= tol[0] and rel_err(s, s64) <= tol[0]
  errs = {nm: rel_err(grads[nm], g64[nm]) for nm in g64}
  assert all(e <= tol[1] for e in errs.values()), errs


# T = 64 on 4 ranks of 16 (and 8 of 8): documents spanning ranks, starts on a rank's first
# token (t = 16, 48), inside ranks, padding across the boundary at t = 32.
GDN_SHARD_DOC_IDS = np.array([[0] * 16 + [1] * 10 + [-1] * 12 + [2] * 10 + [3] * 16,
                              [5] * 3 + [6] * 45 + [7] * 16])


# --- Kimi Delta Attention ----------------------------------------------------------------

def kda_log_decay(r, shape, decay):
  """Per-channel log-decays (numpy float64) of ``decay``: ``"mild"`` uniform in (-0.5, 0);
  ``"strong"`` uniform in (-5, 0) (a 64-token chunk sums to about -160 per channel, -320
  at worst); ``"mix"``: 2% at -1e4 (a channel emptied, as a document start empties them
  all), 28% uniform in (-5, -1), the rest log-uniform in [-0.5, -1e-3]."""
  if decay == "mild":
    return r.uniform(-0.5, 0.0, shape)
  if decay == "strong":
    return r.uniform(-5.0, 0.0, shape)
  weak = -np.exp(r.uniform(np.log(1e-3), np.log(0.5), shape))
  u = r.uniform(size=shape)
  return np.where(u < 0.02, -1e4, np.where(u < 0.3, r.uniform(-5.0, -1.0, shape), weak))


def kda_inputs(seed, B, T, H, K, V, *, decay="mix", beta_low=0.05, beta_high=0.9999,
               dtype=jnp.float32, initial=True):
  """Random q, v, l2-normalised k, per-channel log-decay g ``[B, T, H, K]`` float32
  (:func:`kda_log_decay`), beta in (beta_low, beta_high), h0 (or None) and the loss
  weights (do, dht): ``(q, k, v, g, beta, h0), (do, dht)``."""
  from zeco_jax._linalg import l2norm
  r = np.random.default_rng(seed)
  n = lambda *s: r.standard_normal(s)
  q = jnp.asarray(n(B, T, H, K), dtype)
  k = l2norm(jnp.asarray(n(B, T, H, K), jnp.float32)).astype(dtype)
  v = jnp.asarray(n(B, T, H, V), dtype)
  g = jnp.asarray(kda_log_decay(r, (B, T, H, K), decay), jnp.float32)
  beta = jnp.asarray(r.uniform(beta_low, beta_high, (B, T, H)), dtype)
  h0 = jnp.asarray(n(B, H, K, V), jnp.float32) if initial else None
  do, dht = jnp.asarray(n(B, T, H, V), jnp.float32), jnp.asarray(n(B, H, K, V), jnp.float32)
  return (q, k, v, g, beta, h0), (do, dht)


@functools.lru_cache(maxsize=None)
def delta_vjp(op):
  """One jitted ``(q, k, v, g, beta, h0, do, dht, segment_ids) -> (o, final, grads)`` per
  delta-rule op (``op(q, k, v, g, beta, initial_state=, output_final_state=,
  segment_ids=)``), reused across inputs of one shape: o, the final state and the vjp of
  (do, dht), ``{"q", "k", "v", "g", "beta"(, "h0")}``. ``h0`` and ``segment_ids`` may be
  None (then neither reaches the op; a program of its own)."""
  def run(q, k, v, g, beta, h0, do, dht, segment_ids):
    options = {} if segment_ids is None else dict(segment_ids=segment_ids)
    (o, final), pull = jax.vjp(
        lambda q, k, v, g, beta, h0: op(q, k, v, g, beta, initial_state=h0,
                                        output_final_state=True, **options),
        q, k, v, g, beta, h0)
    grads = pull((do.astype(o.dtype), dht))
    return o, final, {n: d for n, d in zip("q k v g beta h0".split(), grads) if d is not None}
  return jax.jit(run)


def check_kda_against_float64(op, inputs, weights, fwd_tol=1e-5, grad_tol=1e-4, ids=None):
  """A KDA op on :func:`kda_inputs` (with ``segment_ids=ids`` if given) against
  ``kda_float64`` (``kda_float64_documents`` with ids), both its truth kept in float64:
  o (v's dtype and shape) and the final state within ``fwd_tol``, every gradient (q, k,
  v, g, beta, and h0 when given) within ``grad_tol``; with ids, zero outputs and q, k, v
  gradients on padding. Returns the errors ``{name: relative norm}``."""
  from zeco_jax.ops.kda.reference import kda_float64, kda_float64_documents
  if ids is None:
    o64, s64, g64 = kda_float64(*inputs, *weights)
  else:
    o64, s64, g64 = kda_float64_documents(*inputs, *weights, ids)
  o, s, grads = delta_vjp(op)(*inputs, *weights, None if ids is None else jnp.asarray(ids))
  assert o.dtype == inputs[2].dtype and o.shape == o64.shape
  assert set(grads) == set(g64), (set(grads), set(g64))
  errors = {"o": rel_err64(o, o64), "final": rel_err64(s, s64)}
  errors.update({"d" + name: rel_err64(grads[name], g64[name]) for name in g64})
  assert_within(errors, fwd_tol, grad_tol)
  if ids is not None:
    pad = np.asarray(ids) < 0
    assert not np.any(np.asarray(o)[pad]), "padding tokens must output zero"
    for name in ("q", "k", "v"):
      assert not np.any(np.asarray(grads[name])[pad]), f"padding must get zero d{name}"
  return errors


def check_kda_documents(op, inputs, weights, ids, fwd_tol=1e-5, grad_tol=1e-4):
  """:func:`check_kda_against_float64` on packed documents ``ids`` (``[B, T]``)."""
  return check_kda_against_float64(op, inputs, weights, fwd_tol, grad_tol, ids=ids)


# --- programs: traced equations, compiled collectives -------------------------------------

COLLECTIVES = ("ppermute", "all_gather")
"""The jaxpr primitives through which a scan method moves states between ranks."""


def sub_jaxprs(eqn):
  """The jaxprs inside one equation's parameters (jit, shard_map, custom_vjp, ...)."""
  for value in eqn.params.values():
    for item in (value if isinstance(value, (tuple, list)) else (value,)):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns"):
        yield inner


def find_eqns(jaxpr, name):
  """Every equation of primitive ``name`` in a (closed) jaxpr, sub-jaxprs included, in
  program order (an equation before those inside it)."""
  out = []
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    if eqn.primitive.name == name:
      out.append(eqn)
    for inner in sub_jaxprs(eqn):
      out += find_eqns(inner, name)
  return out


def assert_fix_up_precision(case):
  """A sequence-parallel fix-up's three GEMMs (its forward's and its backward's two, read
  from the jaxpr of ``jax.grad`` over every argument) are at HIGHEST for float32 inputs
  and at no explicit precision (jax's default) for bf16 ones. ``case(dtype)`` gives the
  scalar function and its arguments for that input dtype."""
  def precisions(dtype):
    f, args = case(dtype)
    jaxpr = jax.make_jaxpr(jax.grad(f, tuple(range(len(args)))))(*args)
    return [str(e.params["precision"]) for e in find_eqns(jaxpr, "dot_general")]

  highest = str(jax.lax.Precision.HIGHEST)
  f32, bf16 = precisions(jnp.float32), precisions(jnp.bfloat16)
  assert len(f32) == len(bf16) == 3
  assert all(highest in p for p in f32) and not any(highest in p for p in bf16)


def communicates(eqn) -> bool:
  """Whether the equation is, or contains, a collective (e.g. the All-Scan's custom_vjp)."""
  return eqn.primitive.name in COLLECTIVES or any(
      communicates(e) for j in sub_jaxprs(eqn) for e in j.eqns)


def collective_operand_shapes(jaxpr):
  """The shapes of every operand a collective moves, sub-jaxprs included."""
  return [tuple(x.aval.shape) for name in COLLECTIVES for eqn in find_eqns(jaxpr, name)
          for x in eqn.invars]


def local_pass_waits_for_the_state(fn, *args, min_collectives=1) -> bool:
  """Whether the chunked local pass of ``fn`` (a custom_vjp call in its first shard_map's
  body that does not itself communicate) takes any input computed from a collective's
  result: False means XLA may run it while the states are in flight. Walks the body in
  program order, tainting every output of a collective and of an equation with a tainted
  input, and goes inside a communicating custom_vjp call (a delta-rule rank's whole
  segment, ``zeco_jax._chunks._segment``) with its inputs' taint; asserts the body has at
  least ``min_collectives`` communicating equations and a local pass."""
  body = find_eqns(jax.make_jaxpr(fn)(*args), "shard_map")[0].params["jaxpr"]
  local_calls, collectives = [], 0

  def walk(jaxpr, tainted):
    nonlocal collectives
    for eqn in jaxpr.eqns:
      ins = [x for x in eqn.invars if isinstance(x, jax.extend.core.Var)]
      moves = communicates(eqn)
      inner = list(sub_jaxprs(eqn))
      if eqn.primitive.name.startswith("custom_vjp") and moves and len(inner) == 1:
        assert len(inner[0].invars) == len(eqn.invars)
        walk(inner[0], {i for i, x in zip(inner[0].invars, eqn.invars) if x in tainted})
        tainted.update(eqn.outvars)
        continue
      if eqn.primitive.name.startswith("custom_vjp") and not moves:
        local_calls.append(any(x in tainted for x in ins))      # the chunked local pass
      if moves or any(x in tainted for x in ins):
        collectives += moves
        tainted.update(eqn.outvars)

  walk(body, set())
  assert collectives >= min_collectives and local_calls, (
      "expected collectives and a chunked local pass", collectives, local_calls)
  return any(local_calls)


def output_sum_grad(op, num_args):
  """``jax.grad`` of sum(op(*args)[0]) w.r.t. its ``num_args`` arguments: the forward and
  the backward in one program, as a training step compiles them."""
  return jax.grad(lambda *a: jnp.sum(op(*a)[0]), argnums=tuple(range(num_args)))


def states_sent(fn, args, num_devices, state_bytes):
  """``{collective kind: [num_devices] array}``: how many states (of ``state_bytes``
  bytes, e.g. one float32 K x V state of every (b, h): B H K V 4) each rank sends in the
  compiled ``jax.jit(fn)`` at ``args`` (arrays or ShapeDtypeStructs), read from the
  compiled HLO by ``zeco_jax.runtime.hlo_stats.collective_bytes``."""
  from zeco_jax.runtime.hlo_stats import collective_bytes
  text = jax.jit(fn).lower(*args).compile().as_text()
  return {kind: sent / state_bytes for kind, sent in collective_bytes(text, num_devices).items()}


def states_sent_per_rank(fn, args, num_devices, state_bytes):
  """:func:`states_sent` summed over the collective kinds: a ``[num_devices]`` array."""
  return sum(states_sent(fn, args, num_devices, state_bytes).values())


# --- the trainer --------------------------------------------------------------------------

# configs/tiny_mqar.py made small enough for tests (a 2-block model, 128-token sequences).
TINY = {
    "model": dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                  intermediate_size=64, chunk_size=16),
    "data": dict(seq_len=128, batch_size=2, num_keys=16, num_pairs=4, num_queries=16,
                 num_segments=4, query_window=24),
    "train": dict(steps=20, warmup_steps=2, lr=3e-3, log_every=5, eval_every=0,
                  eval_batches=1, checkpoint_every=0),
}


def tiny_model_config(**overrides):
  """The TINY model (a 2-block GLA LM) as a ``models.GLAConfig``, with ``overrides``."""
  from models import GLAConfig
  return GLAConfig(**{**TINY["model"], **overrides})


# The trainer's tests (resume, faults, checkpoints, multi-process runs, seq-split
# independence) train TINY with one block: what they check (bit-exact resume, checkpoint
# handling, equal losses across meshes and processes) does not depend on the number of
# blocks, and the blocks are unrolled, so each one more is compiled again in every program.
# (TINY itself, with its 2 blocks, is what tests/models use.)
TRAINER_MODEL = dict(num_layers=1)


def _trainer_tiny():
  return {**TINY, "model": {**TINY["model"], **TRAINER_MODEL}}


def tiny_cfg(**train_overrides):
  """The TINY config (one block: ``TRAINER_MODEL``) as train.py builds it from
  configs/tiny_mqar.py and its overrides."""
  import configs.tiny_mqar
  config = configs.tiny_mqar.get_config()
  for section, fields in _trainer_tiny().items():
    config[section].update(fields)
  config.train.update(train_overrides)
  return config


def tiny_text_cfg(corpus_dir, **train_overrides):
  """configs/text_tiny.py made small: 1 block, BPE of 300 tokens, 4 x 128-token rows on
  data=2 x seq=4, 20 steps checkpointed at 10, with ``train_overrides``."""
  import configs.text_tiny
  config = configs.text_tiny.get_config()
  config.model.update(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64, chunk_size=16)
  config.data.update(path=corpus_dir, seq_len=128, batch_size=4)
  config.mesh = "data=2,seq=4"
  config.train.update(steps=20, warmup_steps=2, log_every=5, eval_every=0, eval_batches=1,
                      checkpoint_every=10)
  config.train.update(train_overrides)
  return config


def tiny_flags(**train_overrides) -> list:
  """The same config as train.py command-line overrides (--config.SECTION.FIELD=VALUE)."""
  fields = {**{f"{s}.{k}": v for s, kv in _trainer_tiny().items() for k, v in kv.items()},
            **{f"train.{k}": v for k, v in train_overrides.items()}}
  return [f"--config.{name}={value}" for name, value in fields.items()]


def run_train_py(*args, timeout=120, env=None):
  """``python train.py ARGS`` in the repository root, output captured as text; ``env``
  adds to this process's environment."""
  return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout,
                        env=None if env is None else dict(os.environ, **env))


CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")


@contextlib.contextmanager
def persistent_compilation_cache(path):
  """JAX's persistent compilation cache in folder ``path`` (every program, however quick
  to compile), the previous settings restored afterwards. A later compile of a program
  already compiled (the same HLO, e.g. a second run of the same training program, or the
  same Pallas kernel traced again) loads it from ``path`` instead; subprocesses share it
  through :func:`persistent_cache_env`."""
  from jax.experimental.compilation_cache import compilation_cache
  before = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
  for name, value in zip(CACHE_OPTIONS, (str(path), 0.0, 0)):
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  try:
    yield str(path)
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()


def persistent_cache_env(path) -> dict:
  """Environment variables that give a subprocess the same persistent compilation cache."""
  return {"JAX_COMPILATION_CACHE_DIR": str(path),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
