"""The training programs as module-level functions (MaxText's ``train.py`` keeps them so):
the loss, its gradient, one optimizer step and one evaluation step.

Each takes the parameters (or the train state) and a batch, plus a :class:`StepSpec`: the
frozen, hashable description of the model and loss it computes. :class:`trainer.Experiment`
binds a spec (and the optimizer) with ``functools.partial`` and jits them with explicit
shardings; the ahead-of-time path (:mod:`trainer.aot`) and the tests lower the same
functions. Nothing here reads a config or a mesh from module state.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import data as datamod
from zeco_jax.losses import linear_cross_entropy

# Device-side counters in the train state: the current run of skipped (non-finite) steps,
# and all skipped steps. Checkpoints written before they existed restore with zeros.
COUNTERS = ("bad_streak", "skipped_steps")


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """What the steps compute, hashable.

  Attributes:
    graphdef: the model's ``nnx.GraphDef`` (merged with the parameters in each step).
    compute_dtype: parameters are cast to it for the forward (float32 or bfloat16).
    loss_chunk_size: tokens per chunk of the cross-entropy (0: dense ``[B, T, vocab]``
      logits).
    mesh: the ``(data, seq)`` mesh the model runs on (its layers read ``seq``).
    token_spec: the batch's PartitionSpec entries (B over ``data``, T over ``seq``).
  """
  graphdef: object
  compute_dtype: object
  loss_chunk_size: int
  mesh: object
  token_spec: tuple


def masked_mean(nll, correct, batch):
  """Loss, accuracy and eval sums over ``mask`` from per-position NLL and correctness."""
  mask = batch["mask"]
  count = jnp.maximum(jnp.sum(mask), 1.0)
  return jnp.sum(nll * mask) / count, {"accuracy": jnp.sum(correct * mask) / count,
                                        "nll_sum": jnp.sum(nll * mask),
                                        "correct": jnp.sum(correct * mask), "count": count,
                                        "correct_at": correct}


def masked_loss(logits, batch):
  """Mean next-token NLL and accuracy over ``mask`` (float32), from dense logits."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
  return masked_mean(nll, correct, batch)


def chunked_masked_loss(hidden_BxTxD, head_VxD, batch, chunk_size: int, mesh=None,
                        token_spec=None):
  """:func:`masked_loss` of the logits ``hidden @ head.T`` without forming them:
  :func:`zeco_jax.losses.linear_cross_entropy`, ``chunk_size`` tokens at a time.

  On a mesh of more than one device it runs per shard (``jax.shard_map`` over the tokens'
  ``token_spec``, the head replicated): chunks of the flattened global tokens would make
  XLA gather the hidden states to every device. Each shard's tokens must then be a
  multiple of ``chunk_size`` (or fewer: one chunk).
  """
  def per_token(h_BxTxD, w, targets_BxT):
    B, T, D = h_BxTxD.shape
    nll, correct = linear_cross_entropy(h_BxTxD.reshape(B * T, D), w,
                                        targets_BxT.reshape(B * T),
                                        chunk_size=min(chunk_size, B * T))
    return nll.reshape(B, T), correct.reshape(B, T)

  if mesh is not None and mesh.size > 1:
    P = jax.sharding.PartitionSpec
    spec = P(*token_spec)
    # check_vma=False: JAX sums the replicated head's per-shard gradient over the mesh.
    per_token = jax.shard_map(per_token, mesh=mesh, in_specs=(P(*token_spec, None), P(), spec),
                              out_specs=(spec, spec), check_vma=False)
  nll, correct = per_token(hidden_BxTxD, head_VxD, batch["targets"])
  return masked_mean(nll, correct, batch)


def loss_fn(params, batch, *, spec: StepSpec):
  """``(loss, aux)`` of the model ``spec.graphdef`` with ``params`` on ``batch``."""
  if spec.compute_dtype != jnp.float32:
    params = jax.tree.map(lambda p: p.astype(spec.compute_dtype), params)
  model = nnx.merge(spec.graphdef, params)
  segment_ids = batch.get("segment_ids")
  if spec.loss_chunk_size:    # no [B, T, vocab] logits (docs/training.md)
    hidden = model.hidden(batch["inputs"], mesh=spec.mesh, segment_ids=segment_ids)
    return chunked_masked_loss(hidden, model.head_weight(), batch, spec.loss_chunk_size,
                               spec.mesh, spec.token_spec)
  logits = model(batch["inputs"], mesh=spec.mesh, segment_ids=segment_ids)
  return masked_loss(logits, batch)


def loss_and_grad(params, batch, *, spec: StepSpec):
  """``(loss, aux without the per-position correctness, grads)``."""
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, spec=spec)
  aux.pop("correct_at")
  return loss, aux, grads


def train_step(state, batch, *, spec: StepSpec, tx: optax.GradientTransformation,
               schedule):
  """One AdamW step; ``(new state, metrics)``.

  A step is applied only if its loss, gradient norm and new parameters are finite;
  otherwise params and optimizer state stay as they were and the counters of
  :data:`COUNTERS` record it (no host sync: they are read when the host syncs anyway).
  """
  loss, aux, grads = loss_and_grad(state["params"], batch, spec=spec)
  grad_norm = optax.tree_utils.tree_norm(grads)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  ok = (jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        & jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)])))
  keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  bad = jnp.logical_not(ok).astype(jnp.int32)
  new_state = {"params": keep_if_bad(params, state["params"]),
               "opt_state": keep_if_bad(opt_state, state["opt_state"]),
               "step": state["step"] + 1,
               "bad_streak": jnp.where(ok, 0, state["bad_streak"] + 1),
               "skipped_steps": state["skipped_steps"] + bad}
  metrics = {"loss": loss, "accuracy": aux["accuracy"], "grad_norm": grad_norm,
             "lr": schedule(state["step"]), "skipped": bad,
             "skipped_steps": new_state["skipped_steps"], "bad_streak": new_state["bad_streak"]}
  return new_state, metrics


def eval_step(params, batch, *, spec: StepSpec):
  """Loss sums and counts over ``batch``, and the accuracy on the queries of each mask of
  ``models.data.EVAL_MASKS`` the batch has."""
  aux = loss_fn(params, batch, spec=spec)[1]
  correct = aux.pop("correct_at")           # [B, T]: argmax == target
  for name in datamod.EVAL_MASKS:           # cross-shard queries, stale queries
    if name in batch:
      aux[f"{name}_correct"] = jnp.sum(correct * batch[name])
      aux[f"{name}_count"] = jnp.sum(batch[name])
  return aux
