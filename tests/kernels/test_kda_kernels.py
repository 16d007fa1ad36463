"""Kimi Delta Attention's Pallas kernels (pallas_kernels/kda, the GPU kernels in the Pallas
interpreter on CPU) against the float64 truth (``kda_float64``: the token loop and its
hand-written reverse pass in numpy, nothing to compile); their launch configuration; and
the lowering to Triton for an H200 on this CPU host.

Tolerances are relative norms: float32 forward (o, final state) <= 1e-5, gradients (dq,
dk, dv, dg, dbeta, dh0) <= 1e-4; bf16 <= 2e-2. Inputs: g uniform in [-5, 0] per token and
channel (and the documents' -1e4 at some tokens), beta up to 0.9999, l2-normalised k,
random initial state and cotangents (never zeros). Shapes are tiny: the interpreter runs
every grid point.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import abstract_mesh, rel_err, rel_err64
from zeco_jax.ops.kda import chunked
from zeco_jax.ops.kda.reference import kda_float64

pytest.importorskip("pallas_kernels")
from pallas_kernels import Launch  # noqa: E402
from pallas_kernels import kda  # noqa: E402
from pallas_kernels.kda import gpu  # noqa: E402

pytestmark = pytest.mark.usefixtures("compile_cache")


def _inputs(seed, B, T, H, K, V, dtype=jnp.float32, resets=()):
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  q = jax.random.normal(ks[0], (B, T, H, K))
  k = jax.random.normal(ks[1], (B, T, H, K))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(ks[2], (B, T, H, V))
  g = jax.random.uniform(ks[3], (B, T, H, K), minval=-5.0, maxval=0.0)
  for t in resets:                                  # a document start: every channel
    g = g.at[:, t].set(-1e4)
  beta = jax.random.uniform(ks[4], (B, T, H), minval=0.1, maxval=0.9999)
  h0 = jax.random.normal(ks[5], (B, H, K, V))
  do = jax.random.normal(ks[6], (B, T, H, V))
  dht = jax.random.normal(ks[7], (B, H, K, V))
  cast = lambda x: x.astype(dtype)
  return (cast(q), cast(k), cast(v), g, beta, h0), (cast(do), dht)


@functools.partial(jax.jit, static_argnames=("scale", "C", "config"))
def _kernels(q, k, v, g, beta, h0, do, dht, *, scale, C, config):
  kw = dict(scale=scale, initial_state=h0, chunk_size=C, config=config)
  (o, final), res = gpu.fwd_res(q, k, v, g, beta, **kw)
  return (o, final) + tuple(gpu.bwd_res(res, q, k, v, g, beta, do, dht, **kw))


def _truth(q, k, v, g, beta, h0, do, dht, scale):
  """``kda_float64`` on the inputs (bf16 ones as their float32 values): o, final and the
  vjp of (do, dht) for q, k, v, g, beta, h0, in float64."""
  f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
  o, final, grads = kda_float64(*map(f32, (q, k, v, g, beta, h0, do, dht)), scale)
  return (o, final) + tuple(grads[n] for n in ("q", "k", "v", "g", "beta", "h0"))


def _check(inputs, cotangents, C, fwd_tol, grad_tol, config=None):
  q, v = inputs[0], inputs[2]
  B, T, H, K = q.shape
  config = config or kda.default_config("cpu", B, T, H, K, v.shape[-1], q.dtype)
  got = _kernels(*inputs, *cotangents, config=config, scale=K ** -0.5, C=C)
  want = _truth(*inputs, *cotangents, K ** -0.5)
  names = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")
  errs = {n: rel_err64(a, b) for n, a, b in zip(names, got, want)}
  assert got[0].dtype == v.dtype and got[1].dtype == jnp.float32
  assert max(errs["o"], errs["final"]) <= fwd_tol, errs
  assert max(errs[n] for n in names[2:]) <= grad_tol, errs


def test_head_128_one_chunk_pair():
  """K = V = 128, the head size users run, over two 64-token chunks, the state carried
  across the chunk boundary: four sub-chunks per chunk, ``kda_dpairs``'s programs (a
  sub-chunk and K slice each, four slices of 32 here), the block pairs spanning a
  sub-chunk added after the kernel, the diagonal blocks' dg by the tokens' roles; decays
  down to -5 on every channel and a document starting mid-sub-chunk in each chunk (t = 37,
  100). (Documents starting on a chunk boundary: the next test and test_several_chunks;
  T and P kept too: :func:`test_save_states_and_pairs`.)"""
  inputs, cot = _inputs(0, 1, 128, 1, 128, 128, resets=(37, 100))
  _check(inputs, cot, 64, 1e-5, 1e-4)


# The head sizes users run (K = V = 128) around one 64-token chunk, through the op
# (chunk_kda pads T to the chunk): below the chunk jitted; past it eagerly (each kernel
# launched on its own, the states kept: the default) and jitted walking the states again
# (save_states off); against the float64 truth's bars.
@pytest.mark.parametrize("T", [63, 65])
def test_op_head_128_around_one_chunk(T):
  from zeco_jax import chunk_kda
  (q, k, v, g, beta, h0), (do, dht) = _inputs(12, 1, T, 1, 128, 128)

  def run(jit, config=None):
    f = lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True,
                             backend="pallas", kernel_config=config)
    f = jax.jit(f) if jit else f
    (o, s), vjp = jax.vjp(f, q, k, v, g, beta, h0)
    return (o, s) + vjp((do, dht))

  want = _truth(q, k, v, g, beta, h0, do, dht, 128 ** -0.5)
  walk_again = kda.default_config("cpu", 1, T, 1, 128, 128, jnp.float32).replace(
      save_states=False)
  for jit, config in [(False, None), (True, walk_again)] if T > 64 else [(True, None)]:
    errs = [rel_err64(a, b) for a, b in zip(run(jit, config), want)]
    assert max(errs[:2]) <= 1e-5 and max(errs[2:]) <= 1e-4, (jit, config, errs)


def test_documents_mid_sub_chunk_and_on_a_chunk_boundary():
  """The diagonal blocks of A and P from a program per token and head group (``kda_diag``,
  both heads in one program here), the UT inverse reading their rows from memory;
  documents starting mid-sub-chunk and on a chunk boundary (chunks of 32). K = V = 64
  (K = 128 is lowered to Triton below). With ``save_states`` off: the backward walks the
  chunk states again from the initial state (the default keeps them; the sequence-parallel
  local pass walks them again from the received state, ``tests/ops/kda``)."""
  inputs, cot = _inputs(4, 1, 96, 2, 64, 64, resets=(21, 64))
  config = kda.default_config("cpu", 1, 96, 2, 64, 64, jnp.float32).replace(
      save_states=False)
  _check(inputs, cot, 32, 1e-5, 1e-4, config=config)


def test_dpairs_against_autodiff_of_the_pairs():
  """``kda_dpairs`` alone against jax's gradient of the jnp pairs (``chunked._pairs``,
  float32 at HIGHEST precision) on the same bf16-rounded q and k: the float32 kernel
  within 1e-5 (dg's diagonal blocks summed by the tokens' roles, its blocks below the
  diagonal over the tokens they span), and with bf16 inputs (its dots in bf16) within 1e-2,
  dg included. Weak decays, so that the block pairs spanning a whole sub-chunk count. The
  gradients' other parts (random here) come in and are added: the kernel writes the op's
  dq and dk (in the inputs' dtype) and dg."""
  from pallas_kernels.kda import pairs
  B, T, H, K, C = 1, 128, 1, 64, 64
  N = T // C
  (q, k, _, g, beta, _), _ = _inputs(6, B, T, H, K, K)
  g = g / 50.0                                     # in (-0.1, 0]
  rng = np.random.default_rng(6)
  dP = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.float32)
  dA = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.float32)
  bq, bk = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
  chunks = lambda x: x.reshape(B, N, C, H, -1).transpose(0, 3, 1, 2, 4)   # [B, H, N, C, D]

  def loss(q, k, g, beta):
    pair = functools.partial(chunked._pairs, k=chunks(k), g=chunks(g))
    P = jnp.tril(pair(chunks(q)))
    A = jnp.tril(pair(chunks(k)), -1) * chunks(beta[..., None])
    return jnp.sum(chunks(dP) * P) + jnp.sum(chunks(dA) * A)

  with jax.default_matmul_precision("highest"):       # one jitted program, not op by op
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(bq.astype(jnp.float32),
                                                         bk.astype(jnp.float32), g, beta)
  parts = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in want]
  want = [w + d for w, d in zip(want, parts)]
  config = kda.default_config("cpu", B, T, H, K, K, jnp.float32)
  run = jax.jit(lambda q, k: pairs.dpairs(q, k, g, beta, dP, dA, *parts, chunk_size=C,
                                          config=config))
  got32 = run(bq.astype(jnp.float32), bk.astype(jnp.float32))
  got16 = run(bq, bk)
  assert got16[0].dtype == got16[1].dtype == jnp.bfloat16 and got16[2].dtype == jnp.float32
  for name, a, c, w in zip(("dq", "dk", "dg", "dbeta"), got32, got16, want):
    assert rel_err(a, w) <= 1e-5, (name, rel_err(a, w))
    assert rel_err(c, w) <= 1e-2, (name, rel_err(c, w))


# The same programs twice (the second only runs): several 16-token chunks, K != V, and
# then document starts (-1e4 on every channel) mid-chunk and on a chunk boundary.
@pytest.mark.parametrize("resets", [(), (5, 16, 37, 50)], ids=["decay-5", "documents"])
def test_several_chunks(resets):
  inputs, cot = _inputs(1, 2, 64, 2, 32, 64, resets=resets)
  # The walks in V tiles of 64 and 32 (the defaults at large B * H); elsewhere 16. kda_dqk
  # in two programs per chunk (K slices of 16).
  config = kda.default_config("cpu", 2, 64, 2, 32, 64, jnp.float32).replace(
      walk_bv=64, dwalk_bv=32, dqk_kd=16)
  _check(inputs, cot, 16, 1e-5, 1e-4, config=config)


def test_bf16():
  inputs, cot = _inputs(2, 1, 64, 1, 32, 32, dtype=jnp.bfloat16)
  _check(inputs, cot, 32, 2e-2, 2e-2)


def test_forward_keeps_one_state_per_chunk_or_nothing():
  """The residual between forward and backward: by default (``save_states``) the chunk
  states h, nothing per token; nothing with ``save_states`` off (the backward walks the
  states again); with ``save_pairs`` T and P too, C values a token each."""
  (q, k, v, g, beta, h0), _ = _inputs(3, 1, 64, 2, 32, 16)
  config = kda.default_config("cpu", 1, 64, 2, 32, 16, jnp.float32)
  assert config.save_states and kda.default_config(
      "gpu", 1, 16384, 16, 128, 128, jnp.bfloat16).save_states
  _, res = jax.eval_shape(functools.partial(gpu.fwd_res, scale=1.0, chunk_size=16,
                                            config=config), q, k, v, g, beta,
                          initial_state=h0)
  assert [x.shape for x in jax.tree.leaves(res)] == [(1, 2, 4, 32, 16)]
  off = config.replace(save_states=False)
  _, res = jax.eval_shape(functools.partial(gpu.fwd_res, scale=1.0, chunk_size=16,
                                            config=off), q, k, v, g, beta,
                          initial_state=h0)
  assert jax.tree.leaves(res) == []
  _, res = jax.eval_shape(functools.partial(gpu.fwd_res, scale=1.0, chunk_size=16,
                                            config=off.replace(save_pairs=True)),
                          q, k, v, g, beta, initial_state=h0)
  assert [(x.shape, x.dtype) for x in jax.tree.leaves(res)] == [((1, 64, 2, 16), q.dtype)] * 2


def test_save_states_and_pairs():
  """``save_states=True`` and ``save_pairs=True`` (the forward keeps the chunk states, T
  and P; the backward reads them instead of forming them again; each flag's residual:
  :func:`test_forward_keeps_one_state_per_chunk_or_nothing`): the reference's float32
  bars, with documents. (The walks' pipeline stages are a Triton launch option, not in
  the interpreter's program: a stage count is checked against shared memory while
  tracing, ``test_gdn_kernels.py``, and timed on a GPU.)"""
  inputs, cot = _inputs(4, 1, 48, 2, 16, 16, resets=(9, 40))
  config = kda.default_config("cpu", 1, 48, 2, 16, 16, jnp.float32).replace(
      save_states=True, save_pairs=True)
  _check(inputs, cot, 16, 1e-5, 1e-4, config=config)


def test_backward_reads_the_kept_pairs():
  """With ``save_pairs`` the backward takes T and P from the residual (it does not form
  them again): zeroed kept pairs change dq and dk."""
  (q, k, v, g, beta, h0), (do, dht) = _inputs(7, 1, 16, 1, 16, 16)
  config = kda.default_config("cpu", 1, 16, 1, 16, 16, jnp.float32).replace(save_pairs=True)
  kw = dict(scale=0.25, initial_state=h0, chunk_size=16, config=config)

  @jax.jit
  def both():
    _, res = gpu.fwd_res(q, k, v, g, beta, **kw)
    zeroed = res._replace(pairs=tuple(jnp.zeros_like(x) for x in res.pairs))
    return [gpu.bwd_res(r, q, k, v, g, beta, do, dht, **kw)[:2] for r in (res, zeroed)]

  kept, wrong = both()
  assert rel_err(wrong[0], kept[0]) > 0.1 and rel_err(wrong[1], kept[1]) > 0.1


def test_default_config_and_errors():
  cfg = kda.default_config("gpu", 1, 16384, 16, 128, 128, jnp.bfloat16)
  assert cfg.platform == "gpu" and not cfg.interpret
  # The GPU forward keeps T and P for the backward where they fit in one float32 state's
  # bytes per chunk (2 C^2 values against 4 K V bytes); the interpreter's default forms
  # them again, so the tests here run both paths (test_save_states_and_pairs: kept).
  assert cfg.save_pairs and not kda.default_config("cpu", 1, 16, 1, 16, 16, jnp.float32).save_pairs
  assert kda.default_config("gpu", 1, 64, 1, 64, 64, jnp.bfloat16).save_pairs
  assert not kda.default_config("gpu", 1, 64, 1, 64, 64, jnp.float32).save_pairs
  assert not kda.default_config("gpu", 1, 64, 1, 32, 32, jnp.bfloat16).save_pairs
  # Gated DeltaNet's walks and launches (pallas_kernels._config.delta_walk_launch).
  assert (cfg.walk.bv, cfg.walk.stages) == (16, 3) and cfg.dwalk == cfg.walk
  big = kda.default_config("gpu", 8, 4096, 16, 128, 128, jnp.bfloat16)
  assert (big.walk.bv, big.walk.warps, big.walk.stages) == (64, 4, 2)
  assert (big.dwalk.bv, big.dwalk.warps, big.dwalk.stages) == (64, 8, 3)
  assert hash(cfg) == hash(kda.default_config("gpu", 1, 16384, 16, 128, 128, jnp.bfloat16))
  assert cfg.replace(dpairs_kd=64).dpairs.kd == 64
  assert cfg.replace(out=Launch(bk=32, bv=32, warps=2, stages=1)).out.bk == 32
  assert kda.default_config("cpu", 1, 64, 1, 16, 16, jnp.float32).interpret
  with pytest.raises(ValueError,
                     match="platform 'cpu' has no compiled kernels, only the Pallas interpreter"):
    kda.KernelConfig(platform="cpu")
  with pytest.raises(ValueError, match="unknown setting 'walk_kd'"):
    cfg.replace(walk_kd=4)
  with pytest.raises(ValueError, match="`intra_kd` must be a power of two >= 16"):
    cfg.replace(intra_kd=24)
  assert kda.default_config("tpu", 1, 64, 1, 16, 16, jnp.float32).platform == "tpu"
  with pytest.raises(ValueError, match="unknown `platform` 'metal'"):
    kda.default_config("metal", 1, 64, 1, 16, 16, jnp.float32)
  (q, k, v, g, beta, h0), _ = _inputs(3, 1, 32, 1, 24, 16)
  with pytest.raises(ValueError, match="K must be a power of two >= 16"):
    gpu.fwd(q, k, v, g, beta, scale=1.0, initial_state=h0, chunk_size=16, config=cfg)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_kernels_lower_to_triton_for_a_gpu_target(dtype):
  """Every GPU kernel of the forward and backward lowers through Pallas's Triton lowering
  for an H200 on this CPU host (an abstract device), K = V = 128, C = 64: what the
  interpreter does not check (Triton IR only; not compiled to PTX, not run)."""
  mesh = abstract_mesh("gpu", "NVIDIA H200", 132)
  B, T, H, K, V = 1, 128, 1, 128, 128
  config = kda.default_config("gpu", B, T, H, K, V, dtype)
  kw = dict(scale=K ** -0.5, initial_state=jnp.zeros((B, H, K, V)), chunk_size=64,
            config=config)

  def fwd_bwd(q, k, v, g, beta, do):
    (o, _), res = gpu.fwd_res(q, k, v, g, beta, **kw)
    return o, gpu.bwd_res(res, q, k, v, g, beta, do, jnp.zeros((B, H, K, V)), **kw)

  sd, f32 = jax.ShapeDtypeStruct, jnp.float32
  args = [sd((B, T, H, K), dtype)] * 2 + [sd((B, T, H, V), dtype), sd((B, T, H, K), f32),
                                          sd((B, T, H), f32), sd((B, T, H, V), dtype)]
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  names = ("kda_intra", "kda_wu", "kda_state_walk", "kda_output", "kda_vnew",
           "kda_grad_walk", "kda_dqk", "kda_dwy", "kda_dpairs", "kda_diag")
  assert all(name in text for name in names), [n for n in names if n not in text]
  assert text.count("xla.gpu.triton") >= len(names)


def test_op_layer_and_sequence_parallel_on_kernels():
  """chunk_kda(backend="pallas") against the float64 token loop with documents;
  zeco_kda with the kernels in its local pass (the widened state) on 4 ranks; the layer
  with backend="pallas", run eagerly (each kernel launched on its own), equals
  backend="jax" (one jitted program: the reference, not what is tested)."""
  from flax import nnx
  from helpers import check_kda_documents, kda_inputs, seq_mesh
  from zeco_jax import chunk_kda, zeco_kda
  from zeco_jax.nn import KimiDeltaAttention
  ids = np.array([[0] * 5 + [1] * 27 + [2] * 18 + [-1] * 14, [3] * 64])
  inputs, weights = kda_inputs(11, 2, 64, 2, 16, 16, decay="strong")
  op = functools.partial(chunk_kda, chunk_size=16, backend="pallas")
  check_kda_documents(op, inputs, weights, ids)
  op = functools.partial(zeco_kda, mesh=seq_mesh(4), chunk_size=16, backend="pallas")
  check_kda_documents(op, inputs, weights, ids)
  x = jax.random.normal(jax.random.PRNGKey(9), (1, 40, 32), jnp.float32)
  outs = []
  for backend in ("jax", "pallas"):
    layer = KimiDeltaAttention(32, 2, head_dim=16, chunk_size=16, backend=backend,
                               rngs=nnx.Rngs(0))

    def forward_and_grad(x, layer=layer):
      y, vjp = jax.vjp(lambda x: layer(x), x)
      return y, vjp(jnp.cos(y))[0]

    outs.append(forward_and_grad(x) if backend == "pallas" else
                jax.jit(forward_and_grad)(x))
  assert rel_err(outs[1][0], outs[0][0]) <= 1e-5 and rel_err(outs[1][1], outs[0][1]) <= 1e-4


def test_auto_picks_the_gpu_kernels_and_holds_back_unrun_ones(monkeypatch):
  """backend="auto" picks KDA's kernels on a GPU target (they have run on an H200); a
  (family, platform) listed in ``pallas_kernels.NOT_YET_AUTO`` resolves to the jnp path,
  said once, while backend="pallas" still picks its kernels."""
  import pallas_kernels
  from zeco_jax.ops import _dispatch
  assert _dispatch.resolve_backend("auto", family="kda", platform="gpu") == "pallas"
  assert _dispatch.resolve_backend("auto", family="kda", platform="cpu") == "jax"
  monkeypatch.setitem(pallas_kernels.NOT_YET_AUTO, ("kda", "gpu"), "not yet run on a GPU")
  _dispatch.say_jax_fallback.cache_clear()
  with pytest.warns(UserWarning, match="not yet run on a GPU"):
    assert _dispatch.resolve_backend("auto", family="kda", platform="gpu") == "jax"
  assert _dispatch.resolve_backend("pallas", family="kda", platform="gpu") == "pallas"


def test_ptx_stats_dumps_each_kernels_triton_ir(tmp_path):
  """benchmarks.ptx_stats's first step (no Triton needed): one Triton IR file per kernel
  of the forward + backward, with its launch, through the private lowering hooks it
  patches (and restores)."""
  import json
  if not hasattr(jax.sharding, "AbstractDevice"):
    pytest.skip("this jax has no jax.sharding.AbstractDevice")
  from benchmarks import ptx_stats
  from jax._src.pallas.triton import lowering
  hook = lowering.lower_jaxpr_to_triton_module
  kernels = ptx_stats.dump("kda", (1, 128, 1, 128, 128), {"dqk_kd": 32}, str(tmp_path))
  assert lowering.lower_jaxpr_to_triton_module is hook
  names = [k["name"] for k in kernels]
  # kda_diag once: the GPU default keeps T and P, so the backward does not form them again.
  assert names.count("kda_diag") == 1 and "kda_dpairs" in names, names
  assert all(open(k["path"]).read().startswith("module") for k in kernels)
  meta = json.load(open(tmp_path / "kernels.json"))
  assert meta["changes"] == {"dqk_kd": 32} and len(meta["kernels"]) == len(names)
  # The table: each kernel once, another build's figures as "theirs -> ours" where they differ.
  row = dict(kernel="kda_intra", warps=4, registers=255, spill_stores=8, spill_loads=8,
             instructions=100, barriers=9, mmas=2, exps=3)
  text = ptx_stats.table([row, row, dict(row, kernel="kda_diag")],
                         [dict(row, barriers=70, spill_stores=16)])
  assert "| `kda_intra` | 4 | 255 | 16 / 8 -> 8 / 8 | 100 | 70 -> 9 | 2 | 3 |" in text, text
  assert text.count("kda_intra") == 1 and "| `kda_diag` | - -> 4 |" in text, text
