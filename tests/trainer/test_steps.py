"""The trainer's steps (trainer/steps.py through trainer.Experiment) do not depend on how
the sequence is split: loss and gradients of one batch, and the losses of 3 optimizer
steps, at seq = 1, 4, 8; the chunked cross-entropy (train.loss_chunk_size, per shard) on a
data=2 x seq=4 mesh equals the dense-logits path."""
import jax
import numpy as np
import pytest

import configs
import trainer
from helpers import rel_err, tiny_cfg
from models.data import Dataset


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


def _tiny_config(chunk, mesh="data=1,seq=1"):
  cfg = configs.defaults()
  cfg.model.update(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2)
  cfg.train.update(compute_dtype="float32", steps=4, warmup_steps=1, loss_chunk_size=chunk)
  cfg.data.update(kind="mqar", seq_len=128, batch_size=2, num_keys=8, num_pairs=2,
                  num_queries=4, query_window=16)
  cfg.mesh = mesh
  return cfg


def test_trainer_chunked_loss_matches_dense_logits_on_a_mesh():
  """The trainer's loss, accuracy and gradients with train.loss_chunk_size (per shard, under
  shard_map, on data=2 x seq=4) equal the dense-logits path."""
  rng = np.random.default_rng(5)
  inputs = rng.integers(0, 64, (2, 128)).astype(np.int32)
  batch = {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1),
           "mask": rng.uniform(size=(2, 128)).astype(np.float32)}
  out = []
  for chunk in (0, 16):
    exp = trainer.Experiment(_tiny_config(chunk, "data=2,seq=4"),
                             trainer.make_mesh({"data": 2, "seq": 4}))
    state = exp.init_state()
    out.append(exp.loss_and_grad(state["params"], exp.put_batch(batch)))
  (loss0, aux0, g0), (loss1, aux1, g1) = out
  assert rel_err(loss1, loss0) <= 1e-5, "loss"
  assert rel_err(aux1["accuracy"] + 1.0, aux0["accuracy"] + 1.0) <= 1e-6, "accuracy"
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert rel_err(a, b) <= 1e-4, "grads"
