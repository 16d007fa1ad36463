"""Gated DeltaNet's Pallas kernels (pallas_kernels/gated_delta, the GPU kernels in the
Pallas interpreter on CPU) against the float64 token loop and the jnp path, through
``chunk_gated_delta_rule(backend="pallas")`` and ``zeco_gated_delta_rule``; their launch
configuration, the dispatch, the argument errors, and the lowering to Triton for an H200
on this CPU host.

Tolerances are relative norms: float32 forward <= 1e-5, gradients <= 1e-4; bf16 <= 2e-2.
Shapes: K and V from 16 to 128, T below, at and above a chunk (63, 64, 65 at C = 64),
several chunks with a padded tail, jit and eager; g down to -5 per token, beta up to
0.9999, random inputs (never zeros).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (GDN_SHARD_DOC_IDS, abstract_mesh, check_gdn_against_float64,
                     check_gdn_documents, gdn_inputs, rel_err, rel_err64, seq_mesh)
from zeco_jax import chunk_gated_delta_rule, zeco_gated_delta_rule

pallas_kernels = pytest.importorskip("pallas_kernels")
from pallas_kernels import gated_delta  # noqa: E402
from pallas_kernels.gated_delta import gpu  # noqa: E402

pytestmark = pytest.mark.usefixtures("compile_cache")


def _kernel_op(chunk_size, **kw):
  return functools.partial(chunk_gated_delta_rule, chunk_size=chunk_size, backend="pallas",
                           **kw)


# (B, T, H, K, V, C): several chunks and a padded tail; K != V.
@pytest.mark.parametrize("shape", [(2, 72, 2, 16, 32, 16), (1, 50, 1, 32, 16, 32)],
                         ids=["K16-V32-C16", "K32-V16-C32"])
def test_kernels_match_float64(shape):
  B, T, H, K, V, C = shape
  inputs, weights = gdn_inputs(0, B, T, H, K, V, g_low=-5.0, beta_high=0.9999)
  # V = 32 walks in one V tile of 32 (the walks' default at large B * H takes 32 or 64);
  # every other test walks in tiles of 16. V = 16 takes k k^T in two K slices and gdn_dqk
  # in two programs per chunk (K slices); K = 16 gdn_dqk's whole K in one.
  cfg = gated_delta.default_config("cpu", B, T, H, K, V, jnp.float32)
  cfg = (cfg.replace(walk_bv=32, dwalk_bv=32) if V == 32
         else cfg.replace(dqk_kd=16, inv_kd=16, wy_kd=16))
  check_gdn_against_float64(_kernel_op(C, kernel_config=cfg), inputs, weights)


def test_kernels_without_initial_state_and_bf16():
  inputs, weights = gdn_inputs(1, 1, 48, 2, 16, 16, initial=False)
  check_gdn_against_float64(_kernel_op(16), inputs, weights)
  inputs, weights = gdn_inputs(2, 1, 48, 2, 16, 16, dtype=jnp.bfloat16)
  check_gdn_against_float64(_kernel_op(16), inputs, weights, fwd_tol=2e-2, grad_tol=2e-2)


def test_kernels_packed_documents():
  ids = np.array([[0] * 5 + [1] * 11 + [2] * 16 + [-1] * 3 + [3] * 30 + [4] + [-1] * 6])
  inputs, weights = gdn_inputs(3, 1, 72, 2, 16, 16, g_low=-5.0)
  check_gdn_documents(_kernel_op(16), inputs, weights, ids)


# The head sizes users run (K = V = 128) around one 64-token chunk: the silent-garbage
# box of the GLA issue. Below the chunk jitted; past it eagerly (each kernel launched on
# its own, the states kept: the default) and jitted walking the states again
# (save_states off): each path once, all against the float64 truth's bars. (The walks'
# pipeline stages are a Triton launch option, absent from the interpreter's program: their
# shared-memory check is below, their speed timed on a GPU.)
@pytest.mark.parametrize("T", [63, 65])
def test_kernels_head_128_around_one_chunk(T):
  from zeco_jax.ops.gated_delta.reference import gdn_float64
  (q, k, v, g, beta, h0), (do, dht) = gdn_inputs(4, 1, T, 1, 128, 128, g_low=-5.0,
                                                   beta_high=0.9999)

  def run(jit, config=None):
    f = lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True,
                                          backend="pallas", kernel_config=config)
    f = jax.jit(f) if jit else f
    (o, s), vjp = jax.vjp(f, q, k, v, g, beta, h0)
    return (o, s) + vjp((do.astype(o.dtype), dht))

  o64, s64, g64 = gdn_float64(q, k, v, g, beta, h0, do, dht)
  want = (o64, s64) + tuple(g64[n] for n in ("q", "k", "v", "g", "beta", "h0"))
  walk_again = gated_delta.default_config("cpu", 1, T, 1, 128, 128, jnp.float32).replace(
      save_states=False)
  for jit, config in [(False, None), (True, walk_again)] if T > 64 else [(True, None)]:
    got = run(jit, config)
    errs = [rel_err64(a, b) for a, b in zip(got, want)]
    assert max(errs[:2]) <= 1e-5 and max(errs[2:]) <= 1e-4, (jit, config, errs)


def _residual(f, *args):
  """The arrays ``jax.vjp(f, *args)`` keeps for the backward, as ShapeDtypeStructs: traced
  (``jax.eval_shape``), not run."""
  return jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args))


def test_default_keeps_inputs_and_one_state_per_chunk():
  """The default (``save_states=True``): the residual is the inputs and one state per
  chunk, nothing per token."""
  T, C, H, K, V = 128, 16, 2, 16, 16
  (q, k, v, g, beta, h0), _ = gdn_inputs(5, 1, T, H, K, V)
  cfg = gated_delta.default_config("cpu", 1, T, H, K, V, jnp.float32)
  assert cfg.save_states and gated_delta.default_config(
      "gpu", 1, 16384, 4, 128, 256, jnp.bfloat16).save_states
  leaves = _residual(lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5],
                                                      chunk_size=C, backend="pallas",
                                                      kernel_config=cfg)[0],
                     q, k, v, g, beta, h0)
  inputs = sum(x.size for x in (q, k, v, g, beta, h0))
  assert sum(x.size for x in leaves) - inputs == (T // C) * H * K * V
  assert not any(x.size >= T * H * K * V for x in leaves)


def test_without_save_states_keeps_only_the_inputs():
  """``save_states=False``: the residual is the inputs alone. (The backward then walks the
  states again, held to the float64 bars with an initial state and several chunks in
  test_kernels_head_128_around_one_chunk[65] under jit, and in the sequence-parallel
  local pass's backward.)"""
  T, C, H, K, V = 48, 16, 2, 16, 16
  inputs, _ = gdn_inputs(6, 1, T, H, K, V, g_low=-5.0)
  cfg = gated_delta.default_config("cpu", 1, T, H, K, V, jnp.float32).replace(
      save_states=False)
  op = _kernel_op(C, kernel_config=cfg)
  leaves = _residual(lambda *a: op(*a[:5], initial_state=a[5])[0], *inputs)
  assert sum(x.size for x in leaves) == sum(x.size for x in inputs)


def test_stages_match_the_jnp_chunk_terms():
  """The UT inverse kernel against ``unit_lower_inverse`` of the jnp path's A."""
  from zeco_jax._chunks import masked_exp, segment_sums, to_chunks, unit_lower_inverse
  from pallas_kernels.gated_delta import chunk
  (q, k, v, g, beta, h0), _ = gdn_inputs(6, 1, 128, 1, 16, 16, g_low=-5.0, beta_high=0.9999)
  C = 64
  config = gated_delta.default_config("cpu", 1, 128, 1, 16, 16, jnp.float32)
  Tinv = chunk.inverse(k, g, beta, chunk_size=C, config=config)        # [B, T, H, C]

  @jax.jit                                   # the jnp reference: one program, not op by op
  def reference(k, g, beta):
    kc, gc, bc = to_chunks(k, C), to_chunks(g, C), to_chunks(beta, C)
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    A = bc[..., :, None] * masked_exp(segment_sums(gc), strict) * jnp.einsum(
        "...ik,...jk->...ij", kc, kc, precision="highest")
    return unit_lower_inverse(A)                                         # [B, H, N, C, C]

  want = reference(k, g, beta)
  got = jnp.moveaxis(Tinv.reshape(1, 2, C, 1, C), 3, 1)
  assert rel_err(got, want) <= 1e-6


# (B, T, H, K, V): the head users run (K = V = 128, two chunks) and a small one (K != V,
# k k^T in two K slices, w in two tiles of 16 and u in three).
@pytest.mark.parametrize("shape", [(1, 128, 1, 128, 128), (2, 128, 2, 32, 48)],
                         ids=["K128-V128", "K32-V48"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fused_wy_matches_inverse_then_wu(shape, dtype):
  """The forward's ``gdn_wy`` (chunk.wy_forward) against ``gdn_ut_inverse`` then
  ``gdn_wu`` (the backward's chunk.wy). w, u: the same products summed in another order
  (block by block against whole-chunk dots); gc = b and kd = e^{to_end} k: b and to_end
  summed by 16-token blocks instead of over the chunk. Relative norms: gc (float32) within
  1e-6; w, u, kd within 1e-6 for float32 inputs and 1e-4 for bf16 ones (an element one
  bf16 step apart, 2^-8 of its value, stays within it). Measured: at most 9e-8 (float32),
  5e-7 (bf16). g down to log 0.5 per token, beta up to 0.99."""
  from pallas_kernels.gated_delta import chunk
  B, T, H, K, V = shape
  (q, k, v, g, beta, _), _ = gdn_inputs(11, B, T, H, K, V, g_low=np.log(0.5),
                                        beta_high=0.99, dtype=dtype, initial=False)
  beta = beta.astype(jnp.float32)
  cfg = gated_delta.default_config("cpu", B, T, H, K, V, dtype)
  if K == 32:
    cfg = cfg.replace(wy_kd=16, inv_kd=16, wy_bv=16, wu_bv=16)
  kw = dict(chunk_size=64, config=cfg)
  want = jax.jit(functools.partial(chunk.wy, **kw))(k, v, g, beta)[1:]
  got = jax.jit(functools.partial(chunk.wy_forward, **kw))(k, v, g, beta)
  for name, a, b in zip(("w", "u", "kd", "gc"), got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    bar = 1e-6 if name == "gc" or dtype == jnp.float32 else 1e-4
    assert rel_err(a, b) <= bar, (name, rel_err(a, b))


@pytest.mark.parametrize("method,pieces,keep,dtype", [
    ("all_scan", None, False, jnp.float32), ("ring", None, False, jnp.float32),
    ("all_scan", 2, False, jnp.float32), ("all_scan", None, True, jnp.float32),
    ("all_scan", None, True, jnp.bfloat16)])
def test_sequence_parallel_local_pass_on_kernels(method, pieces, keep, dtype):
  """zeco_gated_delta_rule with the kernels in its local pass (the widened state as V + K
  value columns; in 2 head groups, the TPU default's form) equals the float64 truth on 4
  ranks, documents crossing ranks (float32 within 1e-5 / 1e-4, bf16 within 2e-2): by
  default the plain backward walks its states again from the received state; with
  ``save_states`` they are formed from the widened pass's kept states (in bf16 at the
  default matmul precision)."""
  inputs, weights = gdn_inputs(7, 2, 64, 2, 16, 16, g_low=-5.0, dtype=dtype)
  cfg = gated_delta.default_config("cpu", 2, 16, 2, 16, 32, dtype).replace(
      save_states=keep)
  op = functools.partial(zeco_gated_delta_rule, mesh=seq_mesh(4), method=method, chunk_size=16,
                         backend="pallas", overlap_pieces=pieces, kernel_config=cfg)
  tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 2e-2)
  check_gdn_documents(op, inputs, weights, GDN_SHARD_DOC_IDS, tol=tol)


@pytest.mark.parametrize("keep", [None, False, True])
def test_local_pass_keeps_widened_states_only_with_save_states(keep):
  """What the local pass on the kernels keeps for its backward: no chunk states ``[..., K,
  V + K]`` without a ``kernel_config`` (keep None; the op's default keeps its states) or
  with ``save_states`` off, the widened pass's with it on."""
  K, V = 16, 16
  (q, k, v, g, beta, _), _ = gdn_inputs(3, 1, 64, 2, K, V)
  cfg = None if keep is None else gated_delta.default_config(
      "cpu", 1, 16, 2, K, V + K, jnp.float32).replace(save_states=keep)
  op = lambda *a: zeco_gated_delta_rule(*a, mesh=seq_mesh(4), chunk_size=16,
                                        backend="pallas", kernel_config=cfg)[0]
  widened = [x.shape for x in _residual(op, q, k, v, g, beta) if x.shape[-2:] == (K, V + K)
             and x.ndim == 5]
  assert bool(widened) == bool(keep), widened


def test_default_config_and_errors():
  cfg = gated_delta.default_config("gpu", 1, 16384, 16, 128, 128, jnp.bfloat16)
  assert cfg.platform == "gpu" and not cfg.interpret and cfg.walk.bv == 16
  # The walks' launch by shape and dtype (pallas_kernels._config.delta_walk_launch): the
  # tile by the number of walk programs, the stages by the shared memory a chunk's
  # operands take; at a tile of 64 (more programs than SMs) the forward walk takes 4 warps
  # and the stages that let two programs share an SM.
  launch = lambda c, s="walk": (getattr(c, s).bv, getattr(c, s).warps, getattr(c, s).stages)
  assert launch(cfg) == (16, 4, 3) and cfg.dwalk == cfg.walk
  big = gated_delta.default_config("gpu", 8, 4096, 16, 128, 128, jnp.bfloat16)
  assert launch(big) == (64, 4, 2) and launch(big, "dwalk") == (64, 8, 3)
  mid = gated_delta.default_config("gpu", 4, 4096, 16, 128, 128, jnp.bfloat16)
  assert launch(mid) == (32, 4, 3) and mid.dwalk == mid.walk
  assert launch(gated_delta.default_config("gpu", 1, 16384, 16, 128, 128,
                                           jnp.float32)) == (16, 4, 2)
  big32 = gated_delta.default_config("gpu", 8, 4096, 16, 128, 128, jnp.float32)
  assert launch(big32) == (64, 4, 1) and launch(big32, "dwalk") == (64, 8, 1)
  assert launch(gated_delta.default_config("gpu", 1, 16384, 16, 128, 128, jnp.bfloat16,
                                           chunk_size=128)) == (16, 4, 2)
  # Gated DeltaNet-340M's heads (K = 256, V = 512): tile 32 (96 programs), 4 warps, 2
  # stages; gdn_dqk in K slices of 64.
  wide = gated_delta.default_config("gpu", 1, 16384, 6, 256, 512, jnp.bfloat16)
  assert launch(wide) == (32, 4, 2) and wide.dqk.kd == 64
  assert gated_delta.default_config("gpu", 4, 4096, 16, 128, 128, jnp.bfloat16,
                                    sm_count=64).walk.bv == 64
  assert hash(cfg) == hash(gated_delta.default_config("gpu", 1, 16384, 16, 128, 128,
                                                      jnp.bfloat16))
  assert cfg.replace(dqk_warps=8).dqk.warps == 8
  assert gated_delta.default_config("cpu", 1, 64, 1, 16, 16, jnp.float32).interpret
  with pytest.raises(ValueError,
                     match="platform 'cpu' has no compiled kernels, only the Pallas interpreter"):
    gated_delta.KernelConfig(platform="cpu")
  with pytest.raises(ValueError, match="unknown setting 'walk_kd'"):
    cfg.replace(walk_kd=4)
  with pytest.raises(ValueError, match=r"`dqk_kd` must be a power of two >= 16 \(a tile"):
    cfg.replace(dqk_kd=8)
  assert pallas_kernels.backend("gated_delta", "gpu") is gpu
  assert pallas_kernels.backend("gated_delta", "cpu") is gpu
  assert isinstance(gpu, pallas_kernels.ChunkKernels)
  (q, k, v, g, beta, _), _ = gdn_inputs(8, 1, 32, 1, 8, 16)
  with pytest.raises(ValueError, match=r"needs K \(q.shape\[-1\]\) a power of two >= 16, "
                                       r"got 8; use backend='jax'"):
    chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, backend="pallas")
  (q, k, v, g, beta, _), _ = gdn_inputs(8, 1, 32, 1, 16, 16)
  with pytest.raises(ValueError, match="`kernel_config` must be a pallas_kernels.gated_delta"):
    chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, backend="pallas",
                           kernel_config=pallas_kernels.KernelConfig(platform="cpu",
                                                                     interpret=True))
  # On CPU "auto" is the jnp path: its output equals backend="jax" exactly.
  o_auto, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
  o_jax, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, backend="jax")
  assert np.array_equal(np.asarray(o_auto), np.asarray(o_jax))


def _lower_gdn_for_gpu(B, T, H, K, V, config):
  """The kernels' forward and backward lowered for an H200 (an abstract device): the
  lowered text."""
  mesh = abstract_mesh("gpu", "NVIDIA H200", 132)
  kw = dict(scale=K ** -0.5, initial_state=jnp.zeros((B, H, K, V)), chunk_size=64,
            config=config)

  def fwd_bwd(q, k, v, g, beta, do):
    (o, _), res = gpu.fwd_res(q, k, v, g, beta, **kw)
    return o, gpu.bwd_res(res, q, k, v, g, beta, do, jnp.zeros((B, H, K, V)), **kw)

  sd = jax.ShapeDtypeStruct
  bf, f32 = jnp.bfloat16, jnp.float32
  args = [sd((B, T, H, K), bf)] * 2 + [sd((B, T, H, V), bf), sd((B, T, H), f32),
                                       sd((B, T, H), f32), sd((B, T, H, V), bf)]
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _dot_precisions(jaxpr):
  """The ``precision`` of every dot_general in a jaxpr, the kernels' bodies included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns"):
        found += _dot_precisions(inner)
  return found


@pytest.mark.parametrize("family", ["gated_delta", "gated_delta_wy", "kda"])
def test_inverse_merges_take_three_bf16_products_for_bf16_inputs(family):
  """The UT inverse's 16 block merges of a chunk of 64 (``_delta.merge_dot``): the
  three-bf16-product preset for bf16 inputs, IEEE float32 (HIGHEST) for float32 ones, in
  both families' inverse kernels (``gdn_ut_inverse``, the fused ``gdn_wy``, ``kda_intra``);
  no other dot takes the preset."""
  from pallas_kernels import _delta
  from pallas_kernels.kda import pairs
  B, T, H, K = 1, 64, 1, 32
  g_shape = (B, T, H, K) if family == "kda" else (B, T, H)
  counts = {}
  for dtype in (jnp.bfloat16, jnp.float32):
    k = jnp.ones((B, T, H, K), dtype)
    g, beta = -jnp.ones(g_shape), jnp.ones((B, T, H))
    cfg = pallas_kernels.family_default_config(family.removesuffix("_wy"), "cpu", B, T, H, K,
                                               K, dtype)
    if family == "gated_delta":
      run = lambda k, g, beta: gpu.chunk.inverse(k, g, beta, chunk_size=64, config=cfg)
    elif family == "gated_delta_wy":
      run = lambda k, g, beta: gpu.chunk.wy_forward(k, k, g, beta, chunk_size=64, config=cfg)
    else:
      run = lambda k, g, beta: pairs.intra(k, k, g, beta, chunk_size=64, config=cfg)
    precisions = _dot_precisions(jax.make_jaxpr(run)(k, g, beta).jaxpr)
    counts[dtype] = sum(p == _delta.NARROW_MERGE for p in precisions)
    if dtype == jnp.float32:
      assert jax.lax.Precision.HIGHEST in jax.tree.leaves(precisions)
  assert counts == {jnp.bfloat16: 16, jnp.float32: 0}, counts


@pytest.mark.parametrize("K,V,dqk_kd", [(128, 128, None), (128, 128, 128), (256, 512, None)],
                         ids=["K128", "K128-dqk-whole-K", "K256-V512"])
def test_kernels_lower_to_triton_for_a_gpu_target(K, V, dqk_kd):
  """Every GPU kernel of the forward and backward lowers through Pallas's Triton lowering
  for an H200 on this CPU host (an abstract device): what the interpreter does not check.
  The defaults (gdn_dqk in K slices of 32 at K = 128), gdn_dqk over the whole K, and
  K = 256, V = 512, Gated DeltaNet-340M's head (the walks on a V tile of 32 and 2 stages,
  k k^T in two K slices, dqk in four)."""
  B, T, H = 1, 256, 2
  config = gated_delta.default_config("gpu", B, T, H, K, V, jnp.bfloat16)
  assert config.dqk.kd == (32 if K <= 128 else 64)
  if dqk_kd is not None:
    config = config.replace(dqk_kd=dqk_kd)
  text = _lower_gdn_for_gpu(B, T, H, K, V, config)
  names = ("gdn_wy", "gdn_state_walk", "gdn_output", "gdn_ut_inverse", "gdn_wu", "gdn_vnew",
           "gdn_grad_walk", "gdn_dqk", "gdn_dwy")
  assert all(name in text for name in names), [n for n in names if n not in text]


@pytest.mark.parametrize("K,V,B,changes", [
    (128, 128, 8, dict(dwalk_stages=4, dwalk_bv=64)),   # 4 x 64 KB
    (256, 512, 1, dict(dwalk_stages=3)),                # tile 32: 3 x 104 KB
], ids=["K128-tile-64-4-stages", "K256-3-stages"])
def test_walk_stages_that_overflow_shared_memory_are_refused(K, V, B, changes):
  """Walk launches whose operands alone overflow a GPU's shared memory (on an H100 they
  failed at run time: RESOURCE_EXHAUSTED, 262144 and 327680 bytes asked) are refused
  while tracing, naming the setting; the defaults beside them lower."""
  config = gated_delta.default_config("gpu", B, 256, 2, K, V, jnp.bfloat16)
  stage = "dwalk"
  with pytest.raises(ValueError, match=rf"`{stage}_stages`=\d with a V tile of \d+ at K = "
                                       rf"{K} .* lower `{stage}_stages` or `{stage}_bv`"):
    _lower_gdn_for_gpu(B, 256, 2, K, V, config.replace(**changes))


def test_layer_and_model_take_the_backend():
  """GatedDeltaNet(backend="pallas"), run eagerly (each kernel launched on its own),
  equals backend="jax" (one jitted program: the reference, not what is tested), forward
  and the input's gradient; the model config checks the name."""
  from flax import nnx
  from models import GDNConfig
  from zeco_jax.nn import GatedDeltaNet
  x = jax.random.normal(jax.random.PRNGKey(9), (1, 40, 32), jnp.float32)
  outs = []
  for backend in ("jax", "pallas"):
    layer = GatedDeltaNet(32, 2, head_dim=16, expand_v=1.0, chunk_size=16, backend=backend,
                          rngs=nnx.Rngs(0))

    def forward_and_grad(x, layer=layer):
      y, vjp = jax.vjp(lambda x: layer(x), x)
      return y, vjp(jnp.cos(y))[0]

    outs.append(forward_and_grad(x) if backend == "pallas" else
                jax.jit(forward_and_grad)(x))
  assert rel_err(outs[1][0], outs[0][0]) <= 1e-5 and rel_err(outs[1][1], outs[0][1]) <= 1e-4
  with pytest.raises(ValueError, match="GatedDeltaNet: unknown `backend` .triton.; choose one of"):
    GatedDeltaNet(32, 2, head_dim=16, backend="triton", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="model: backend must be one of"):
    GDNConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
              backend="cuda").validate()
