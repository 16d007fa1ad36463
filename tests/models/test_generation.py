"""Generation with the LM (models.lm.LM.prefill / decode / generate / score): greedy tokens
equal the argmax of the model's teacher-forced logits at every step, for both families
and a hybrid (its attention block decodes from a KV cache);
the same seed draws the same tokens, and top_k = 1 or a tiny top_p is greedy; prompts
padded left or right continue as the unpadded prompt alone; generation stops per row at
EOS; the prefill over data=2 x seq=4 gives one device's next-token logits and caches;
score is the teacher-forced log-likelihood. Bars (relative norm, float32): 1e-5."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import rel_err
from models import GDNConfig, GLAConfig, KDAConfig, LM
from models.generation import Sampling

pytestmark = pytest.mark.usefixtures("compile_cache")

CONFIGS = {
    "gla": GLAConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2,
                     use_short_conv=True, expand_k=1.0),
    "gdn": GDNConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2,
                     use_short_conv=True, expand_k=1.0, expand_v=1.0),
    "kda": KDAConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2,
                     use_short_conv=True, expand_k=1.0, expand_v=1.0),
    # A hybrid: a GLA block, then softmax attention with grouped key heads (a KV cache).
    "hybrid": GLAConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2,
                        use_short_conv=True, expand_k=1.0, layer_pattern="LA",
                        attn_num_heads=4, attn_num_kv_heads=2),
}


@functools.lru_cache(maxsize=None)
def model(family):
  return LM(CONFIGS[family], rngs=nnx.Rngs(0))


def prompt(seed, B=3, T=37):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, 64)


@pytest.mark.parametrize("family", CONFIGS)
def test_greedy_tokens_are_the_teacher_forced_argmax(family):
  m, p = model(family), prompt(0)
  tokens, lengths = m.generate(p, max_new_tokens=10)
  logits = m(jnp.concatenate([p, tokens], 1))
  assert np.array_equal(np.asarray(jnp.argmax(logits[:, p.shape[1] - 1:-1], -1)),
                        np.asarray(tokens))
  assert np.array_equal(np.asarray(lengths), [10, 10, 10])


@pytest.mark.parametrize("family", CONFIGS)
def test_score_is_the_teacher_forced_log_likelihood(family):
  m, t = model(family), prompt(1, T=48)
  want = jnp.take_along_axis(jax.nn.log_softmax(m(t)[:, :-1]), t[:, 1:, None], -1)[..., 0]
  got = m.score(t)
  assert np.all(np.asarray(got[:, 0]) == 0)
  assert rel_err(got[:, 1:], want) <= 1e-5
  assert rel_err(m.score(t, chunk_size=3 * 47)[:, 1:], want) <= 1e-5
  ids = jnp.asarray(np.repeat([[0] * 20 + [1] * 28], 3, 0).astype(np.int32))
  scored = m.score(t, segment_ids=ids)
  assert np.all(np.asarray(scored[:, 20]) == 0)     # a document's first token: no context


def test_sampling_is_seeded_and_its_cuts_work():
  m, p = model("gla"), prompt(2)
  sample = lambda **kw: np.asarray(m.generate(p, max_new_tokens=8, **kw)[0])
  a = sample(temperature=1.0, top_k=10, top_p=0.9, seed=3)
  assert np.array_equal(a, sample(temperature=1.0, top_k=10, top_p=0.9, seed=3))
  assert not np.array_equal(a, sample(temperature=1.0, top_k=10, top_p=0.9, seed=4))
  # top_k = 1 or a tiny top_p is greedy: on 64 rows of random logits of the vocabulary's
  # size, the draws are the argmax (both cuts inside generate: the draws above).
  rows = jax.random.normal(jax.random.key(7), (64, 64))
  for cut in (Sampling(1.0, top_k=1), Sampling(1.0, top_p=1e-6)):
    assert np.array_equal(np.asarray(cut.sample(rows, jax.random.key(5))),
                          np.asarray(jnp.argmax(rows, axis=-1))), cut
  logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0]])
  drawn = {int(Sampling(1.0, top_k=2).sample(logits, jax.random.key(i))[0]) for i in range(64)}
  assert drawn == {2, 3}


@pytest.mark.parametrize("family", ["gdn", "hybrid"])
def test_padded_prompts_and_eos(family):
  m, p = model(family), prompt(3)
  mask = np.ones(p.shape, bool)
  mask[1, :10] = False            # left padding
  mask[2, -10:] = False           # right padding
  # The prompts alone: row 0 as it is, rows 1 and 2 (27 tokens each) in one batch.
  want = [np.asarray(m.generate(p[0:1], max_new_tokens=6)[0][0]),
          *np.asarray(m.generate(jnp.stack([p[1, 10:], p[2, :-10]]), max_new_tokens=6)[0])]
  # pad_id (static) as in the EOS run below: one program for both (without an EOS no row
  # stops, so nothing is padded).
  got, _ = m.generate(p, prompt_mask=jnp.asarray(mask), max_new_tokens=6, pad_id=-7)
  assert np.array_equal(np.asarray(got), np.stack(want))
  eos = int(want[0][2])
  stopped, lengths = m.generate(p, prompt_mask=jnp.asarray(mask), max_new_tokens=6,
                                eos_id=eos, pad_id=-7)
  first = [int(np.argmax(w == eos)) + 1 if np.any(w == eos) else 6 for w in want]
  assert np.array_equal(np.asarray(lengths), first)
  for row, n in enumerate(first):
    assert np.array_equal(np.asarray(stopped[row, :n]), want[row][:n])
    assert np.all(np.asarray(stopped[row, n:]) == -7)


@pytest.mark.parametrize("family", CONFIGS)
def test_prefill_on_a_mesh_equals_one_device(family, devices):
  m = model(family)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), devices=devices)
  p = prompt(4, B=2, T=64)
  ids = jnp.asarray(np.where(np.arange(64) < 9, -1, 0)[None].repeat(2, 0).astype(np.int32))
  graphdef, state = nnx.split(m)
  run = lambda mesh: jax.jit(lambda p, ids: nnx.merge(graphdef, state).prefill(p, mesh, ids))
  logits, caches = run(None)(p, ids)
  logits_m, caches_m = run(mesh)(p, ids)
  assert rel_err(logits_m, logits) <= 1e-5
  for got, want in zip(jax.tree.leaves(caches_m), jax.tree.leaves(caches)):
    assert rel_err(got, want) <= 1e-5


def test_bad_arguments_name_themselves():
  m = model("gla")
  with pytest.raises(ValueError, match="empty"):
    m.generate(jnp.zeros((1, 0), jnp.int32), max_new_tokens=4)
  with pytest.raises(ValueError, match="prompt_mask"):
    m.generate(prompt(0), prompt_mask=jnp.ones((3, 5), bool), max_new_tokens=4)
  with pytest.raises(ValueError, match="no prompt token"):
    m.generate(prompt(0), prompt_mask=jnp.zeros((3, 37), bool), max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    m.generate(prompt(0), max_new_tokens=0)
  with pytest.raises(ValueError, match="top_p"):
    m.generate(prompt(0), max_new_tokens=2, temperature=1.0, top_p=0.0)
