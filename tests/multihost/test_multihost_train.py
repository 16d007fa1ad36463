"""train.py as 2 processes x 4 CPU devices, against the 8-device single process.

* a 5-step run as 2 processes (mesh data=1,seq=8: the sequence spans both processes) logs
  the same losses as the same run in one process with 8 devices;
* the checkpoint the 2-process run wrote restores in a 1-process run with identical params
  (and equal to what 2 processes restore from it, and to the single-process run's).

When run as N processes, only process 0 writes WORKDIR/metrics.jsonl (rows with "step" and
"loss"); every process saves through orbax to WORKDIR/checkpoints.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, tiny_flags

HERE = os.path.dirname(os.path.abspath(__file__))
RESTORE = os.path.join(HERE, "multihost_worker_train.py")

# The small model of helpers.TINY (one block: helpers.TRAINER_MODEL), 5 steps, one
# checkpoint at the end.
CONFIG = [*tiny_flags(steps=5, log_every=1, eval_batches=0, checkpoint_every=5,
                      async_checkpointing=False), "--config.mesh=data=1,seq=8"]


def _env():
  # The restore worker imports the repository's modules (configs, trainer) by name.
  return dict(os.environ, PYTHONPATH=ROOT)


def launch(processes, devices, program, timeout=420):
  """Runs PROGRAM under zeco_jax.runtime.launch; fails the test with the output if it fails."""
  cmd = [sys.executable, "-m", "zeco_jax.runtime.launch", "--processes", str(processes),
         "--devices-per-process", str(devices), "--timeout", str(timeout - 30), "--",
         *program]
  proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
  return proc


def train_args(workdir):
  return ["train.py", *CONFIG, "--workdir", str(workdir), "--progress=lines"]


def losses(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("multihost_train")
  one, two = base / "one_process", base / "two_processes"
  single = launch(1, 8, train_args(one))
  double = launch(2, 4, train_args(two))
  return {"one": one, "two": two, "single_out": single, "double_out": double}


def test_two_process_training_matches_single_process(runs):
  single, double = losses(runs["one"]), losses(runs["two"])
  assert sorted(single) == [1, 2, 3, 4, 5], single
  assert sorted(double) == sorted(single), double
  for step in single:
    assert np.isclose(double[step], single[step], rtol=1e-5, atol=0), (step, double, single)
  # Logging from process 0 only: no metric lines from process 1.
  assert "[p1] step " not in runs["double_out"].stdout


def restore(pairs, processes):
  """Restores each (workdir, out) of ``pairs`` in one launch of ``processes`` processes (a
  fresh CheckpointManager per workdir); returns each out's arrays."""
  program = [RESTORE, *(a for w, o in pairs for a in ("--workdir", str(w), "--out", str(o))),
             *CONFIG]
  launch(processes, 8 // processes, program)
  return [dict(np.load(out)) for _, out in pairs]


def test_two_process_checkpoint_restores_in_one_process(runs, tmp_path):
  # Both one-process restores in one launch: the 2-process run's checkpoint, then the
  # 1-process run's (the reference).
  in_one, reference = restore([(runs["two"], tmp_path / "two_in_one.npz"),
                               (runs["one"], tmp_path / "one_in_one.npz")], 1)
  (in_two,) = restore([(runs["two"], tmp_path / "two_in_two.npz")], 2)
  assert int(in_one.pop("__step__")) == int(in_two.pop("__step__")) == 5
  reference.pop("__step__")
  assert set(in_one) == set(in_two) == set(reference) and len(in_one) > 5
  for name in in_one:
    np.testing.assert_array_equal(in_one[name], in_two[name], err_msg=name)
    np.testing.assert_allclose(in_one[name], reference[name], rtol=1e-4, atol=1e-6,
                               err_msg=name)
