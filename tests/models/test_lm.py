"""The shared LM (models/lm.py) with each family's blocks: inside a user's jit and causal,
short convolution and per-block remat (same loss and gradients; the backward's barriers),
a reset at every document start, and the Gated DeltaNet LM picked by ``model.family`` on 4
sequence shards equal to one device on packed documents."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import GDN_SHARD_DOC_IDS, find_eqns, rel_err, seq_mesh, tiny_model_config
from models import LM, GDNConfig, KDAConfig, model_from_config

SMALL = tiny_model_config()


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
    cfg = tiny_model_config(use_short_conv=True, remat=remat)
    graphdef, params = nnx.split(LM(cfg, rngs=nnx.Rngs(0)))
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)

  (l0, g0), (l1, g1) = loss_and_grads(False), loss_and_grads(True)
  assert np.isfinite(float(l0)) and abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0))
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)


def test_remat_recomputes_after_the_output_cotangent():
  """remat=True: each block's backward passes the block's input and the output cotangent
  (both [B, T, hidden]) through one optimization barrier before it recomputes (so XLA
  cannot hoist the recomputation; jax.checkpoint's barrier holds the input alone), and the
  input's cotangent with every parameter's gradient through another after (so no weight
  gradient is left for later)."""
  cfg = tiny_model_config(remat=True)
  model = LM(cfg, rngs=nnx.Rngs(0))
  n_params = len(jax.tree.leaves(nnx.state(model.block_0)))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(3), (1, 32), 0, cfg.vocab_size)
  loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
  hidden = (1, 32, cfg.hidden_size)
  barriers = find_eqns(jax.make_jaxpr(jax.grad(loss))(params), "optimization_barrier")
  n_hidden = [sum(tuple(v.aval.shape) == hidden for v in b.invars) for b in barriers]
  before = [b for b, n in zip(barriers, n_hidden) if n == 2]
  after = [b for b, n in zip(barriers, n_hidden) if n == 1 and len(b.invars) == n_params + 1]
  assert len(before) == len(after) == cfg.num_layers


def test_model_resets_at_document_starts():
  """No mesh (chunk_gla): logits of a row's second document equal those of it alone (the
  model jitted; its jnp code runs eagerly in tests/models/test_generation.py)."""
  cfg = tiny_model_config(num_layers=1, use_short_conv=True)
  model = LM(cfg, rngs=nnx.Rngs(0))
  forward = jax.jit(lambda tokens, segment_ids: model(tokens, segment_ids=segment_ids))
  tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, 64)
  seg = jnp.asarray(np.repeat([[1] * 21 + [2] * 43], 2, 0), jnp.int32)
  packed = forward(tokens, seg)
  alone = forward(tokens[:, 21:], None)
  np.testing.assert_allclose(packed[:, 21:], alone, rtol=1e-5, atol=1e-5)
  no_reset = forward(tokens, None)
  assert float(jnp.max(jnp.abs(no_reset[:, 21:] - alone))) > 1e-3   # no reset: differs


@pytest.mark.parametrize("family,extra,config_cls", [
    ("gdn", {}, GDNConfig), ("kda", {"kda_lower_bound": -5.0}, KDAConfig)])
def test_delta_lm_on_four_seq_shards_matches_one_device(family, extra, config_cls):
  # The LMs of configs/gdn_*.py and configs/kda_*.py (models/gdn.py, models/kda.py), picked
  # by model.family: logits and parameter gradients through zeco_gated_delta_rule / zeco_kda
  # on 4 seq shards equal those of the single-device chunked op, on packed documents (short
  # convolutions and states reset); KDA with FLA's bounded gate.
  cfg, cls = model_from_config(dict(family=family, vocab_size=32, hidden_size=32,
                                    num_layers=1, num_heads=2, expand_k=0.5, expand_v=1.0,
                                    intermediate_size=64, chunk_size=16, use_short_conv=True,
                                    **extra))
  assert cls is LM and type(cfg) is config_cls and cfg.head_dim == 8
  graphdef, params = nnx.split(cls(cfg, rngs=nnx.Rngs(0)))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 64)), jnp.int32)
  ids = jnp.asarray(GDN_SHARD_DOC_IDS)

  def loss(params, mesh, segment_ids):
    logits = nnx.merge(graphdef, params)(tokens, mesh=mesh, segment_ids=segment_ids)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, one), g_one = grad(params, None, ids)
  (_, four), g_four = grad(params, seq_mesh(4), ids)
  assert rel_err(four, one) <= 1e-5
  for a, b in zip(jax.tree.leaves(g_four), jax.tree.leaves(g_one)):
    assert rel_err(a, b) <= 1e-4
