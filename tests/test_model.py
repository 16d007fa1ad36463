"""The GLA model: parameters' logical axes, use inside a user's jit, causality, and that
loss and gradients do not depend on how the sequence is split (seq = 1, 4, 8)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs.tiny_mqar
import trainer
from conftest import rel_err
from helpers import sub_jaxprs
from models import LM, GLAConfig, sharding
from models.data import Dataset
from zeco_jax.nn import GatedLinearAttention

SMALL = GLAConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                  intermediate_size=64, chunk_size=16)


# configs/tiny_mqar.py made small enough for tests (SMALL's model, 128-token sequences).
TINY = {
    "model": dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                  intermediate_size=64, chunk_size=16),
    "data": dict(seq_len=128, batch_size=2, num_keys=16, num_pairs=4, num_queries=16,
                 num_segments=4, query_window=24),
    "train": dict(steps=20, warmup_steps=2, lr=3e-3, log_every=5, eval_every=0,
                  eval_batches=1, checkpoint_every=0),
}


def tiny_cfg(**train_overrides):
  """The TINY config as train.py builds it from configs/tiny_mqar.py and its overrides."""
  config = configs.tiny_mqar.get_config()
  for section, fields in TINY.items():
    config[section].update(fields)
  config.train.update(train_overrides)
  return config


def tiny_flags(**train_overrides) -> list:
  """The same config as train.py command-line overrides (--config.SECTION.FIELD=VALUE)."""
  fields = {**{f"{s}.{k}": v for s, kv in TINY.items() for k, v in kv.items()},
            **{f"train.{k}": v for k, v in train_overrides.items()}}
  return [f"--config.{name}={value}" for name, value in fields.items()]


def test_every_param_has_logical_axes_and_a_rule():
  model = LM(SMALL, rngs=nnx.Rngs(0))
  axes = sharding.logical_axes(model)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert jax.tree.structure(params) == jax.tree.structure(
      sharding.param_specs(axes), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert axes["embed"] == ("vocab", "embed")
  assert axes["block_0"]["attn"]["q_proj"] == ("embed", "heads")
  fsdp = sharding.rules_from_config({"embed": "data"})
  assert sharding.logical_to_spec(("vocab", "embed"), fsdp) == jax.sharding.PartitionSpec(
      None, "data")
  with pytest.raises(ValueError, match="unknown logical axes"):
    sharding.rules_from_config({"embedding": "data"})


def test_gla_layer_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"GatedLinearAttention: key dim 15 \(hidden_size \* "
                     r"expand_k\) must be positive and divisible by num_heads=4"):
    GatedLinearAttention(30, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="chunk_size must be a multiple of 16, got 24"):
    GatedLinearAttention(32, 2, chunk_size=24, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="seq_method must be one of"):
    GatedLinearAttention(32, 2, seq_method="pipeline", rngs=nnx.Rngs(0))


def test_layer_inside_a_user_jit_and_causal():
  """No mesh: plain chunk_gla. Changing tokens after t leaves logits before t unchanged."""
  model = LM(SMALL, rngs=nnx.Rngs(1))
  graphdef, params = nnx.split(model)

  @jax.jit
  def user_model(params, tokens):
    return jnp.tanh(nnx.merge(graphdef, params)(tokens))

  tokens = jax.random.randint(jax.random.key(0), (2, 48), 0, SMALL.vocab_size)
  changed = tokens.at[:, 30:].set((tokens[:, 30:] + 7) % SMALL.vocab_size)
  a, b = user_model(params, tokens), user_model(params, changed)
  assert a.shape == (2, 48, SMALL.vocab_size)
  np.testing.assert_array_equal(np.asarray(a[:, :30]), np.asarray(b[:, :30]))
  assert not np.allclose(np.asarray(a[:, 30:]), np.asarray(b[:, 30:]))


def test_short_conv_and_remat_variants():
  """Short convolution and per-block remat: same loss and gradients as without remat."""
  tokens = jax.random.randint(jax.random.key(2), (1, 32), 0, SMALL.vocab_size)

  def loss_and_grads(remat):
    cfg = GLAConfig(**{**SMALL.__dict__, "use_short_conv": True, "remat": remat})
    graphdef, params = nnx.split(LM(cfg, rngs=nnx.Rngs(0)))
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)

  (l0, g0), (l1, g1) = loss_and_grads(False), loss_and_grads(True)
  assert np.isfinite(float(l0)) and abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0))
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)


def _barriers(jaxpr):
  """Every optimization_barrier equation of a jaxpr, sub-jaxprs included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "optimization_barrier":
      out.append(eqn)
    for inner in sub_jaxprs(eqn):
      out += _barriers(inner)
  return out


def test_remat_recomputes_after_the_output_cotangent():
  """remat=True: each block's backward passes the block's input and the output cotangent
  (both [B, T, hidden]) through one optimization barrier before it recomputes (so XLA
  cannot hoist the recomputation; jax.checkpoint's barrier holds the input alone), and the
  input's cotangent with every parameter's gradient through another after (so no weight
  gradient is left for later)."""
  cfg = GLAConfig(**{**SMALL.__dict__, "remat": True})
  model = LM(cfg, rngs=nnx.Rngs(0))
  n_params = len(jax.tree.leaves(nnx.state(model.block_0)))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(3), (1, 32), 0, cfg.vocab_size)
  loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
  hidden = (1, 32, cfg.hidden_size)
  barriers = _barriers(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  n_hidden = [sum(tuple(v.aval.shape) == hidden for v in b.invars) for b in barriers]
  before = [b for b, n in zip(barriers, n_hidden) if n == 2]
  after = [b for b, n in zip(barriers, n_hidden) if n == 1 and len(b.invars) == n_params + 1]
  assert len(before) == len(after) == cfg.num_layers


@pytest.fixture(scope="module")
def per_mesh(devices):
  """For seq = 1, 4, 8: loss and grads on one batch, and the losses of 3 optimizer steps."""
  cfg = tiny_cfg(steps=3, warmup_steps=1)
  out = {}
  for mesh in ({"data": 1, "seq": 1}, {"data": 2, "seq": 4}, {"data": 1, "seq": 8}):
    exp = trainer.Experiment(cfg, trainer.make_mesh(mesh, devices[:mesh["data"] * mesh["seq"]]))
    data = Dataset(cfg.data.to_dict())
    state = exp.init_state()
    loss, _, grads = exp.loss_and_grad(state["params"], exp.put_batch(data.batch(0)))
    losses = []
    for step in range(3):
      state, metrics = exp.train_step(state, exp.put_batch(data.batch(step)))
      losses.append(float(metrics["loss"]))
    out[mesh["seq"]] = (float(loss), jax.device_get(grads), losses)
  return out


@pytest.mark.parametrize("seq", [4, 8])
def test_loss_and_grads_independent_of_seq_split(per_mesh, seq):
  loss1, grads1, _ = per_mesh[1]
  loss, grads, _ = per_mesh[seq]
  assert abs(loss - loss1) <= 1e-5 * abs(loss1)
  flat1 = jax.tree.leaves(grads1)
  flat = jax.tree.leaves(grads)
  assert rel_err(np.concatenate([g.ravel() for g in flat]),
                 np.concatenate([g.ravel() for g in flat1])) <= 1e-5
  for g, g1 in zip(flat, flat1):
    if np.linalg.norm(g1) > 1e-6 * max(np.linalg.norm(x) for x in flat1):
      assert rel_err(g, g1) <= 1e-4


@pytest.mark.parametrize("seq", [4, 8])
def test_optimizer_steps_independent_of_seq_split(per_mesh, seq):
  np.testing.assert_allclose(per_mesh[seq][2], per_mesh[1][2], rtol=1e-5)
