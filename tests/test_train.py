"""train.py: config validation, exact resume, and a SIGKILL during an async save."""
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import configs  # noqa: E402
import train  # noqa: E402
from test_model import tiny_cfg  # noqa: E402


def _flat(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


# --- configs ---------------------------------------------------------------------------

def test_configs_load_and_validate():
  for name in ("tiny_mqar", "gla_340m", "gla_1b3"):
    cfg = configs.load(name)
    assert cfg["name"] == name
  cfg = configs.load(os.path.join(ROOT, "configs", "tiny_mqar.py"), ["model.num_layers=4"])
  assert cfg["model"]["num_layers"] == 4
  assert configs.validate(cfg, 8) == {"data": 2, "seq": 4}


def test_config_errors_are_clear():
  with pytest.raises(ValueError, match="unknown key 'model.num_layer'"):
    configs.load("tiny_mqar", ["model.num_layer=4"])
  with pytest.raises(ValueError, match="neither a file nor one of"):
    configs.load("no_such_config")
  cfg = configs.load("tiny_mqar")
  cfg["mesh"] = configs.parse_mesh("data=2,seq=2")
  with pytest.raises(ValueError, match="must multiply to the device count"):
    configs.validate(cfg, 8)
  cfg = configs.load("tiny_mqar", ["data.seq_len=1000"])
  cfg["mesh"] = {"data": 2, "seq": 4}
  with pytest.raises(ValueError, match="not divisible by seq axis"):
    configs.validate(cfg, 8)
  with pytest.raises(ValueError, match="expected data=N,seq=M"):
    configs.parse_mesh("data=2,tensor=4")


# --- resume ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, devices):
  cfg = tiny_cfg(steps=20, checkpoint_every=10,
                 workdir=str(tmp_path_factory.mktemp("straight")))
  return train.run(cfg, progress=False, verbose=False)


def test_resume_is_exact(straight_run, tmp_path):
  cfg = tiny_cfg(steps=20, checkpoint_every=10, stop_after=10, workdir=str(tmp_path))
  first = train.run(cfg, progress=False, verbose=False)
  assert first["step"] == 10 and sorted(first["losses"]) == list(range(1, 11))
  cfg["train"]["stop_after"] = None
  second = train.run(cfg, progress=False, verbose=False)
  assert second["start_step"] == 10 and second["step"] == 20
  losses = {**first["losses"], **second["losses"]}
  assert losses == straight_run["losses"]
  for a, b in zip(_flat(second["params"]), _flat(straight_run["params"])):
    np.testing.assert_array_equal(a, b)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert {r["step"] for r in rows if "loss" in r} == set(range(1, 21))
  assert (tmp_path / "loss.png").exists()


def test_sigkill_during_async_save_resumes_from_last_complete(straight_run, tmp_path):
  """A subprocess saving every step is SIGKILLed right after an async save starts."""
  workdir = str(tmp_path)
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--no-progress", "--workdir", workdir]
  for item in ("model.vocab_size=64", "model.hidden_size=32", "model.num_layers=2",
               "model.num_heads=2", "model.intermediate_size=64", "model.chunk_size=16",
               "data.seq_len=128", "data.batch_size=2", "data.num_keys=16", "data.num_pairs=4",
               "data.num_queries=16", "data.num_segments=4", "data.query_window=24",
               "train.steps=20",
               "train.warmup_steps=2", "train.lr=3e-3", "train.log_every=5",
               "train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=1",
               "train.keep_checkpoints=2"):
    cmd += ["--set", item]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=ROOT, env=dict(os.environ))
  killed_at, deadline, lines = None, time.time() + 240, []
  try:
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("checkpoint: step 7 save started"):
        os.kill(proc.pid, signal.SIGKILL)        # the async write of step 7 is in flight
        killed_at = 7
        break
      if time.time() > deadline:
        break
  finally:
    if proc.poll() is None and killed_at is None:
      proc.kill()
    proc.wait(timeout=30)
  assert killed_at == 7, "".join(lines[-20:])
  assert proc.returncode == -signal.SIGKILL
  ckpt_dir = os.path.join(workdir, "checkpoints")
  leftovers = os.listdir(ckpt_dir)
  assert any(name.isdigit() and int(name) >= 5 for name in leftovers), leftovers

  cfg = tiny_cfg(steps=20, checkpoint_every=1, keep_checkpoints=2, workdir=workdir)
  resumed = train.run(cfg, progress=False, verbose=False)
  assert 5 <= resumed["start_step"] <= 7 and resumed["step"] == 20
  for s, loss in resumed["losses"].items():
    assert loss == straight_run["losses"][s], s
  for a, b in zip(_flat(resumed["params"]), _flat(straight_run["params"])):
    np.testing.assert_array_equal(a, b)
