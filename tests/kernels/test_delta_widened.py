"""The delta-rule kernels' forward on a state wider than v (Gated DeltaNet and Kimi Delta
Attention): the sequence-parallel local pass's state ``[0, I]`` with K identity columns,
entered with v as it is. The columns past v's get no values, as if v had zero columns
there; the local pass writes no such columns of v and forms no u on them.

Tolerances are relative norms: float32 <= 1e-6 against the forward on v with the zero
columns written out (the same kernels, the same sums per column); against the float64
token loop, forward <= 1e-5 and gradients <= 1e-4 (K = V = 128 just past a chunk on each
of 2 ranks).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import abstract_mesh, find_eqns, gdn_inputs, kda_inputs, rel_err, seq_mesh

pallas_kernels = pytest.importorskip("pallas_kernels")
from pallas_kernels import gated_delta, kda  # noqa: E402
from zeco_jax import zeco_gated_delta_rule, zeco_kda  # noqa: E402

pytestmark = pytest.mark.usefixtures("compile_cache")

FAMILIES = {"gated_delta": (gated_delta, gdn_inputs, zeco_gated_delta_rule, "gdn"),
            "kda": (kda, kda_inputs, zeco_kda, "kda")}


def _widened_state(B, H, K, V, seed):
  """A state of V + K columns: random in the first V, random in the K after them (not the
  identity, so that every column's walk is exercised)."""
  r = np.random.default_rng(seed)
  return jnp.asarray(r.standard_normal((B, H, K, V + K)), jnp.float32)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("K,V,platform", [(16, 16, "cpu"), (32, 16, "cpu"), (32, 16, "tpu")])
def test_wider_state_equals_zero_columns_of_v(family, K, V, platform):
  """fwd_res with v ``[.., V]`` and a state of V + K columns equals fwd_res with v's K zero
  columns written out: o, the final state and the kept chunk states, every column. The GPU
  kernels in the interpreter ("cpu": the walk's V tiles of 16, one of u's, the rest past
  it, at K = 32 two), and the TPU kernels in theirs (which pad v to the state's width)."""
  package, inputs, _, _ = FAMILIES[family]
  B, T, H, C = 1, 48, 2, 16
  (q, k, v, g, beta, _), _ = inputs(3, B, T, H, K, V)
  h0 = _widened_state(B, H, K, V, 4)
  impl = pallas_kernels.backend(family, platform)
  config = (package.KernelConfig(platform="tpu", interpret=True) if platform == "tpu" else
            package.default_config("cpu", B, T, H, K, V + K, jnp.float32).replace(
                save_states=True))
  g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
  run = jax.jit(lambda v: impl.fwd_res(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0,
                                       chunk_size=C, config=config))
  (o, final), res = run(v)
  (o_zeros, final_zeros), res_zeros = run(jnp.concatenate([v, jnp.zeros((B, T, H, K))], -1))
  assert o.shape == (B, T, H, V + K) and final.shape == (B, H, K, V + K)
  for got, want in ((o, o_zeros), (final, final_zeros), (res.h, res_zeros.h)):
    assert rel_err(got, want) <= 1e-6
    assert rel_err(got[..., V:], want[..., V:]) <= 1e-6       # the columns past v's


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_narrower_than_v_is_refused(family):
  package, inputs, _, _ = FAMILIES[family]
  (q, k, v, g, beta, h0), _ = inputs(3, 1, 16, 1, 16, 32)
  impl = pallas_kernels.backend(family, "cpu")
  config = package.default_config("cpu", 1, 16, 1, 16, 32, jnp.float32)
  with pytest.raises(ValueError, match="initial_state has 16 value columns for v's 32"):
    impl.fwd(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), scale=0.25,
             initial_state=h0[..., :16], chunk_size=16, config=config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_wider_state_lowers_to_triton_for_a_gpu_target(family):
  """The forward on a state of V + K columns at K = V = 128 (the local pass's at the
  benchmark's head) lowers through Triton for an H200 on this CPU host: the walk's masked
  load of u's tiles included, which the interpreter runs as a plain load."""
  package, _, _, prefix = FAMILIES[family]
  B, T, H, K, V = 1, 256, 2, 128, 128
  impl = pallas_kernels.backend(family, "gpu")
  config = package.default_config("gpu", B, T, H, K, V + K, jnp.bfloat16)
  sd, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  g = sd((B, T, H, K) if family == "kda" else (B, T, H), f32)
  args = (sd((B, T, H, K), bf), sd((B, T, H, K), bf), sd((B, T, H, V), bf), g,
          sd((B, T, H), f32), sd((B, H, K, V + K), f32))

  def fwd(q, k, v, g, beta, h0):
    return impl.fwd(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0, chunk_size=64,
                    config=config)

  with jax.sharding.use_abstract_mesh(abstract_mesh("gpu", "NVIDIA H200", 132)):
    lowered = jax.jit(fwd).trace(*args).lower(lowering_platforms=("cuda",))
  assert f"{prefix}_state_walk" in lowered.as_text()
  o, final = jax.eval_shape(fwd, *args)
  assert o.shape == (B, T, H, V + K) and final.shape == (B, H, K, V + K)


def _kernel_name(eqn):
  name = eqn.params.get("name") or eqn.params.get("name_and_src_info")   # jax 0.11 / 0.10
  return getattr(name, "name", name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_local_pass_writes_no_zero_columns_of_v(family):
  """The sequence-parallel local pass on the kernels, forward and backward: its u kernel
  (``gdn_wy`` / ``kda_wu``) takes v with its V columns, and no value array of V + K
  columns is concatenated (the widened state's h0 is the only V + K array built)."""
  _, inputs, op, prefix = FAMILIES[family]
  wu_name = {"gdn": "gdn_wy", "kda": "kda_wu"}[prefix]
  K, V = 16, 16
  (q, k, v, g, beta, _), _ = inputs(5, 1, 64, 2, K, V, dtype=jnp.bfloat16)

  def loss(q, k, v, g, beta):
    o, _ = op(q, k, v, g, beta, mesh=seq_mesh(4), chunk_size=16, backend="pallas")
    return jnp.sum(o.astype(jnp.float32))

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
  forward_wu = [e for e in find_eqns(jaxpr, "pallas_call") if _kernel_name(e) == wu_name]
  assert forward_wu, "the forward's u kernel was not found"
  for eqn in forward_wu:
    widths = {x.aval.shape[-1] for x in eqn.invars if x.aval.dtype == jnp.bfloat16
              and x.aval.ndim == 4}
    assert widths == {V}, widths
  wide_values = [e for e in find_eqns(jaxpr, "concatenate")
                 if e.outvars[0].aval.dtype == jnp.bfloat16]
  assert not wide_values, [e.outvars[0].aval for e in wide_values]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_local_pass_head_128_just_past_a_chunk(family):
  """The shapes users run: the sequence-parallel op on the kernels at K = V = 128 on 2
  ranks of 65 tokens (one chunk of 64 and a padded one on each), with an initial state,
  g down to -5 and beta up to 0.9999, against the float64 token loop (float32: o and
  the final state <= 1e-5, every gradient <= 1e-4). The widened state is 256 columns
  wide: the walk's tiles past v's 128 are the masked ones."""
  from helpers import check_gdn_against_float64, check_kda_against_float64
  _, inputs, op, _ = FAMILIES[family]
  if family == "kda":
    case = inputs(6, 1, 130, 1, 128, 128, decay="strong")
    check = check_kda_against_float64
  else:
    case = inputs(6, 1, 130, 1, 128, 128, g_low=-5.0, beta_high=0.9999)
    check = check_gdn_against_float64
  op = functools.partial(op, mesh=seq_mesh(2), chunk_size=64, backend="pallas")
  check(op, *case)
