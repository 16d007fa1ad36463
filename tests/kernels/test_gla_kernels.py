"""The GLA Pallas kernels (pallas_kernels/gla, interpret mode on CPU) against the reference
GLA and the jnp path, and what their launch configuration decides.

Tolerances: float32 <= 1e-5 forward, <= 1e-4 gradients; bf16 <= 2e-2. Shapes are tiny
(the interpreter runs every grid point), but cover K != V, K and V of 64/128/256, T not a
multiple of 64, strong decay, scalar and no decay, initial and final states, and every
launch option of ``KernelConfig`` (passed explicitly; nothing module-level is read). The
kernels' stages are checked one by one too (chunk decays, state walks, diagonal blocks),
and the launches traced for an H200 and lowered to Triton and Mosaic on this CPU host.

Every test runs with a persistent compilation cache (the ``compile_cache`` fixture): most
calls here run eagerly, so every pallas_call is traced and compiled on its own, again in
each test or case; one already compiled (the same kernel, launch and shapes: the same HLO)
is loaded from the cache instead.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import abstract_mesh, find_eqns, rel_err
from zeco_jax import chunk_gla, recurrent_gla

pallas_kernels = pytest.importorskip("pallas_kernels")
KernelConfig = pallas_kernels.KernelConfig
pytestmark = pytest.mark.usefixtures("compile_cache")


def _strong_odd_subchunks(g, columns=None):
  """g ``[1, 128, H, K]`` (mild) with the second 64-token chunk's odd 16-token sub-chunks
  decaying by about -20 per token (on K columns below ``columns`` only, if given): past
  DIAG_DOT_SPAN, so those blocks take the exact loops and the others the dots."""
  t = jnp.arange(g.shape[1])[:, None]
  c = jnp.arange(g.shape[-1])[None, :]
  strong = (t // 16 % 2 == 1) & (t >= 64) & (c < (g.shape[-1] if columns is None else columns))
  return jnp.where(strong[None, :, None, :], 320.0 * g - 1.0, g)


def _config(q, v, **overrides):
  """The CPU (interpreter) default for q's and v's shape, with ``overrides``."""
  B, T, H, K = q.shape
  return pallas_kernels.default_config("cpu", B, T, H, K, v.shape[-1], q.dtype).replace(
      **overrides)


def _inputs(seed, B, T, H, K, V, *, decay="strong", dtype=jnp.float32):
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  q = jax.random.normal(keys[0], (B, T, H, K), jnp.float32)
  k = jax.random.normal(keys[1], (B, T, H, K), jnp.float32)
  v = jax.random.normal(keys[2], (B, T, H, V), jnp.float32)
  x = jax.random.normal(keys[3], (B, T, H, K), jnp.float32)
  if decay == "strong":     # up to ~ -9 per token: exp(-b) overflows inside one chunk
    g = 4.0 * jax.nn.log_sigmoid(x) - 3.0 * jax.random.uniform(keys[4], x.shape)
  elif decay == "mild":     # the benchmark's logsigmoid / 16
    g = jax.nn.log_sigmoid(x) / 16
  elif decay == "scalar":
    g = jax.nn.log_sigmoid(x[..., 0]) * 2.0
  else:
    g = None
  h0 = jax.random.normal(keys[5], (B, H, K, V), jnp.float32)
  cast = lambda a: a.astype(dtype)
  return cast(q), cast(k), cast(v), g, h0, keys[6]


def _loss_terms(fn, q, k, v, g, h0, key):
  """Forward (o, final) and the vjp of a random cotangent w.r.t. q, k, v, g, h0."""
  def f(q, k, v, g, h0):
    return fn(q, k, v, g, initial_state=h0, output_final_state=True)

  (o, final), vjp = jax.vjp(f, q, k, v, g, h0)
  kd, kf = jax.random.split(key)
  do = jax.random.normal(kd, o.shape, jnp.float32).astype(o.dtype)
  dfinal = jax.random.normal(kf, final.shape, jnp.float32)
  return o, final, vjp((do, dfinal))


def _assert_terms_match(got, want, fwd_tol=1e-5, grad_tol=1e-4):
  """Two (o, final, (dq, dk, dv, dg, dh0)) of :func:`_loss_terms` or :func:`_backend_terms`
  agree: o and the final state within ``fwd_tol``, every gradient the reference has finite
  and within ``grad_tol``."""
  (o, fin, grads), (o_r, fin_r, grads_r) = got, want
  assert rel_err(o, o_r) <= fwd_tol
  assert rel_err(fin, fin_r) <= fwd_tol
  for name, a, b in zip(("dq", "dk", "dv", "dg", "dh0"), grads, grads_r):
    if b is None:
      continue
    assert np.all(np.isfinite(np.asarray(a))), name
    assert rel_err(a, b) <= grad_tol, (name, rel_err(a, b))


def _pallas(q, k, v, g, **kw):
  return chunk_gla(q, k, v, g, backend="pallas", **kw)


def _reference(q, k, v, g, **kw):
  return recurrent_gla(q, k, v, g, **kw)


@pytest.mark.parametrize("B,T,H,K,V,decay", [
    (1, 100, 1, 64, 128, "strong"),     # T not a multiple of 64, K != V
    (1, 80, 1, 128, 64, "strong"),
    (1, 64, 1, 256, 256, "mild"),
    (1, 48, 1, 64, 64, "scalar"),
    (1, 40, 1, 64, 64, None),
])
def test_pallas_float32_matches_reference(B, T, H, K, V, decay):
  q, k, v, g, h0, key = _inputs(0, B, T, H, K, V, decay=decay)
  _assert_terms_match(_loss_terms(_pallas, q, k, v, g, h0, key),
                      _loss_terms(_reference, q, k, v, g, h0, key))


@pytest.mark.parametrize("overrides", [{}, {"states_in_input_dtype": False,
                                            "fuse_state_passes": False},
                                       {"diag_dots": False, "save_states": False}])
def test_pallas_bf16_matches_reference(overrides):
  q, k, v, g, h0, key = _inputs(1, 1, 96, 2, 64, 128, decay="mild", dtype=jnp.bfloat16)
  config = _config(q, v, **overrides)
  got = _loss_terms(lambda *a, **kw: _pallas(*a, kernel_config=config, **kw),
                    q, k, v, g, h0, key)
  f32 = lambda a: a.astype(jnp.float32)
  assert got[0].dtype == jnp.bfloat16
  _assert_terms_match(got, _loss_terms(_reference, f32(q), f32(k), f32(v), g, h0, key),
                      2e-2, 2e-2)


def test_backend_per_platform_and_defaults():
  """backend(family, platform) picks the kernel module, a ChunkKernels; the CPU default
  interprets, the GPU and TPU defaults compile; a CPU config that does not interpret is
  refused."""
  from pallas_kernels.gla import gpu, tpu
  assert pallas_kernels.backend("gla", "gpu") is gpu
  assert pallas_kernels.backend("gla", "cpu") is gpu
  assert pallas_kernels.backend("gla", "tpu") is tpu
  assert all(isinstance(m, pallas_kernels.ChunkKernels) for m in (gpu, tpu))
  with pytest.raises(ValueError, match="platform"):
    pallas_kernels.backend("gla", "cuda")
  with pytest.raises(ValueError, match="no kernels for family 'mamba'"):
    pallas_kernels.backend("mamba", "gpu")
  shape = (1, 64, 1, 64, 64, jnp.float32)
  assert pallas_kernels.default_config("cpu", *shape).interpret
  assert not pallas_kernels.default_config("gpu", *shape).interpret
  assert not pallas_kernels.default_config("tpu", *shape).interpret
  with pytest.raises(ValueError, match="interpret=True"):
    KernelConfig(platform="cpu", interpret=False)
  with pytest.raises(ValueError, match="`bv` must be a positive int"):
    KernelConfig().replace(out_bv=0)
  with pytest.raises(ValueError, match="unknown setting 'out_kd'"):
    KernelConfig().replace(out_kd=32)
  with pytest.raises(ValueError, match="stage `out` needs bv"):
    KernelConfig(out=pallas_kernels.Launch(bk=64, warps=4, stages=3))
  assert KernelConfig().replace(out_warps=8).out.warps == 8
  with pytest.raises(ValueError, match="fuse_state_passes"):
    KernelConfig(fuse_state_passes=1)
  assert hash(KernelConfig()) == hash(KernelConfig())      # a static (hashable) argument


def test_rejects_non_power_of_two_dims():
  q, k, v, g, h0, _ = _inputs(0, 1, 32, 1, 48, 64)
  with pytest.raises(ValueError, match="power of two"):
    chunk_gla(q, k, v, g, backend="pallas")


# --- Mosaic TPU variant (interpret mode here; never run on TPU hardware) ----------------

def _backend_terms(be, q, k, v, g, h0, key, C, config=None, call=None):
  """``be``'s forward (o, final) and backward at a random (do, dht); each through
  ``call(fn, *args, **kw)`` if given (e.g. :func:`_jitted`)."""
  B, T, H, K = q.shape
  kd, kf = jax.random.split(key)
  do = jax.random.normal(kd, v.shape, jnp.float32).astype(v.dtype)
  dht = jax.random.normal(kf, h0.shape, jnp.float32)
  kw = dict(scale=K ** -0.5, initial_state=h0, chunk_size=C)
  if config is not None:
    kw["config"] = config
  call = call or (lambda fn, *a, **kw: fn(*a, **kw))
  o, fin = call(be.fwd, q, k, v, g, **kw)
  return o, fin, call(be.bwd, q, k, v, g, do, dht, **kw)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("scale", "chunk_size", "config"))
def _jitted(fn, *args, **kw):
  """``fn(*args, **kw)`` compiled once per (fn, scale, chunk_size, config, shapes): calls
  of the same kernels on the same shapes (parametrized cases that differ only in values)
  reuse the program instead of tracing and compiling every pallas_call again, eagerly.
  The jnp path's forward and backward, the references, run through it too: one program
  each instead of a hundred one-op programs."""
  return fn(*args, **kw)


@pytest.mark.parametrize("B,T,H,K,V,decay,dtype", [
    (1, 128, 1, 64, 128, "strong", jnp.float32),
    (1, 64, 1, 128, 64, "scalar", jnp.bfloat16),
])
def test_tpu_variant_matches_jnp_path(B, T, H, K, V, decay, dtype):
  from pallas_kernels.gla import tpu as tpu_backend
  from zeco_jax.ops.gla import chunked
  q, k, v, g, h0, key = _inputs(2, B, T, H, K, V, decay=decay, dtype=dtype)
  config = KernelConfig(platform="tpu", interpret=True)
  f32 = lambda a: a.astype(jnp.float32)
  _assert_terms_match(_backend_terms(tpu_backend, q, k, v, g, h0, key, 64, config),
                      _backend_terms(chunked, f32(q), f32(k), f32(v), g, h0, key, 64,
                                     call=_jitted),
                      *((1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 2e-2)))


def test_tpu_variant_lowers_to_mosaic(monkeypatch):
  """jax-side lowering to Mosaic TPU (catches unsupported primitives); libtpu not involved."""
  tpu_info = pytest.importorskip("jax._src.tpu_info")
  monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
  monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
  from pallas_kernels.gla import tpu as tpu_backend
  B, T, H, K, V = 1, 128, 1, 128, 128
  sd = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  args = (sd((B, T, H, K), bf), sd((B, T, H, K), bf), sd((B, T, H, V), bf), sd((B, T, H, K), f32),
          sd((B, T, H, V), bf), sd((B, H, K, V), f32), sd((B, H, K, V), f32))

  def both(q, k, v, g, do, dht, h0):
    kw = dict(scale=0.1, initial_state=h0, chunk_size=64,
              config=pallas_kernels.default_config("tpu", B, T, H, K, V, bf))
    return tpu_backend.fwd(q, k, v, g, **kw), tpu_backend.bwd(q, k, v, g, do, dht, **kw)

  text = jax.jit(both).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text


@pytest.mark.parametrize("kept,overrides", [
    (False, {"states_in_input_dtype": False, "state_bk": 32, "state_bv": 32,
             "state_both_bv": 32, "scores_kd": 32, "dqdk_bk": 16, "cumsum_kd": 32,
             "out_bv": 64, "dv_bv": 64, "diag_kd": 64, "dqdk_diag_bk": 32}),
    (True, {"fuse_state_passes": False, "save_states": False, "state_bv": 64, "out_bk": 32,
            "dv_bk": 32, "dqdk_bv": 32, "scores_kd": 16}),
    (True, {"diag_dots": False}),   # the separate exact scores kernel
    (True, {}),                     # the defaults; strong decay: every diagonal as loops
])
def test_gpu_launch_options_keep_results(kept, overrides):
  """Launch options the benchmark sweeps (float32 states, other tiles, the state walks in
  separate launches) compute the same function, both in the recomputing backward
  (``bwd``) and through ``fwd_res`` / ``bwd_res`` (what chunk_gla uses) with the
  forward's A kept, and its states h too unless ``save_states`` is off."""
  from zeco_jax.ops.gla import chunked
  q, k, v, g, h0, key = _inputs(3, 1, 128, 1, 64, 128, decay="strong")
  config = _config(q, v, **overrides)
  be = pallas_kernels.backend("gla", "cpu")
  if kept:      # fwd / bwd through the residual pair
    res, impl = {}, be

    def fwd(*a, **kw):
      out, res["A"] = impl.fwd_res(*a, **kw)
      return out

    be = types.SimpleNamespace(fwd=fwd, bwd=lambda *a, **kw: impl.bwd_res(res["A"], *a, **kw))
  _assert_terms_match(_backend_terms(be, q, k, v, g, h0, key, 64, config),
                      _backend_terms(chunked, q, k, v, g, h0, key, 64, call=_jitted))


@pytest.mark.parametrize("decay", ["mild", "mixed", "columns"])
def test_diagonal_blocks_as_dots(decay):
  """The 16 x 16 diagonal blocks as dots where a K column's sub-chunk totals fit
  DIAG_DOT_SPAN, the exact loops elsewhere: the scores (``diag_dots``, the default)
  inside ``gla_scores``, dq / dk inside ``gla_dqdk`` with ``gla_dqdk_diag``'s loops on the
  other columns. "mild": every block fits; "mixed": the second chunk's odd sub-chunks
  decay by about -20 per token, so that chunk's scores take the column loop and its
  tiles the dq / dk loops; "columns": the same on K columns 0-15 only, so tiles mix
  accepted and rejected columns. float32 against the jnp path; the scores within rounding
  of (not equal to) the loops (``diag_dots`` off), so the dots ran; dq / dk the same when
  ``gla_dqdk`` is handed NaN partials, except on the rejected columns (NaN there): the
  partials are read where the loops ran and nowhere else. With "columns", ``gla_dqdk``'s
  K tile also larger and smaller than ``gla_dqdk_diag``'s (two more launches of those two
  kernels on the same operands, the other stages unchanged): dq, dk, dg within 1e-5 of
  the default tiles' (which the whole backward holds to the jnp path), and the same NaN
  check."""
  from pallas_kernels.gla import grads, intra, state
  from zeco_jax.ops.gla import chunked
  q, k, v, g, h0, key = _inputs(9, 1, 128, 1, 64, 64, decay="mild")
  if decay != "mild":
    g = _strong_odd_subchunks(g, columns=16 if decay == "columns" else None)
  config = _config(q, v)
  assert config.diag_dots
  _assert_terms_match(_backend_terms(pallas_kernels.backend("gla", "cpu"), q, k, v, g, h0, key,
                                     64, config, call=_jitted),
                      _backend_terms(chunked, q, k, v, g, h0, key, 64, call=_jitted))
  kw = dict(chunk_size=64, config=config)
  p, s = _jitted(state.chunk_cumsum, g, **kw)
  d = _jitted(state.chunk_decays, g, q, k, **kw)
  A0, A1 = (_jitted(intra.scores, d, q, k, g, chunk_size=64, config=c)
            for c in (_config(q, v, diag_dots=False), config))
  assert rel_err(A1, A0) <= 1e-6 and not np.array_equal(A1, A0)
  h, _ = _jitted(state.state_pass, k, v, p, s, h0, **kw)
  dH, _ = _jitted(state.state_grad_pass, q, v, p, h0, scale=0.125, **kw)
  do = jax.random.normal(key, v.shape)
  args = (q, k, v, g, p, s, do, h, dH)
  nan = jnp.full(q.shape, jnp.nan)
  rejected = np.zeros(q.shape, bool)
  if decay != "mild":
    rejected = np.asarray(_strong_odd_subchunks(jnp.zeros_like(g), columns=16 if
                                                decay == "columns" else None) != 0)
    rejected = np.broadcast_to(rejected.reshape(1, 2, 64, 1, 64).any(axis=2, keepdims=True),
                               (1, 2, 64, 1, 64)).reshape(q.shape)
  default = _jitted(grads.dqdk, *args, scale=0.125, **kw)
  # gla_dqdk's K tile equal to gla_dqdk_diag's (the default), larger and smaller.
  tilings = [{}] + ([{"dqdk_bk": 64, "dqdk_diag_bk": 16}, {"dqdk_bk": 16, "dqdk_diag_bk": 64}]
                    if decay == "columns" else [])
  for tiling in tilings:
    tiled = dict(chunk_size=64, config=_config(q, v, **tiling))
    dq, dk, dg = _jitted(grads.dqdk, *args, scale=0.125, **tiled)
    for name, a, b in zip(("dq", "dk", "dg"), (dq, dk, dg), default):
      assert rel_err(a, b) <= 1e-5, (tiling, name, rel_err(a, b))
    dq_n, dk_n, _ = _jitted(grads.dqdk, *args, scale=0.125, diag=(nan, nan), **tiled)
    for a, b in ((dq, dq_n), (dk, dk_n)):
      assert np.all(np.isnan(np.asarray(b)[rejected])), tiling
      assert np.array_equal(np.asarray(a)[~rejected], np.asarray(b)[~rejected]), tiling


def test_whole_chunk_dots_where_the_chunk_total_fits():
  """``gla_dqdk`` and ``gla_scores`` take one dot per direction over a chunk's K tile
  whose every column has a chunk total >= -16 (``_common.chunk_fits``), the sub-chunk
  dots elsewhere. Chunk 0 decays mildly (the whole-chunk dots); chunk 1 by -0.4 a token
  (total -25.6, each sub-chunk -6.4: the sub-chunk dots, diagonal included, no loops).
  Both against the jnp path (float32, relative norms: 1e-5 forward, 1e-4 gradients).
  Which path ran: dq / dk given NaN for s (which only the sub-chunk path reads) are the
  same on chunk 0 and NaN on chunk 1 (past dq's first sub-chunk, which reads no s); the
  scores given NaN for ``k e^{s}`` likewise below the diagonal blocks."""
  from pallas_kernels.gla import grads, intra, state
  from zeco_jax.ops.gla import chunked
  q, k, v, g, h0, key = _inputs(11, 1, 128, 1, 64, 64, decay="mild")
  g = g.at[:, 64:].set(-0.4 + 0.01 * g[:, 64:])
  config = _config(q, v)
  _assert_terms_match(_backend_terms(pallas_kernels.backend("gla", "cpu"), q, k, v, g, h0, key,
                                     64, config, call=_jitted),
                      _backend_terms(chunked, q, k, v, g, h0, key, 64, call=_jitted))
  kw = dict(chunk_size=64, config=config)
  p, s = _jitted(state.chunk_cumsum, g, **kw)
  h, _ = _jitted(state.state_pass, k, v, p, s, h0, **kw)
  dH, _ = _jitted(state.state_grad_pass, q, v, p, h0, scale=0.125, **kw)
  do = jax.random.normal(key, v.shape)
  nan = jnp.full(q.shape, jnp.nan)
  whole = lambda a: np.asarray(a)[:, :64]
  split = lambda a: np.asarray(a)[:, 64:]
  for out, out_n in zip(_jitted(grads.dqdk, q, k, v, g, p, s, do, h, dH, scale=0.125, **kw),
                        _jitted(grads.dqdk, q, k, v, g, p, nan, do, h, dH, scale=0.125, **kw)):
    assert np.array_equal(whole(out), whole(out_n)) and np.all(np.isfinite(whole(out)))
    assert np.all(np.isnan(split(out_n)[:, 16:]))    # (dq's first sub-chunk reads no s)
  d = _jitted(state.chunk_decays, g, q, k, **kw)
  A = _jitted(intra.scores, d, q, k, g, **kw)
  A_n = _jitted(intra.scores, d._replace(ks=nan.astype(d.ks.dtype)), q, k, g, **kw)
  assert np.array_equal(np.asarray(A)[:, :, 0], np.asarray(A_n)[:, :, 0])
  assert np.all(np.isnan(np.asarray(A_n)[0, 0, 1][np.tril(np.ones((64, 64), bool), -16)]))


@pytest.mark.parametrize("overrides", [{}, {"diag_dots": False, "save_states": False}])
def test_kernels_lower_to_triton_for_a_gpu_target(overrides):
  """Every GPU kernel of the forward and backward lowers through Pallas's Triton lowering
  for an H200 target on this CPU host (an abstract device): what the interpreter tests
  do not check (e.g. that Triton takes each kernel's control flow and reductions). The
  folded gradient walk's cumsum replaces the backward's only where the states are kept."""
  mesh = abstract_mesh("gpu", "NVIDIA H200", 132)
  from pallas_kernels.gla import gpu as triton_backend
  B, T, H, K, V = 1, 256, 2, 128, 128
  config = pallas_kernels.default_config("gpu", B, T, H, K, V, jnp.bfloat16).replace(
      **overrides)
  kw = dict(scale=K ** -0.5, initial_state=jnp.zeros((B, H, K, V)), chunk_size=64,
            config=config)

  def fwd_bwd(q, k, v, g, do):
    (o, _), A = triton_backend.fwd_res(q, k, v, g, **kw)
    return o, triton_backend.bwd_res(A, q, k, v, g, do, jnp.zeros((B, H, K, V)), **kw)

  sd = jax.ShapeDtypeStruct
  args = [sd((B, T, H, K), jnp.bfloat16)] * 2 + [sd((B, T, H, V), jnp.bfloat16),
                                                 sd((B, T, H, K), jnp.float32),
                                                 sd((B, T, H, V), jnp.bfloat16)]
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  names = ("gla_chunk_decays", "gla_state_pass", "gla_scores", "gla_output",
           "gla_chunk_cumsum", "gla_dv", "gla_dqdk")
  assert all(name in text for name in names)
  # The backward's walks: the gradient walk alone when the forward's states are kept.
  assert ("gla_state_grad_pass" in text) == config.save_states
  assert ("gla_state_passes" in text) != config.save_states
  assert ("gla_chunk_cumsum_fold" in text) == config.save_states     # over qd, dl
  assert bool(re.search(r"gla_chunk_cumsum\b", text)) != config.save_states   # unfolded
  assert "gla_dqdk_diag" in text
  assert ("gla_scores_diag" in text) != config.diag_dots     # else inside gla_scores


def test_state_storage_dtype():
  """The chunk states h[n] are stored in the input dtype (bf16 for bf16 inputs) with
  ``states_in_input_dtype`` (the default), in float32 without; the scores A kept for the
  backward are float32; the states are kept for it with ``save_states`` (the default; in
  the storage dtype, the recomputing walk's), not without. The dtypes and shapes are
  traced (``jax.eval_shape``); the kept states' values are compared with the walk's."""
  from pallas_kernels.gla import state
  q, k, v, g, h0, _ = _inputs(4, 1, 64, 1, 64, 64, decay="mild")

  def states(k, v, config):
    p, s = state.chunk_cumsum(g, chunk_size=64, config=config)
    return state.state_pass(k, v, p, s, h0, chunk_size=64, config=config)[0]

  for dtype, stored in ((jnp.bfloat16, True), (jnp.float32, True), (jnp.bfloat16, False)):
    cast = lambda a: a.astype(dtype)
    config = _config(cast(q), v, states_in_input_dtype=stored)
    h = jax.eval_shape(functools.partial(states, config=config), cast(k), cast(v))
    assert h.shape == (1, 1, 1, 64, 64) and h.dtype == (dtype if stored else jnp.float32)
  fwd_res = functools.partial(pallas_kernels.backend("gla", "cpu").fwd_res, q, k, v, g, scale=0.125,
                              initial_state=h0, chunk_size=64)
  _, res = jax.eval_shape(lambda: fwd_res(config=_config(q, v, save_states=False)))
  assert res.A.dtype == jnp.float32 and res.h is None
  config = _config(q, v)
  _, res = fwd_res(config=config)
  p, s = state.chunk_cumsum(g, chunk_size=64, config=config)
  h, _ = state.state_pass(k, v, p, s, h0, chunk_size=64, config=config)
  assert res.A.dtype == jnp.float32 and res.h.dtype == jnp.float32 and res.h.shape == h.shape
  assert rel_err(res.h, h) <= 1e-5 and float(jnp.max(jnp.abs(h))) > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunk_decays_folds_the_decay_into_q_and_k(dtype):
  """The forward's chunk_decays: qp = q e^{p}, ks = k e^{s}, kn = k e^{-max(p, -16)}, kd
  = k e^{b_last - bc} in the input dtype, the sub-chunk totals and dl = e^{b_last}
  against float64 numpy (two chunks; p, s, bc formed in float64 from g; one sub-chunk
  decays past -16 so that kn's clamp is exercised, the rest mildly, so that e^{b_last}
  does not underflow); and the walk over kd, dl gives state_pass's states (the
  backward's walk)."""
  from pallas_kernels.gla import state
  q, k, v, g, h0, _ = _inputs(8, 1, 128, 2, 64, 32, decay="mild")
  g = jnp.where((jnp.arange(128) // 16 == 5)[None, :, None, None], 40.0 * g - 1.0, g)
  q, k, v = (a.astype(dtype) for a in (q, k, v))
  config = _config(q, v)
  d = state.chunk_decays(g, q, k, chunk_size=64, config=config)
  assert d.qp.dtype == d.ks.dtype == d.kn.dtype == d.kd.dtype == dtype
  assert d.dl.shape == (1, 2, 2, 64) and d.tots.shape == (1, 2, 2, 4, 64)
  f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
  g64 = f64(g).reshape(1, 2, 4, 16, 2, 64)                   # [B, N, L, 16, H, K]
  p = np.cumsum(g64, axis=3)
  s = p[:, :, :, -1:] - p
  gc = np.cumsum(g64.reshape(1, 2, 64, 2, 64), axis=2)       # bc
  last = gc[:, :, -1:]
  shape = lambda a: a.reshape(q.shape)
  assert np.min(p) < -16                                     # the clamp is exercised
  tol = 1e-6 if dtype == jnp.float32 else 8e-3               # bf16: one rounding
  assert rel_err(f64(d.qp), f64(q) * np.exp(shape(p))) <= tol
  assert rel_err(f64(d.ks), f64(k) * np.exp(shape(s))) <= tol
  assert rel_err(f64(d.kn), f64(k) * np.exp(-np.maximum(shape(p), -16.0))) <= tol
  assert rel_err(f64(d.kd), f64(k) * np.exp(shape(last - gc))) <= tol
  assert rel_err(f64(d.tots), p[:, :, :, -1].transpose(0, 3, 1, 2, 4)) <= 1e-6
  assert rel_err(f64(d.dl), np.exp(last[:, :, 0]).transpose(0, 2, 1, 3)) <= 1e-6
  ps, ss = state.chunk_cumsum(g, chunk_size=64, config=config)
  assert rel_err(ps, shape(p)) <= 1e-6 and rel_err(ss, shape(s)) <= 1e-5
  h1, f1 = state.folded_state_pass(d.kd, v, d.dl, h0, chunk_size=64, config=config)
  h2, f2 = state.state_pass(k, v, ps, ss, h0, chunk_size=64, config=config)
  assert rel_err(h1, h2) <= 1e-6 and rel_err(f1, f2) <= 1e-6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunk_cumsum_folded_for_the_gradient_walk(dtype):
  """The backward's chunk_cumsum_folded (with ``save_states``): p and s as chunk_cumsum's,
  qd = scale q e^{bc} in q's dtype and dl = e^{b_last} against float64 numpy (the inputs
  of test_chunk_decays_folds_the_decay_into_q_and_k); and the gradient walk over qd, dl
  gives state_grad_pass's dH and dh0 (both walks dot the same operands)."""
  from pallas_kernels.gla import state
  q, _, do, g, dht, _ = _inputs(8, 1, 128, 2, 64, 32, decay="mild")
  g = jnp.where((jnp.arange(128) // 16 == 5)[None, :, None, None], 40.0 * g - 1.0, g)
  q, do = q.astype(dtype), do.astype(dtype)
  config = _config(q, do)
  kw = dict(chunk_size=64, config=config)
  p, s, qd, dl = state.chunk_cumsum_folded(g, q, scale=0.125, **kw)
  assert qd.dtype == dtype and dl.shape == (1, 2, 2, 64) and dl.dtype == jnp.float32
  ps, ss = state.chunk_cumsum(g, **kw)
  assert np.array_equal(p, ps) and np.array_equal(s, ss)
  f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
  gc = np.cumsum(f64(g).reshape(1, 2, 64, 2, 64), axis=2)    # bc, [B, N, C, H, K]
  tol = 1e-6 if dtype == jnp.float32 else 8e-3               # bf16: one rounding
  assert rel_err(f64(qd), 0.125 * f64(q) * np.exp(gc.reshape(q.shape))) <= tol
  assert rel_err(f64(dl), np.exp(gc[:, :, -1]).transpose(0, 2, 1, 3)) <= 1e-6
  dH1, dh01 = state.folded_state_grad_pass(qd, do, dl, dht, **kw)
  dH2, dh02 = state.state_grad_pass(q, do, ps, dht, scale=0.125, **kw)
  assert dH1.dtype == dH2.dtype
  assert rel_err(dH1, dH2) <= 1e-5 and rel_err(dh01, dh02) <= 1e-5


@pytest.mark.parametrize("decay", ["mild", "mixed"])
def test_forward_from_folded_operands(decay):
  """The forward from chunk_decays' folded operands (scores through e^{totals} rows, the
  diagonal dots through kn, the loops where a chunk does not fit; the output forming q
  e^{bc} from q e^{p}), with and without ``diag_dots``: against the jnp path in float32,
  and A against float64 numpy (chunk-cumulative exponents formed in float64)."""
  from zeco_jax.ops.gla import chunked
  q, k, v, g, h0, key = _inputs(9, 1, 128, 1, 64, 64, decay="mild")
  if decay == "mixed":
    g = _strong_odd_subchunks(g)
  be = pallas_kernels.backend("gla", "cpu")
  kw = dict(scale=0.125, initial_state=h0, chunk_size=64)
  o_r, fin_r = _jitted(chunked.fwd, q, k, v, g, **kw)
  c64 = lambda a: np.asarray(a, np.float64).reshape(2, 64, 64)          # [N, C, K], H = 1
  gc = np.cumsum(c64(g), axis=1)
  A_r = np.einsum("nrk,nik,nrik->nri", c64(q), c64(k),
                  np.exp(np.minimum(gc[:, :, None] - gc[:, None], 0.0)))
  A_r = np.tril(A_r)[None, None]                                        # [B, H, N, C, C]
  for diag_dots in (True, False):
    config = _config(q, v, diag_dots=diag_dots)
    (o, fin), res = be.fwd_res(q, k, v, g, config=config, **kw)
    assert rel_err(o, o_r) <= 1e-5 and rel_err(fin, fin_r) <= 1e-5
    assert rel_err(res.A, A_r) <= 1e-5, rel_err(res.A, A_r)


def test_walk_tiles_target_one_program_per_sm():
  """State-walk tiles of the default config: about one program per SM for the launch (the
  benchmark shapes on a 132-SM GPU; 132 when the SM count is unknown), set explicitly in
  the config (a walk alone, and both walks in one launch), and honoured by the walks."""
  from pallas_kernels.gla import state
  cfg = lambda B, H, K, V, **kw: pallas_kernels.default_config("gpu", B, 64, H, K, V,
                                                               jnp.bfloat16, **kw)
  tiles = lambda c: (c.state.bk, c.state.bv, c.state.both_bv)
  assert tiles(cfg(1, 16, 128, 128, sm_count=132)) == (64, 32, 64)   # 128, 2 x 64 programs
  assert tiles(cfg(8, 4, 128, 256, sm_count=132)) == (64, 128, 128)  # 128, 2 x 128
  assert tiles(cfg(1, 16, 128, 128)) == (64, 32, 64)                 # unknown: 132
  assert tiles(cfg(1, 1, 64, 16, sm_count=132)) == (64, 16, 16)      # V below 32
  assert tiles(cfg(1, 16, 128, 128, sm_count=16)) == (64, 128, 128)  # a small GPU
  k = jax.ShapeDtypeStruct((1, 64, 16, 128), jnp.bfloat16)
  config = cfg(1, 16, 128, 128).replace(state_bv=64, state_both_bv=128)
  assert state.walk_params(k, k, chunk_size=64, config=config)[0] == (1, 16, 2, 2)
  assert state.walk_params(k, k, chunk_size=64, config=config, both=True)[0] == (1, 16, 2, 1)


def test_one_jitted_function_two_configs_two_kernels():
  """One jitted chunk_gla called with two kernel configurations compiles two programs
  with different pallas_call launches (the config is a static argument, part of the jit
  cache key: nothing module-level decides the kernels), and both agree with the
  reference."""
  q, k, v, g, h0, _ = _inputs(5, 1, 64, 1, 64, 128, decay="strong")
  f = jax.jit(chunk_gla, static_argnames=("kernel_config", "backend"))
  first = _config(q, v)
  second = first.replace(out_bv=64, scores_kd=32)
  grids = []
  for config in (first, second):
    jaxpr = str(jax.make_jaxpr(lambda *a: f(*a, backend="pallas", kernel_config=config))(
        q, k, v, g))
    grids.append([line.split("grid=")[1].split(",")[:4] for line in jaxpr.splitlines()
                  if "grid_mapping=" in line])
  assert grids[0] != grids[1], grids
  o_r, _ = recurrent_gla(q, k, v, g)
  assert f._cache_size() == 0
  o1, _ = f(q, k, v, g, backend="pallas", kernel_config=first)
  assert f._cache_size() == 1
  o2, _ = f(q, k, v, g, backend="pallas", kernel_config=second)
  assert f._cache_size() == 2          # the second config did not reuse the first's program
  f(q, k, v, g, backend="pallas", kernel_config=first)
  assert f._cache_size() == 2
  assert rel_err(o1, o_r) <= 1e-5 and rel_err(o2, o_r) <= 1e-5
  from pallas_kernels.gla import _common
  assert not hasattr(_common, "TUNE")


def test_kernel_config_type_is_checked():
  q, k, v, g, _, _ = _inputs(6, 1, 32, 1, 64, 64)
  with pytest.raises(ValueError, match="kernel_config.*default_config"):
    chunk_gla(q, k, v, g, backend="pallas", kernel_config={"out_bv": 64})


# The Triton launches of the default configuration at the two benchmark shapes on an
# H200 (132 SMs): (kernel, grid, num_warps, num_stages) of forward + backward, in order.
# The figures in docs/kernels.md were measured with exactly these.
_H200_LAUNCHES = {
    (1, 16384, 16, 128, 128): [
        ("gla_chunk_decays", (1, 16, 256, 1), 4, 1), ("gla_state_pass", (1, 16, 2, 4), 4, 3),
        ("gla_scores", (1, 16, 256), 4, 1),
        ("gla_output", (1, 16, 256, 1), 4, 3),
        ("gla_chunk_cumsum_fold", (1, 16, 256, 2), 4, 1),
        ("gla_state_grad_pass", (1, 16, 2, 4), 4, 3),
        ("gla_dv", (1, 16, 256, 1), 4, 2), ("gla_dqdk_diag", (1, 16, 256, 4, 2), 2, 1),
        ("gla_dqdk", (1, 16, 256, 4), 4, 3)],
    (8, 4096, 4, 128, 256): [
        ("gla_chunk_decays", (8, 4, 64, 1), 4, 1), ("gla_state_pass", (8, 4, 2, 2), 4, 3),
        ("gla_scores", (8, 4, 64), 4, 1),
        ("gla_output", (8, 4, 64, 2), 4, 3), ("gla_chunk_cumsum_fold", (8, 4, 64, 2), 4, 1),
        ("gla_state_grad_pass", (8, 4, 2, 2), 4, 3),
        ("gla_dv", (8, 4, 64, 2), 4, 2), ("gla_dqdk_diag", (8, 4, 64, 4, 2), 2, 1),
        ("gla_dqdk", (8, 4, 64, 4), 4, 3)],
}


def _launches(jaxpr):
  """(name, grid, num_warps, num_stages) of every pallas_call in a (closed) jaxpr."""
  out = []
  for eqn in find_eqns(jaxpr, "pallas_call"):
    params = eqn.params["compiler_params"]
    params = params.get("triton", params) if isinstance(params, dict) else params
    get = (lambda n: params[n]) if isinstance(params, dict) else (lambda n: getattr(params, n))
    name = eqn.params.get("name") or eqn.params.get("name_and_src_info")   # jax 0.11 / 0.10
    out.append((getattr(name, "name", name), tuple(eqn.params["grid_mapping"].grid),
                get("num_warps"), get("num_stages")))
  return out


@pytest.mark.parametrize("shape", sorted(_H200_LAUNCHES))
def test_default_gpu_launches_at_the_benchmark_shapes(shape):
  """default_config('gpu', ...) on a 132-SM GPU gives the launches the H200 figures were
  measured with (traced for the GPU on this CPU host; nothing runs)."""
  B, T, H, K, V = shape
  bf, sd = jnp.bfloat16, jax.ShapeDtypeStruct
  config = pallas_kernels.default_config("gpu", B, T, H, K, V, bf, sm_count=132)
  assert not config.interpret

  def fwd_bwd(q, k, v, g, do):
    o, vjp = jax.vjp(lambda *a: chunk_gla(*a, backend="pallas", kernel_config=config)[0],
                     q, k, v, g)
    return vjp(do)

  args = (sd((B, T, H, K), bf), sd((B, T, H, K), bf), sd((B, T, H, V), bf),
          sd((B, T, H, K), jnp.float32), sd((B, T, H, V), bf))
  assert _launches(jax.make_jaxpr(fwd_bwd)(*args)) == _H200_LAUNCHES[shape]
