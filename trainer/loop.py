"""The trainer behind ``train.py``: state, steps, evaluation and the loop.

:class:`Experiment` holds everything compiled for one (model, optimizer, mesh, batch
shape): the parameter and optimizer-state shardings derived from the logical-axis rule
table (``models/sharding.py``), and three ``jax.jit`` programs with explicit in/out
shardings: ``train_step`` (AdamW, warmup + cosine decay, gradient clipping, optional bf16
compute with float32 params), ``eval_step`` and ``loss_and_grad``. Batches have B over
``data`` and T over ``seq``.

:func:`train_and_evaluate` runs a config in a workdir: orbax checkpoints (every N steps,
keep k, async, atomic; :mod:`checkpointing`) and resume from the newest checkpoint that
restores; the MQAR data of step s is a function of (seed, s), and text comes from grain
iterators whose state is saved in the same checkpoint, so a resumed run continues exactly.
Packed documents carry ``segment_ids``, passed to the model; their loss mask already
excludes predictions across a document boundary (``models/text.py``). Each process builds
only its own rows and tokens of every batch; process 0 writes the metrics (:mod:`metrics`)
and prints.

What it guards against (each ends in one line, a :class:`RunError` with its exit code):
a step whose loss or gradient norm is not finite is not applied (the jitted step keeps the
old parameters and optimizer state and counts it on the device; the host reads the count
only when it syncs anyway: logging, saving); a checkpoint is saved only when the last step
was applied, and ``train.max_bad_steps`` skipped steps in a row stop the run
(:class:`Diverged`). A checkpoint that does not restore is moved to
``WORKDIR/corrupt_checkpoints`` and the next older one is used; a checkpoint of another
model (shapes differ) or past ``train.steps`` stops before anything compiles.

What it does not do: pipeline or tensor parallelism; choose devices or start processes
(``train.py`` does, through ``zeco_jax.distributed``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

import checkpointing
import configs
import metrics
from models import GLALM, GLAConfig, sharding
from models.gdn import model_from_config
from models import data as datamod
from models.data import Dataset
from zeco_jax import distributed
from zeco_jax.losses import linear_cross_entropy


class RunError(RuntimeError):
  """A run that cannot go on; the message is one line and ``train.py`` exits ``exit_code``."""
  exit_code = 1


class DataError(RunError):
  """The corpus cannot be read as documents; the message says which file and line."""

  def __str__(self):
    return f"data error: {super().__str__()}"


class Diverged(RunError):
  """``train.max_bad_steps`` steps in a row had a non-finite loss or gradient norm."""
  exit_code = 3


# Device-side counters in the train state: the current run of skipped (non-finite) steps,
# and all skipped steps. Checkpoints written before they existed restore with zeros.
COUNTERS = ("bad_streak", "skipped_steps")


def make_mesh(shape: dict, devices=None) -> jax.sharding.Mesh:
  """A ``(data, seq)`` mesh with Auto axes (jit + GSPMD outside the seq shard_map)."""
  axis_types = (jax.sharding.AxisType.Auto,) * 2
  kwargs = {} if devices is None else {"devices": devices}
  return jax.make_mesh((shape["data"], shape["seq"]), ("data", "seq"), axis_types=axis_types,
                       **kwargs)


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


def masked_mean(nll, correct, batch):
  """Loss, accuracy and eval sums over ``mask`` from per-position NLL and correctness."""
  mask = batch["mask"]
  count = jnp.maximum(jnp.sum(mask), 1.0)
  return jnp.sum(nll * mask) / count, {"accuracy": jnp.sum(correct * mask) / count,
                                        "nll_sum": jnp.sum(nll * mask),
                                        "correct": jnp.sum(correct * mask), "count": count,
                                        "correct_at": correct}


class Experiment:
  """Everything compiled for one (model, optimizer, mesh, batch shape): built once, reused."""

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    self.config, self.mesh = config, mesh
    self.model_cfg, self.model_cls = model_from_config(config.model.to_dict())  # gla | gdn
    train = config.train
    if train.loss_chunk_size and not hasattr(self.model_cls, "hidden"):
      raise ValueError(f"train.loss_chunk_size={train.loss_chunk_size} needs a model with "
                       f"hidden() and head_weight() ({self.model_cls.__name__} has none); "
                       "set --config.train.loss_chunk_size=0 (dense logits)")
    self.rules = sharding.rules_from_config(train.sharding_rules.to_dict())
    self.batch_sharding = sharding.batch_sharding(mesh, self.rules)
    batch_axes = self.batch_sharding.spec[0] if len(self.batch_sharding.spec) else None
    if batch_axes is not None and getattr(self.model_cfg, "batch_axes", None) is None:
      # B is split over `batch_axes`: the GLA kernels run per shard of it (the compiler
      # cannot partition a kernel), so the layer must know (zeco_jax.nn.gla_op).
      self.model_cfg = dataclasses.replace(self.model_cfg, batch_axes=batch_axes)
    abstract = nnx.eval_shape(lambda: self.model_cls(self.model_cfg, rngs=nnx.Rngs(0)))
    self.graphdef, _ = nnx.split(abstract)
    self.axes = sharding.logical_axes(abstract)
    self.param_shardings = sharding.param_shardings(self.axes, mesh, self.rules)
    self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.compute_dtype = jnp.dtype(train.compute_dtype)

    self.schedule = optax.warmup_cosine_decay_schedule(
        0.0, train.lr, train.warmup_steps, train.steps, end_value=train.lr * train.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no norms/biases
    self.tx = optax.chain(
        optax.clip_by_global_norm(train.grad_clip),
        optax.adamw(self.schedule, b1=train.b1, b2=train.b2, weight_decay=train.weight_decay,
                    mask=decay_mask))

    seed, model_cfg, model_cls = train.seed, self.model_cfg, self.model_cls

    def init_params():
      return nnx.to_pure_dict(nnx.state(model_cls(model_cfg, rngs=nnx.Rngs(seed)), nnx.Param))

    abstract_params = jax.eval_shape(init_params)
    abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract_opt,
        self.param_shardings, transform_non_params=lambda _: self.replicated)
    self.state_shardings = {"params": self.param_shardings, "opt_state": opt_shardings,
                            "step": self.replicated,
                            **{name: self.replicated for name in COUNTERS}}
    # segment_ids (packed documents, int32 [B, T]) ride with the tokens: B over data, T
    # over seq; the model gets them when the data has them (models/data.py batch_keys).
    self.batch_keys = datamod.batch_keys(config.data)
    self.eval_keys = datamod.eval_keys(config.data)
    batch_shardings = {k: self.batch_sharding for k in self.batch_keys}

    self._init_params = init_params
    self._init_opt = jax.jit(self.tx.init, out_shardings=opt_shardings)
    self.abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        {"params": abstract_params, "opt_state": abstract_opt,
         "step": jax.ShapeDtypeStruct((), jnp.int32),
         **{name: jax.ShapeDtypeStruct((), jnp.int32) for name in COUNTERS}},
        self.state_shardings)

    def loss_fn(params, batch):
      if self.compute_dtype != jnp.float32:
        params = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
      model = nnx.merge(self.graphdef, params)
      if train.loss_chunk_size:    # no [B, T, vocab] logits (docs/training.md)
        hidden = model.hidden(batch["inputs"], mesh=mesh, segment_ids=batch.get("segment_ids"))
        return chunked_masked_loss(hidden, model.head_weight(), batch, train.loss_chunk_size,
                                   mesh, tuple(self.batch_sharding.spec))
      logits = model(batch["inputs"], mesh=mesh, segment_ids=batch.get("segment_ids"))
      return masked_loss(logits, batch)

    def loss_and_grad(params, batch):
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
      aux.pop("correct_at")
      return loss, aux, grads

    def train_step(state, batch):
      loss, aux, grads = loss_and_grad(state["params"], batch)
      grad_norm = optax.tree_utils.tree_norm(grads)
      updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      # A step is applied only if its loss, gradient norm and new parameters are finite;
      # otherwise params and optimizer state stay as they were (no host sync: the counters
      # are read when the host syncs anyway).
      ok = (jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            & jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)])))
      keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
      bad = jnp.logical_not(ok).astype(jnp.int32)
      new_state = {"params": keep_if_bad(params, state["params"]),
                   "opt_state": keep_if_bad(opt_state, state["opt_state"]),
                   "step": state["step"] + 1,
                   "bad_streak": jnp.where(ok, 0, state["bad_streak"] + 1),
                   "skipped_steps": state["skipped_steps"] + bad}
      step_metrics = {"loss": loss, "accuracy": aux["accuracy"], "grad_norm": grad_norm,
                      "lr": self.schedule(state["step"]), "skipped": bad,
                      "skipped_steps": new_state["skipped_steps"],
                      "bad_streak": new_state["bad_streak"]}
      return new_state, step_metrics

    def eval_step(params, batch):
      aux = loss_fn(params, batch)[1]
      correct = aux.pop("correct_at")           # [B, T]: argmax == target
      for name in datamod.EVAL_MASKS:           # cross-shard queries, stale queries
        if name in batch:
          aux[f"{name}_correct"] = jnp.sum(correct * batch[name])
          aux[f"{name}_count"] = jnp.sum(batch[name])
      return aux

    self.loss_and_grad = jax.jit(loss_and_grad,
                                 in_shardings=(self.param_shardings, batch_shardings),
                                 out_shardings=(self.replicated, self.replicated,
                                                self.param_shardings))
    self.train_step = jax.jit(train_step, in_shardings=(self.state_shardings, batch_shardings),
                              out_shardings=(self.state_shardings, self.replicated),
                              donate_argnums=0)
    self.eval_step = jax.jit(eval_step, in_shardings=(
        self.param_shardings, {k: self.batch_sharding for k in self.eval_keys}),
        out_shardings=self.replicated)

  def init_state(self) -> dict:
    """Fresh train state, placed with ``state_shardings``.

    The parameters are built eagerly on the host CPU (op by op, deterministic, the same
    values on every process) and then placed shard by shard: one jit of the whole model's
    initialisers took 26 s to compile on CPU for gla_340m and longer than the run's budget
    on the H200. The optimizer state (zeros) is one small jit with the right shardings.
    """
    try:
      where = jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:          # JAX_PLATFORMS without cpu: eager on the default device
      where = contextlib.nullcontext()
    with where:
      host = jax.tree.map(np.asarray, self._init_params())
    place = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
    params = jax.tree.map(place, host, self.param_shardings)
    return {"params": params, "opt_state": self._init_opt(params),
            "step": place(np.zeros((), np.int32), self.replicated),
            **{name: place(np.zeros((), np.int32), self.replicated) for name in COUNTERS}}

  def local_index(self, global_shape) -> tuple:
    """(rows, tokens): the part of a ``[B, T]`` global batch this process's devices hold."""
    return distributed.process_local_index(global_shape, self.mesh, self.batch_sharding)

  def put_batch(self, local_rows: dict, global_shape=None) -> dict:
    """This process's rows (full length) -> global arrays with B over ``data``, T over ``seq``.

    ``global_shape`` ``(B, T)`` defaults to the rows' own shape (one process: the whole batch).
    """
    if global_shape is None:
      global_shape = next(iter(local_rows.values())).shape
    tokens = self.local_index(global_shape)[1]
    return distributed.global_batch({k: v[:, tokens] for k, v in local_rows.items()},
                                    self.mesh, self.batch_sharding,
                                    global_shape={k: tuple(global_shape) for k in local_rows})


def evaluate(exp: Experiment, dataset: Dataset, params, num_batches: int) -> dict:
  """Loss and accuracy over ``num_batches`` held-out batches, and the accuracy on the
  queries of each mask of ``models.data.EVAL_MASKS`` the data has (cross-shard queries;
  for ``mqar_docs`` the stale queries: how often the previous document's value is given)."""
  totals = None
  shape = (dataset.cfg["batch_size"], dataset.cfg["seq_len"])
  for i in range(num_batches):
    batch = dataset.eval_batch(i, num_shards=exp.mesh.shape["seq"],
                               rows=exp.local_index(shape)[0])
    out = exp.eval_step(params, exp.put_batch(batch, shape))
    out = {k: float(v) for k, v in jax.device_get(out).items()}
    totals = out if totals is None else {k: totals[k] + out[k] for k in out}
  result = {"eval_loss": totals["nll_sum"] / totals["count"],
            "eval_accuracy": totals["correct"] / totals["count"],
            "eval_queries": int(totals["count"])}
  for name, (metric, count) in datamod.EVAL_MASKS.items():
    if totals.get(f"{name}_count"):
      result[metric] = totals[f"{name}_correct"] / totals[f"{name}_count"]
      result[count] = int(totals[f"{name}_count"])
  return result


def _eval_line(step: int, ev: dict) -> str:
  cross = (f" (cross-shard queries: {ev['eval_cross_shard_accuracy']:.4f} of "
           f"{ev['eval_cross_shard_queries']})" if "eval_cross_shard_accuracy" in ev else "")
  if "eval_stale_recall" in ev:
    cross += (f" (previous document's value given on {ev['eval_stale_recall']:.4f} of "
              f"{ev['eval_stale_queries']} stale queries)")
  return f"step {step}: eval loss {ev['eval_loss']:.4f} accuracy {ev['eval_accuracy']:.4f}{cross}"


def _warn(text: str) -> None:
  """A line that must be seen whatever ``progress`` says (stderr, process 0)."""
  if distributed.is_main_process():
    print(text, file=sys.stderr, flush=True)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       progress: str = "bar") -> dict:
  """Trains (or resumes) per ``config`` in ``workdir``; returns a summary of the run.

  Args:
    config: a config of :mod:`configs` (validated here against the devices).
    workdir: ``checkpoints/``, ``metrics.jsonl``, ``tensorboard/``, ``loss.png`` and
      ``config.json`` go here; a workdir with checkpoints resumes from the newest one that
      restores.
    progress: "bar" (tqdm), "lines" (plain log lines) or "off" (nothing printed but
      warnings, on stderr).

  Returns:
    ``start_step``, ``step``, ``losses`` (step -> loss of this invocation), ``evals``,
    ``final_eval``, ``wall_s``, ``compile_s``, ``tokens_per_s`` (steady state),
    ``num_params``, ``skipped_steps`` (non-finite steps not applied, all runs),
    ``skipped_checkpoints`` (step -> reason) and ``state`` (the final train state).

  Raises:
    RunError: a checkpoint of another model, none that restores, or one past
      ``train.steps`` / ``train.stop_after``.
    Diverged: ``train.max_bad_steps`` steps in a row were not finite.
  """
  devices = jax.devices()
  mesh_shape = configs.validate(config, len(devices))
  train, data_cfg = config.train, config.data.to_dict()
  new_workdir = not os.path.exists(workdir)
  os.makedirs(workdir, exist_ok=True)
  main_process = distributed.is_main_process()   # the one process that writes and prints
  if not main_process:
    progress = "off"
  say = (lambda text: print(text, flush=True)) if progress != "off" else (lambda text: None)
  exp = Experiment(config, make_mesh(mesh_shape))
  try:
    dataset = Dataset(data_cfg, vocab_size=config.model.vocab_size, workdir=workdir,
                      write=main_process)
  except ValueError as e:         # the corpus (models/text.py says what it checks)
    if new_workdir and main_process:   # a run that never started leaves no workdir
      shutil.rmtree(workdir, ignore_errors=True)
    raise DataError(str(e)) from e
  for text in dataset.warnings:
    _warn(f"data: {text}")
  mngr = checkpointing.checkpoint_manager(workdir, train)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  stop = min(train.steps, train.stop_after or train.steps)
  summary = {"evals": {}, "skipped_checkpoints": {}, "workdir": workdir}

  with checkpointing.quiet_closed_event_loops():
    try:
      restored, state, skipped = (
          checkpointing.restore_checkpoint(mngr, exp.abstract_state, workdir, config,
                                           optional=COUNTERS, data=dataset.stateful)
          if mngr is not None else (None, None, []))
    except checkpointing.CheckpointError as e:   # another model, or none restores
      raise RunError(str(e)) from e
    moved = (checkpointing.set_aside(mngr, workdir, [s for s, _ in skipped])
             if skipped else {})
  if skipped:
    for s, why in skipped:
      summary["skipped_checkpoints"][s] = why
      _warn(f"checkpoint step {s} in {ckpt_dir} does not restore ({why}): skipped, moved to "
            f"{moved.get(s, 'nowhere (not found)')}; resuming from step {restored}")
  data_state = state.pop("data", None) if state is not None else None
  if restored is not None:
    say(f"resumed from {ckpt_dir} step {restored}")
    for limit, name in ((train.steps, "train.steps"), (train.stop_after, "train.stop_after")):
      if limit is not None and restored > limit:
        mngr.close()
        raise RunError(f"checkpoint at step {restored} in {ckpt_dir} is past {name} = "
                       f"{limit}: nothing to train; raise --config.{name} (or use a new "
                       "--workdir)")
    if restored >= stop:
      mngr.close()
      name = "train.steps" if stop == train.steps else "train.stop_after"
      _warn(f"nothing to train: checkpoint at step {restored} in {ckpt_dir} is already at "
            f"{name} = {stop}; raise --config.{name} to train further")
      summary.update({"start_step": restored, "step": restored, "losses": {}, "wall_s": 0.0,
                      "compile_s": None, "num_params": None, "tokens_per_s": None,
                      "skipped_steps": int(jax.device_get(state["skipped_steps"])),
                      "state": state})
      return summary
  else:
    state = exp.init_state()
  checkpointing.write_config(workdir, config)
  start, skipped_before = (int(x) for x in jax.device_get((state["step"],
                                                            state["skipped_steps"])))
  summary["start_step"] = start
  tokens_per_step = data_cfg["batch_size"] * data_cfg["seq_len"]
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  say(f"{workdir}: {n_params / 1e6:.2f}M params, mesh data={mesh_shape['data']} "
      f"seq={mesh_shape['seq']} on {len(devices)} {devices[0].platform} devices, "
      f"batch {data_cfg['batch_size']} x {data_cfg['seq_len']} tokens, steps {start}->{stop}")

  bar = metrics.Progress(stop, start, progress)
  # A resumed run writes the steps after `start` again: rows past it (from the steps after
  # the restored checkpoint that a killed run had logged) are dropped first.
  writer = metrics.MetricWriter(workdir, enabled=main_process, keep_through=start)
  losses, pending = {}, []
  t_start = time.time()
  t_window, window_steps, compile_s, steady = time.time(), 0, None, []
  last_saved = restored       # the newest checkpoint of finite, applied steps

  def log_eval(step):
    ev = evaluate(exp, dataset, state["params"], train.eval_batches)
    writer.write(step, ev)
    writer.flush()
    bar.write(_eval_line(step, ev))
    return ev

  def check_divergence(bad_streak: int, done: int) -> None:
    if bad_streak < train.max_bad_steps:
      return
    kept = (f"the last finite checkpoint, step {last_saved} in {ckpt_dir}, is kept"
            if last_saved is not None else
            "no checkpoint was saved" + ("" if mngr is not None else
                                         " (train.checkpoint_every=0)"))
    raise Diverged(f"diverged: the {bad_streak} steps to step {done} had a non-finite loss "
                   f"or gradient norm and were not applied (train.max_bad_steps = "
                   f"{train.max_bad_steps}); {kept}. Rerun with a lower --config.train.lr "
                   "(or --config.train.grad_clip) to resume from it.")

  global_shape = (data_cfg["batch_size"], data_cfg["seq_len"])
  my_rows = exp.local_index(global_shape)[0]      # this process builds only these rows
  if dataset.stateful and start:    # text: the iterators continue where the checkpoint was
    if data_state is None:
      raise RunError(f"checkpoint step {start} in {ckpt_dir} has no data iterator state "
                     f"(written by a run of another data.kind?); data.kind="
                     f"{data_cfg['kind']!r} reads in order and cannot resume without it. "
                     "Use a new --workdir.")
    try:
      dataset.restore(data_state, my_rows)
    except ValueError as e:
      raise RunError(f"checkpoint step {start} in {ckpt_dir}: {e}") from e
  next_batch = dataset.batch(start, my_rows) if start < stop else None
  try:
    for step in range(start, stop):
      batch = exp.put_batch(next_batch, global_shape)
      state, step_metrics = exp.train_step(state, batch)
      if step + 1 < stop:
        next_batch = dataset.batch(step + 1, my_rows)   # host work overlaps the async step
      pending.append((step + 1, step_metrics))
      done = step + 1
      if compile_s is None:
        jax.block_until_ready(step_metrics)
        compile_s = time.time() - t_window
        bar.write(f"first step (compile included): {compile_s:.1f}s")
        t_window = time.time()
      else:
        window_steps += 1
      if done % train.log_every == 0 or done == stop:
        rows = jax.device_get([m for _, m in pending])
        now = time.time()
        tok_s = (tokens_per_step * window_steps / max(now - t_window, 1e-9)
                 if window_steps else 0.0)
        if window_steps:
          steady.append((window_steps, now - t_window))
        for (s, _), row in zip(pending, rows):
          row = {k: (int(v) if k in ("skipped", "skipped_steps") else float(v))
                 for k, v in row.items() if k != "bad_streak"}
          losses[s] = row["loss"]
          writer.write(s, {**row, "tokens_per_s": tok_s, "elapsed_s": now - t_start})
        writer.flush()
        info = {"loss": float(rows[-1]["loss"]), "tok/s": f"{tok_s:,.0f}"}
        if data_cfg["kind"] != "text":
          info["acc"] = float(rows[-1]["accuracy"])
        if rows[-1]["skipped_steps"]:
          info["skipped"] = int(rows[-1]["skipped_steps"])
        bar.update(done, len(pending), info)
        pending, t_window, window_steps = [], time.time(), 0
        check_divergence(int(rows[-1]["bad_streak"]), done)
      if mngr is not None and (done % train.checkpoint_every == 0 or done == stop):
        bad_streak = int(jax.device_get(state["bad_streak"]))   # never save a skipped step
        check_divergence(bad_streak, done)
        if bad_streak:
          _warn(f"checkpoint: step {done} not saved: its last {bad_streak} step(s) had a "
                "non-finite loss or gradient norm")
        else:
          checkpointing.save(mngr, done, state, force=done == stop, data_state=(
              checkpointing.gather_data_state(dataset.state(done)) if dataset.stateful
              else None))
          last_saved = done
          bar.write(f"checkpoint: step {done} save started")   # the async write is in flight
      if train.eval_every and done % train.eval_every == 0 and done != stop:
        summary["evals"][done] = log_eval(done)
  except BaseException:
    writer.close()
    raise
  finally:   # a diverged run still completes its last good (async) save
    bar.close()
    if mngr is not None:
      mngr.wait_until_finished()
      mngr.close()
  final_step = int(jax.device_get(state["step"]))
  if train.eval_batches and (final_step == train.steps or train.stop_after is None):
    summary["final_eval"] = log_eval(final_step)
  writer.close()
  if main_process:
    metrics.plot_metrics(writer.path, os.path.join(workdir, "loss.png"))
  steps_timed = sum(n for n, _ in steady)
  summary.update({
      "step": final_step, "losses": losses, "wall_s": time.time() - t_start,
      "compile_s": compile_s, "num_params": n_params, "state": state,
      "skipped_steps": int(jax.device_get(state["skipped_steps"])),
      "tokens_per_s": (tokens_per_step * steps_timed / sum(t for _, t in steady)
                       if steps_timed else None)})
  skipped_now = summary["skipped_steps"] - skipped_before
  if skipped_now:
    _warn(f"{skipped_now} step(s) of this run had a non-finite loss or gradient norm and "
          "were not applied (metrics.jsonl: skipped)")
  if "final_eval" in summary:
    ev = summary["final_eval"]
    cross = (f", on the {ev['eval_cross_shard_queries']} queries whose pair is on an earlier "
             f"seq shard {ev['eval_cross_shard_accuracy']:.4f}"
             if "eval_cross_shard_accuracy" in ev else "")
    say(f"final step {final_step}: eval loss {ev['eval_loss']:.4f}, accuracy "
        f"{ev['eval_accuracy']:.4f} over {ev['eval_queries']} scored positions in "
        f"{train.eval_batches} x {data_cfg['batch_size']} held-out sequences{cross}; "
        f"wall {summary['wall_s']:.0f}s")
  return summary
