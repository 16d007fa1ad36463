"""The training loop behind ``train.py``: :func:`train_and_evaluate`.

It runs a config in a workdir, in four parts: start-up (:func:`_start`: validation, the
:class:`~trainer.experiment.Experiment`, the data, the checkpoint manager), restore or
init (:func:`_restore_or_init`: the newest checkpoint that restores, or a fresh state),
the step loop with its log window (:class:`_Window`: metrics rows, tokens/s, the
divergence check) and save policy (:func:`_save_if_due`), and the summary. Orbax
checkpoints (every N steps, keep k, async, atomic; :mod:`trainer.checkpointing`); the MQAR
data of step s is a function of (seed, s), and text comes from grain iterators whose
state is saved in the same checkpoint, so a resumed run continues exactly. Each process
builds only its own rows and tokens of every batch; process 0 writes the metrics
(:mod:`trainer.metrics`) and prints.

What it guards against (each ends in one line, a :class:`RunError` with its exit code):
a step whose loss or gradient norm is not finite is not applied (the jitted step keeps the
old parameters and optimizer state and counts it on the device; the host reads the count
only when it syncs anyway: logging, saving); a checkpoint is saved only when the last step
was applied, and ``train.max_bad_steps`` skipped steps in a row stop the run
(:class:`Diverged`). A checkpoint that does not restore is moved to
``WORKDIR/corrupt_checkpoints`` and the next older one is used; a checkpoint of another
model (shapes differ) or past ``train.steps`` stops before anything compiles; a corpus that
cannot be read is a :class:`DataError` and leaves no workdir behind.

What it does not do: pipeline or tensor parallelism; choose devices or start processes
(``train.py`` does, through ``zeco_jax.runtime.distributed``).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from typing import Optional

import jax
import ml_collections

import configs
from models import data as datamod
from models.data import Dataset
from trainer import checkpointing
from trainer import metrics
from trainer.experiment import Experiment, make_mesh
from trainer.steps import COUNTERS
from zeco_jax.runtime import distributed


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


@dataclasses.dataclass
class _Run:
  """One invocation: what every part of the loop reads."""
  config: ml_collections.ConfigDict
  workdir: str
  exp: Experiment
  dataset: Dataset
  mngr: object                  # an orbax CheckpointManager, or None (no checkpoints)
  say: object                   # prints a line unless progress is "off"
  main_process: bool
  stop: int                     # the step this invocation ends at
  summary: dict

  @property
  def ckpt_dir(self) -> str:
    return os.path.join(self.workdir, "checkpoints")


def _start(config, workdir: str, progress: str) -> _Run:
  """Validation, the experiment, the data and the checkpoint manager. A corpus that cannot
  be read raises :class:`DataError` and removes the workdir if this call created it."""
  mesh_shape = configs.validate(config, jax.device_count())
  data_cfg = config.data.to_dict()
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
  train = config.train
  return _Run(config, workdir, exp, dataset, checkpointing.checkpoint_manager(workdir, train),
              say, main_process, min(train.steps, train.stop_after or train.steps),
              {"evals": {}, "skipped_checkpoints": {}, "workdir": workdir})


def _restore_or_init(run: _Run):
  """``(state, restored step or None, the data iterators' state or None)``; state None:
  the checkpoint is already at the step asked for (nothing to train; the summary says so)."""
  train = run.config.train
  with checkpointing.quiet_closed_event_loops():
    try:
      restored, state, skipped = (
          checkpointing.restore_checkpoint(run.mngr, run.exp.abstract_state, run.workdir,
                                           run.config, optional=COUNTERS,
                                           data=run.dataset.stateful)
          if run.mngr is not None else (None, None, []))
    except checkpointing.CheckpointError as e:   # another model, or none restores
      raise RunError(str(e)) from e
    moved = (checkpointing.set_aside(run.mngr, run.workdir, [s for s, _ in skipped])
             if skipped else {})
  for s, why in skipped:
    run.summary["skipped_checkpoints"][s] = why
    _warn(f"checkpoint step {s} in {run.ckpt_dir} does not restore ({why}): skipped, moved to "
          f"{moved.get(s, 'nowhere (not found)')}; resuming from step {restored}")
  data_state = state.pop("data", None) if state is not None else None
  if restored is None:
    return run.exp.init_state(), None, None
  run.say(f"resumed from {run.ckpt_dir} step {restored}")
  for limit, name in ((train.steps, "train.steps"), (train.stop_after, "train.stop_after")):
    if limit is not None and restored > limit:
      run.mngr.close()
      raise RunError(f"checkpoint at step {restored} in {run.ckpt_dir} is past {name} = "
                     f"{limit}: nothing to train; raise --config.{name} (or use a new "
                     "--workdir)")
  if restored >= run.stop:
    run.mngr.close()
    name = "train.steps" if run.stop == train.steps else "train.stop_after"
    _warn(f"nothing to train: checkpoint at step {restored} in {run.ckpt_dir} is already at "
          f"{name} = {run.stop}; raise --config.{name} to train further")
    run.summary.update({"start_step": restored, "step": restored, "losses": {}, "wall_s": 0.0,
                        "compile_s": None, "num_params": None, "tokens_per_s": None,
                        "skipped_steps": int(jax.device_get(state["skipped_steps"])),
                        "state": state})
    return None, restored, data_state
  return state, restored, data_state


def _position_data(run: _Run, start: int, data_state, rows) -> None:
  """Text data continues where the checkpoint was (its iterators' state)."""
  if not (run.dataset.stateful and start):
    return
  if data_state is None:
    raise RunError(f"checkpoint step {start} in {run.ckpt_dir} has no data iterator state "
                   f"(written by a run of another data.kind?); data.kind="
                   f"{run.config.data.kind!r} reads in order and cannot resume without it. "
                   "Use a new --workdir.")
  try:
    run.dataset.restore(data_state, rows)
  except ValueError as e:
    raise RunError(f"checkpoint step {start} in {run.ckpt_dir}: {e}") from e


def _divergence(run: _Run, bad_streak: int, done: int, last_saved) -> None:
  """Raises :class:`Diverged` after ``train.max_bad_steps`` non-finite steps in a row."""
  train = run.config.train
  if bad_streak < train.max_bad_steps:
    return
  kept = (f"the last finite checkpoint, step {last_saved} in {run.ckpt_dir}, is kept"
          if last_saved is not None else
          "no checkpoint was saved" + ("" if run.mngr is not None else
                                       " (train.checkpoint_every=0)"))
  raise Diverged(f"diverged: the {bad_streak} steps to step {done} had a non-finite loss "
                 f"or gradient norm and were not applied (train.max_bad_steps = "
                 f"{train.max_bad_steps}); {kept}. Rerun with a lower --config.train.lr "
                 "(or --config.train.grad_clip) to resume from it.")


class _Window:
  """The steps since the last log line: their metrics (read from the device only when a
  row is written), the timing of steady-state steps (the first, compiling one apart)."""

  def __init__(self, run: _Run, writer, bar, tokens_per_step: int):
    self.run, self.writer, self.bar = run, writer, bar
    self.tokens_per_step = tokens_per_step
    self.pending, self.losses, self.steady = [], {}, []
    self.t_start = self.t_window = time.time()
    self.steps, self.compile_s = 0, None

  def add(self, done: int, step_metrics) -> None:
    self.pending.append((done, step_metrics))
    if self.compile_s is None:
      jax.block_until_ready(step_metrics)
      self.compile_s = time.time() - self.t_window
      self.bar.write(f"first step (compile included): {self.compile_s:.1f}s")
      self.t_window = time.time()
    else:
      self.steps += 1

  def flush(self, done: int) -> int:
    """Writes the pending rows; returns the last step's run of skipped steps."""
    rows = jax.device_get([m for _, m in self.pending])
    now = time.time()
    tok_s = (self.tokens_per_step * self.steps / max(now - self.t_window, 1e-9)
             if self.steps else 0.0)
    if self.steps:
      self.steady.append((self.steps, now - self.t_window))
    for (s, _), row in zip(self.pending, rows):
      row = {k: (int(v) if k in ("skipped", "skipped_steps") else float(v))
             for k, v in row.items() if k != "bad_streak"}
      self.losses[s] = row["loss"]
      self.writer.write(s, {**row, "tokens_per_s": tok_s, "elapsed_s": now - self.t_start})
    self.writer.flush()
    info = {"loss": float(rows[-1]["loss"]), "tok/s": f"{tok_s:,.0f}"}
    if self.run.config.data.kind != "text":
      info["acc"] = float(rows[-1]["accuracy"])
    if rows[-1]["skipped_steps"]:
      info["skipped"] = int(rows[-1]["skipped_steps"])
    self.bar.update(done, len(self.pending), info)
    self.pending, self.t_window, self.steps = [], time.time(), 0
    return int(rows[-1]["bad_streak"])

  def tokens_per_s(self) -> Optional[float]:
    timed = sum(n for n, _ in self.steady)
    return self.tokens_per_step * timed / sum(t for _, t in self.steady) if timed else None


def _save_if_due(run: _Run, state, done: int, last_saved):
  """Saves a checkpoint every ``train.checkpoint_every`` steps and at the last one, never
  of a skipped step; returns the newest saved step."""
  train = run.config.train
  if run.mngr is None or not (done % train.checkpoint_every == 0 or done == run.stop):
    return last_saved
  bad_streak = int(jax.device_get(state["bad_streak"]))
  _divergence(run, bad_streak, done, last_saved)
  if bad_streak:
    _warn(f"checkpoint: step {done} not saved: its last {bad_streak} step(s) had a "
          "non-finite loss or gradient norm")
    return last_saved
  data_state = (checkpointing.gather_data_state(run.dataset.state(done))
                if run.dataset.stateful else None)
  checkpointing.save(run.mngr, done, state, force=done == run.stop, data_state=data_state)
  return done


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
  run = _start(config, workdir, progress)
  train, data_cfg, exp = config.train, config.data.to_dict(), run.exp
  state, restored, data_state = _restore_or_init(run)
  if state is None:             # the checkpoint is already there
    return run.summary
  checkpointing.write_config(workdir, config)
  start, skipped_before = (int(x) for x in jax.device_get((state["step"],
                                                            state["skipped_steps"])))
  run.summary["start_step"] = start
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  mesh, devices = exp.mesh.shape, jax.devices()
  run.say(f"{workdir}: {n_params / 1e6:.2f}M params, mesh data={mesh['data']} "
          f"seq={mesh['seq']} on {len(devices)} {devices[0].platform} devices, "
          f"batch {data_cfg['batch_size']} x {data_cfg['seq_len']} tokens, steps "
          f"{start}->{run.stop}")

  bar = metrics.Progress(run.stop, start, progress if run.main_process else "off")
  # A resumed run writes the steps after `start` again: rows past it (from the steps after
  # the restored checkpoint that a killed run had logged) are dropped first.
  writer = metrics.MetricWriter(workdir, enabled=run.main_process, keep_through=start)
  window = _Window(run, writer, bar, data_cfg["batch_size"] * data_cfg["seq_len"])
  last_saved = restored       # the newest checkpoint of finite, applied steps

  def log_eval(step):
    ev = evaluate(exp, run.dataset, state["params"], train.eval_batches)
    writer.write(step, ev)
    writer.flush()
    bar.write(_eval_line(step, ev))
    return ev

  global_shape = (data_cfg["batch_size"], data_cfg["seq_len"])
  my_rows = exp.local_index(global_shape)[0]      # this process builds only these rows
  _position_data(run, start, data_state, my_rows)
  next_batch = run.dataset.batch(start, my_rows) if start < run.stop else None
  try:
    for step in range(start, run.stop):
      state, step_metrics = exp.train_step(state, exp.put_batch(next_batch, global_shape))
      if step + 1 < run.stop:
        next_batch = run.dataset.batch(step + 1, my_rows)   # host work overlaps the step
      done = step + 1
      window.add(done, step_metrics)
      if done % train.log_every == 0 or done == run.stop:
        _divergence(run, window.flush(done), done, last_saved)
      saved = _save_if_due(run, state, done, last_saved)
      if saved != last_saved:
        last_saved = saved
        bar.write(f"checkpoint: step {done} save started")   # the async write is in flight
      if train.eval_every and done % train.eval_every == 0 and done != run.stop:
        run.summary["evals"][done] = log_eval(done)
  except BaseException:
    writer.close()
    raise
  finally:   # a diverged run still completes its last good (async) save
    bar.close()
    if run.mngr is not None:
      run.mngr.wait_until_finished()
      run.mngr.close()
  final_step = int(jax.device_get(state["step"]))
  if train.eval_batches and (final_step == train.steps or train.stop_after is None):
    run.summary["final_eval"] = log_eval(final_step)
  writer.close()
  if run.main_process:
    metrics.plot_metrics(writer.path, os.path.join(workdir, "loss.png"))
  return _summarize(run, state, window, n_params, skipped_before)


def _summarize(run: _Run, state, window: _Window, n_params: int, skipped_before: int) -> dict:
  summary, train = run.summary, run.config.train
  summary.update({
      "step": int(jax.device_get(state["step"])), "losses": window.losses,
      "wall_s": time.time() - window.t_start, "compile_s": window.compile_s,
      "num_params": n_params, "state": state,
      "skipped_steps": int(jax.device_get(state["skipped_steps"])),
      "tokens_per_s": window.tokens_per_s()})
  skipped_now = summary["skipped_steps"] - skipped_before
  if skipped_now:
    _warn(f"{skipped_now} step(s) of this run had a non-finite loss or gradient norm and "
          "were not applied (metrics.jsonl: skipped)")
  if "final_eval" in summary:
    ev = summary["final_eval"]
    cross = (f", on the {ev['eval_cross_shard_queries']} queries whose pair is on an earlier "
             f"seq shard {ev['eval_cross_shard_accuracy']:.4f}"
             if "eval_cross_shard_accuracy" in ev else "")
    run.say(f"final step {summary['step']}: eval loss {ev['eval_loss']:.4f}, accuracy "
            f"{ev['eval_accuracy']:.4f} over {ev['eval_queries']} scored positions in "
            f"{train.eval_batches} x {run.config.data.batch_size} held-out sequences{cross}; "
            f"wall {summary['wall_s']:.0f}s")
  return summary
