"""How train.py fails, each as a reproduction of a reported failure: a diverging run, a
corrupt latest checkpoint, metrics.jsonl deleted mid-run, a workdir ahead of train.steps or
of another model, bad values on the command line.

One tiny run (the module's ``base`` workdir: checkpoints 5, 10, 15) is trained once; each
test works on a copy. A persistent compilation cache in a temporary folder (the
``compile_cache`` fixture), shared with the subprocesses, makes every later run of the
same program skip its compile; subprocesses only where the exit code is what is tested.
"""
import json
import math
import os
import shutil

import jax
import pytest
from absl import flags

import configs
from trainer import metrics
import train
import trainer
from helpers import persistent_cache_env, run_train_py, tiny_cfg, tiny_flags

# The base run: checkpoints every 5 steps, no evaluation (one program fewer to compile).
BASE = dict(steps=30, checkpoint_every=5, keep_checkpoints=3, eval_batches=0)


@pytest.fixture(scope="module")
def base(tmp_path_factory, compile_cache, devices):
  """15 steps of BASE (stop_after=15): checkpoints 5, 10 and 15, losses of steps 1..15."""
  workdir = str(tmp_path_factory.mktemp("base"))
  summary = trainer.train_and_evaluate(tiny_cfg(**BASE, stop_after=15), workdir,
                                       progress="off")
  assert summary["step"] == 15 and summary["skipped_steps"] == 0
  return workdir, summary["losses"]


def _copy(base_dir, tmp_path, newest=15) -> str:
  """The base workdir with its checkpoints after ``newest`` removed."""
  workdir = str(tmp_path / "w")
  shutil.copytree(base_dir, workdir)
  for step in _steps(workdir):
    if step > newest:
      shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))
  return workdir


def _steps(workdir) -> list:
  return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


def _rows(workdir) -> list:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _train_cli(*args, cache=None):
  return run_train_py("--progress=off", *args, timeout=300,
                      env=persistent_cache_env(cache) if cache else None)


def _resume_to_15(workdir):
  return trainer.train_and_evaluate(tiny_cfg(**BASE, stop_after=15), workdir, progress="off")


# --- a diverging run ----------------------------------------------------------------------

def test_diverging_run_stops_keeps_finite_checkpoint_and_resumes(base, tmp_path,
                                                                  compile_cache):
  """Reported: lr=1e30 grad_clip=1e30: NaN from step 4, checkpoints saved, exit 0."""
  base_dir, base_losses = base
  workdir = _copy(base_dir, tmp_path, newest=10)
  # The resumed run drops the copied rows past its checkpoint (step 10) before it logs.
  rows_before = len([r for r in _rows(workdir) if r["step"] <= 10])
  diverged = _train_cli("--workdir", workdir,
                        *tiny_flags(**BASE, lr=1e30, grad_clip=1e30), cache=compile_cache)
  assert diverged.returncode == 3, diverged.stderr[-3000:]
  last_line = diverged.stderr.strip().splitlines()[-1]
  assert last_line.startswith("train.py: diverged: the ") and (
      "(train.max_bad_steps = 10); the last finite checkpoint, step 10 in") in last_line
  rows = _rows(workdir)[rows_before:]
  skipped = [r for r in rows if r["skipped"]]
  assert all(not math.isfinite(r["loss"]) or not math.isfinite(r["grad_norm"])
             for r in skipped)
  # Stopped within max_bad_steps + log_every of the first bad step; nothing saved after 10.
  assert len(skipped) >= 10 and rows[-1]["step"] <= skipped[0]["step"] + 10 + 5
  assert rows[-1]["skipped_steps"] == len(skipped)
  assert _steps(workdir) == [5, 10]

  resumed = _resume_to_15(workdir)    # a sane lr continues from step 10, exactly
  assert resumed["start_step"] == 10 and resumed["step"] == 15
  assert resumed["losses"] == {s: base_losses[s] for s in range(11, 16)}
  assert resumed["skipped_steps"] == 0
  assert all(bool(jax.numpy.isfinite(x).all()) for x in jax.tree.leaves(resumed["state"]))


# --- a corrupt latest checkpoint ----------------------------------------------------------

def test_corrupt_latest_checkpoint_falls_back_to_the_newest_that_restores(base, tmp_path,
                                                                          capsys):
  """Reported: truncate -s 100 the data files of the newest step, rerun: a buried crash."""
  base_dir, base_losses = base
  workdir = _copy(base_dir, tmp_path, newest=15)
  step_dir = os.path.join(workdir, "checkpoints", "15")
  data_files = [os.path.join(d, f) for d, _, files in os.walk(step_dir) for f in files
                if os.sep + "d" + os.sep in os.path.join(d, f) + os.sep]
  assert data_files
  for path in data_files:
    os.truncate(path, 100)
  resumed = trainer.train_and_evaluate(tiny_cfg(**BASE, stop_after=15), workdir,
                                       progress="off")
  err = capsys.readouterr().err
  assert resumed["start_step"] == 10 and resumed["step"] == 15
  assert resumed["losses"] == {s: base_losses[s] for s in range(11, 16)}
  assert list(resumed["skipped_checkpoints"]) == [15]
  lines = [line for line in err.splitlines() if "does not restore" in line]
  assert len(lines) == 1 and lines[0].startswith(
      f"checkpoint step 15 in {workdir}/checkpoints does not restore (") and lines[0].endswith(
      f"moved to {workdir}/corrupt_checkpoints/15; resuming from step 10")
  assert "Event loop is closed" not in err
  assert _steps(workdir) == [5, 10, 15]          # 15 saved again, the damaged one set aside

  for step in (5, 10, 15):                        # none restores: one line, nothing moved
    for path in [os.path.join(d, f) for d, _, fs in
                 os.walk(os.path.join(workdir, "checkpoints", str(step))) for f in fs]:
      os.truncate(path, 10)
  with pytest.raises(trainer.RunError, match=r"no checkpoint in .* restores: step 15: .*; "
                     r"step 10: .*; step 5: .*Move them away"):
    _resume_to_15(workdir)
  assert _steps(workdir) == [5, 10, 15]


# --- metrics.jsonl deleted mid-run --------------------------------------------------------

def test_deleted_metrics_file_is_recreated_and_plot_never_fails(base, tmp_path, monkeypatch,
                                                                capsys):
  """Reported: deleting metrics.jsonl mid-run loses every later metric and exits 1."""
  base_dir, base_losses = base
  workdir = _copy(base_dir, tmp_path, newest=10)
  path = os.path.join(workdir, "metrics.jsonl")
  write = metrics.MetricWriter.write

  def write_after_deleting_at_13(self, step, scalars):
    if step == 13 and os.path.exists(path):
      os.remove(path)                            # as a user's rm would, mid-run
    write(self, step, scalars)

  monkeypatch.setattr(metrics.MetricWriter, "write", write_after_deleting_at_13)
  resumed = _resume_to_15(workdir)
  assert resumed["step"] == 15
  assert [r["step"] for r in _rows(workdir)] == [13, 14, 15]
  assert [r["loss"] for r in _rows(workdir)] == [base_losses[s] for s in (13, 14, 15)]
  assert "was deleted or replaced; writing a new one" in capsys.readouterr().err
  assert os.path.exists(os.path.join(workdir, "loss.png"))

  # Plotting never fails a run: a missing or garbled file is a warning.
  missing = str(tmp_path / "gone.jsonl")
  assert metrics.plot_metrics(missing, str(tmp_path / "a.png")) is False
  with open(missing, "w") as f:
    f.write('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')     # cut short by a kill
  assert metrics.plot_metrics(missing, str(tmp_path / "b.png")) is True
  assert "metrics: no plot" in capsys.readouterr().err


# --- a workdir ahead of train.steps, or of another model ----------------------------------

def test_checkpoint_past_train_steps_or_of_another_model_is_one_line(base, tmp_path, capsys):
  """Reported: resuming past train.steps exits 0 having trained nothing; another model
  shape fails in 240 lines of orbax."""
  base_dir, _ = base
  workdir = _copy(base_dir, tmp_path, newest=15)
  cli = _train_cli("--workdir", workdir, *tiny_flags(**{**BASE, "steps": 12}))
  assert cli.returncode == 1, cli.stderr[-3000:]
  assert cli.stderr.strip().splitlines() == [
      f"train.py: checkpoint at step 15 in {workdir}/checkpoints is past train.steps = 12: "
      "nothing to train; raise --config.train.steps (or use a new --workdir)"]
  with pytest.raises(trainer.RunError, match="is past train.stop_after = 12"):
    trainer.train_and_evaluate(tiny_cfg(**BASE, stop_after=12), workdir, progress="off")

  done = trainer.train_and_evaluate(tiny_cfg(**{**BASE, "steps": 15}), workdir,
                                    progress="off")      # exactly there: done, exit 0
  assert done["step"] == 15 and done["losses"] == {}
  assert "nothing to train: checkpoint at step 15" in capsys.readouterr().err

  wider = tiny_cfg(**BASE)
  wider.model.hidden_size = 64
  with pytest.raises(trainer.RunError) as e:
    trainer.train_and_evaluate(wider, workdir, progress="off")
  message = str(e.value)
  assert "\n" not in message and message.startswith(
      f"checkpoint step 15 in {workdir}/checkpoints is of another model: params.")
  assert "has shape (16,) float32 in the checkpoint, (32,) float32 now" in message
  assert "model fields changed since the run that wrote it: model.hidden_size 32 -> 64" in message
  assert _steps(workdir) == [5, 10, 15]


# --- start-up validation of every field ---------------------------------------------------

def _parse(*overrides):
  """train.py's --config flag on a fresh FlagValues; the one-line error, or the config."""
  argv = ["train.py", *overrides]
  flag_values = flags.FlagValues()
  try:
    train.define_config_flag(flag_values, sys_argv=argv)
    flag_values(argv)
  except train.CONFIG_ERRORS as e:
    return train.config_error(e)
  try:
    configs.validate(flag_values.config, 8)
  except ValueError as e:
    return f"config error: {e}"
  return flag_values.config


def test_every_field_is_type_and_range_checked_before_compiling():
  """Reported: lr=abc and steps=2.5 give a raw TypeError, log_every=0 a ZeroDivisionError
  after compiling, a negative checkpoint_every is accepted."""
  assert _parse("--config.train.lr=abc") == (
      "config error: train.lr='abc': train.lr must be a finite number > 0 (could not "
      "convert string to float: 'abc')")
  assert _parse("--config.train.steps=2.5") == (
      "config error: train.steps='2.5': train.steps must be an integer >= 1 (invalid "
      "literal for int() with base 10: '2.5')")
  assert _parse("--config.train.log_every=0") == (
      "config error: train.log_every=0: train.log_every must be an integer >= 1")
  assert _parse("--config.train.checkpoint_every=-5") == (
      "config error: train.checkpoint_every=-5: train.checkpoint_every must be an integer "
      ">= 0 (0: no checkpoints)")
  assert _parse("--config.train.lr=nan").startswith("config error: train.lr=nan (not finite)")
  assert _parse("--config.train.max_bad_steps=0").startswith(
      "config error: train.max_bad_steps=0: train.max_bad_steps must be an integer >= 1")
  assert "eval_every=100 needs train.eval_batches >= 1" in _parse(   # between two fields
      "--config.train.eval_batches=0", "--config.train.eval_every=100")
  assert _parse("--config.train.eval_batches=0", "--config.train.eval_every=0",
                "--config.train.lr=1", "--config.train.stop_after=5").train.lr == 1.0

  # The schema covers every field of every section, and each refuses a wrong type.
  defaults = configs.schema.flatten(configs.defaults().to_dict())
  assert set(configs.SCHEMA) == set(defaults)
  wrong = {bool: 2, int: 2.5, float: "abc", str: 3}
  for name, field in configs.SCHEMA.items():
    config = configs.defaults().to_dict()
    section = config
    *parents, leaf = name.split(".")
    for key in parents:
      section = section[key]
    section[leaf] = wrong[field.kind]
    with pytest.raises(ValueError, match=f"^{name}="):
      configs.schema.check(config)


def test_bad_value_on_the_command_line_is_one_line_exit_1():
  cli = _train_cli("--config.train.lr=abc")
  assert cli.returncode == 1
  assert cli.stderr.strip().splitlines() == [
      "config error: train.lr='abc': train.lr must be a finite number > 0 (could not "
      "convert string to float: 'abc')"]
