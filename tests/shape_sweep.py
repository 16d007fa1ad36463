"""The shape sweep every op family runs (test_*_shapes.py): the shapes users run, against
the family's reference.

T below, at and just past a chunk (1, chunk - 1, chunk, chunk + 1, 3 chunks) with every
(K, V) from 16 to 128 on one device; tokens per shard 1, chunk - 1, chunk, chunk + 1 on a
data=2 x seq=4 mesh; scalar and per-dim decay; jit, and eager for the forward.

Every case starts from a zero state (no ``initial_state``), with gradients taken without
the final state: the zero initial state and the zero final-state cotangent are what
XLA:CPU once saw as constants (``docs/xla_cpu_ynn.md``). The reference is the family's
float64 truth (``gla_float64``, ``gdn_float64``, ``kda_float64``: the token loop and its
hand-written vjp in numpy), so the op's programs are the only ones a test compiles: the
forward alone and the forward with gradients, each holding the test's cases side by side
(:func:`check_cases`). Tolerances (relative norms against the
float64 values): forward 1e-5, gradients 1e-4; a gradient whose reference is exactly zero
(dg at T = 1 from a zero state) must be below 1e-6 of the largest gradient.
"""
import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from helpers import rel_err64

CHUNK = 64
T_VALUES = (1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK)
KV_VALUES = ((16, 16), (64, 64), (128, 128))
# Every T with every (K, V); the decay kind alternates so both meet every T and size.
CASES = [(T, K, V, ("dim", "scalar")[i % 2])
         for i, (T, (K, V)) in enumerate(itertools.product(T_VALUES, KV_VALUES))]
# (tokens per seq shard, K = V) on the mesh: every shard length at K = 64, and 128 once.
SHARD_CASES = [(L, 64) for L in (1, CHUNK - 1, CHUNK, CHUNK + 1)] + [(CHUNK, 128)]


def inputs(seed, B, T, H, K, V, decay):
  r = np.random.default_rng(seed)
  q, k = (jnp.asarray(r.standard_normal((B, T, H, K)), jnp.float32) for _ in range(2))
  v = jnp.asarray(r.standard_normal((B, T, H, V)), jnp.float32)
  g_shape = (B, T, H, K) if decay == "dim" else (B, T, H)
  g = jnp.asarray(np.log(r.uniform(0.6, 1.0, g_shape)), jnp.float32)
  w = jnp.asarray(r.standard_normal((B, T, H, V)), jnp.float32)
  return q, k, v, g, w


def delta_inputs(seed, B, T, H, K, V):
  q, k, v, g, w = inputs(seed, B, T, H, K, V, "scalar")
  beta = jax.nn.sigmoid(jnp.asarray(np.random.default_rng(seed + 7).standard_normal(
      (B, T, H)), jnp.float32))
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  return unit(q), unit(k), v, g, beta, w


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def gla_truth(q, k, v, g, w):
  """``gla_float64`` from a zero state, loss sum(o * w): o and (dq, dk, dv, dg)."""
  from zeco_jax.ops.gla.reference import gla_float64
  B, T, H, K = q.shape
  zero = np.zeros((B, H, K, v.shape[-1]))
  o, _, grads = gla_float64(*map(_f64, (q, k, v, g)), zero, _f64(w), None, K ** -0.5)
  return o, [grads[n] for n in "qkvg"]


def _delta_truth(truth, q, k, v, g, beta, w):
  B, T, H, K = q.shape
  zero = np.zeros((B, H, K, v.shape[-1]))
  o, _, grads = truth(*map(_f64, (q, k, v, g, beta)), None, _f64(w), zero, K ** -0.5)
  return o, [grads[n] for n in ("q", "k", "v", "g", "beta")]


def gdn_truth(q, k, v, g, beta, w):
  """``gdn_float64`` from a zero state, loss sum(o * w): o and (dq, dk, dv, dg, dbeta)."""
  from zeco_jax.ops.gated_delta.reference import gdn_float64
  return _delta_truth(gdn_float64, q, k, v, g, beta, w)


def kda_truth(q, k, v, g, beta, w):
  """``kda_float64`` from a zero state, loss sum(o * w): o and (dq, dk, dv, dg, dbeta)."""
  from zeco_jax.ops.kda.reference import kda_float64
  return _delta_truth(kda_float64, q, k, v, g, beta, w)


def check(op, truth, args, w, what, *, eager=False, mesh=None, tol=1e-4):
  """:func:`check_cases` on one case."""
  check_cases(op, truth, [(args, w, what)], eager=[what] if eager else [], mesh=mesh, tol=tol)


def check_cases(op, truth, cases, *, eager=(), mesh=None, tol=1e-4):
  """``op`` (``(*args) -> o``) against ``truth`` (``(*args, w) -> (o, grads)`` in float64,
  e.g. :func:`gla_truth`) on every case ``(args, w, what)`` of ``cases``: the forward alone
  under jit (a program of its own: XLA fuses it differently from one that also
  differentiates), the forward and gradients of ``sum(o * w)`` in one program, and, for the
  cases whose ``what`` is in ``eager``, the forward op by op. The cases run side by side in
  those two programs (each case's op on its own inputs, nothing shared; the loss is the sum
  of the cases' losses, so each case's gradients are its own): one compilation per
  program instead of one per case. A gradient whose truth is exactly zero (dg at T = 1
  from a zero state) must be below 1e-6 of the largest gradient. With ``mesh``, ``op``
  gets the arrays with B over ``data`` and T over ``seq`` (under ``jax.set_mesh``), the
  truth the unsharded ones."""
  refs = [truth(*args, w) for args, w, _ in cases]
  args_list, w_list = [args for args, _, _ in cases], [w for _, w, _ in cases]
  context = contextlib.nullcontext()
  if mesh is not None:
    args_list = [on_mesh(mesh, *args) for args in args_list]
    w_list = [on_mesh(mesh, w)[0] for w in w_list]
    context = jax.set_mesh(mesh)

  def loss(args_list, w_list):
    outs = [op(*args) for args in args_list]
    return sum(jnp.sum(o * w) for o, w in zip(outs, w_list)), outs

  with context:
    o_jit = jax.jit(lambda args_list: [op(*args) for args in args_list])(args_list)
    (_, outs), grads_list = jax.jit(jax.value_and_grad(loss, has_aux=True))(args_list, w_list)
    o_eager = {what: op(*args) for args, (_, _, what) in zip(args_list, cases)
               if what in eager}
  assert len(o_eager) == len(eager), (list(eager), list(o_eager))
  for (_, _, what), (o_ref, grads_ref), o_j, o, grads in zip(cases, refs, o_jit, outs,
                                                            grads_list):
    assert rel_err64(o_j, o_ref) <= 1e-5, (what, "jit forward")
    assert rel_err64(o, o_ref) <= 1e-5, (what, "forward with the backward")
    if what in o_eager:
      assert rel_err64(o_eager[what], o_ref) <= 1e-5, (what, "eager forward")
    assert len(grads) == len(grads_ref)
    largest = max(float(np.linalg.norm(g)) for g in grads_ref)
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
      if float(np.linalg.norm(g_ref)) == 0.0:
        assert float(jnp.linalg.norm(g)) <= 1e-6 * largest, (what, i)
      else:
        assert rel_err64(g, g_ref) <= tol, (what, i)


def on_mesh(mesh, *arrays):
  """``arrays`` with B over ``data`` and T over ``seq`` (the mesh's Explicit axes)."""
  spec = jax.sharding.PartitionSpec("data", "seq")
  return tuple(jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x in arrays)
