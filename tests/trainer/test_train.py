"""train.py and the trainer: config validation, the command line, exact resume (from a
checkpoint, and with packed text documents), and a SIGKILL during an async save.

Every test runs with a persistent compilation cache (the ``compile_cache`` fixture, shared
with the training subprocess it starts): each run here builds a new Experiment, whose
jitted steps would compile again (several seconds each); a run of a program an earlier run
compiled (the same config, so the same HLO) loads it instead. Every run still traces and
lowers its own programs."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import configs
import configs.gla_1b3
import configs.gla_340m
import configs.tiny_mqar
import trainer
from helpers import (ROOT, persistent_cache_env, run_train_py, tiny_cfg, tiny_flags,
                     tiny_text_cfg)

pytestmark = pytest.mark.usefixtures("compile_cache")


def _flat(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


# --- configs ------------------------------------------------------------------------------

def test_configs_load_and_validate():
  assert configs.validate(configs.tiny_mqar.get_config(), 8) == {"data": 2, "seq": 4}
  for module in (configs.gla_340m, configs.gla_1b3):
    config = module.get_config()
    config.data.kind = "mqar"                 # text needs a corpus path
    assert configs.validate(config, 8) == {"data": 2, "seq": 4}
  config = tiny_cfg()
  config.mesh = "data=1,seq=8"
  assert configs.validate(config, 8) == {"data": 1, "seq": 8}


def test_config_errors_are_clear():
  config = configs.tiny_mqar.get_config()
  with pytest.raises(AttributeError, match='Did you mean "num_layers"'):
    config.model.num_layer = 4                # locked: no new fields, in files or flags
  config.mesh = "data=2,seq=2"
  with pytest.raises(ValueError, match="must multiply to the device count"):
    configs.validate(config, 8)
  config = configs.tiny_mqar.get_config()
  config.data.seq_len = 1000
  with pytest.raises(ValueError, match="not divisible by seq axis"):
    configs.validate(config, 8)
  config = configs.tiny_mqar.get_config()
  config.model.seq_method = "pipeline"
  with pytest.raises(ValueError, match="seq_method must be one of"):
    configs.validate(config, 8)
  config = configs.tiny_mqar.get_config()
  config.model.seq_group_size = 2
  with pytest.raises(ValueError, match="`group_size`=2 is for a grouped scan method"):
    configs.validate(config, 8)
  config = configs.tiny_mqar.get_config()
  config.train.sharding_rules.embed = "model"
  with pytest.raises(ValueError, match="sharding_rules.embed='model'"):
    configs.validate(config, 8)
  with pytest.raises(ValueError, match="expected 'auto' or data=N,seq=M"):
    configs.parse_mesh("data=2,tensor=4")


def test_command_line_errors_name_the_field():
  typo = run_train_py("--config=configs/tiny_mqar.py", "--config.model.num_layer=4")
  assert typo.returncode == 1 and 'Did you mean "num_layers"' in typo.stderr, typo.stderr
  mesh = run_train_py("--config.mesh=data=2,seq=2")
  assert mesh.returncode == 1, mesh.stderr
  assert "config error: mesh data=2 x seq=2 = 4 devices, but 8 are available" in mesh.stderr


def test_data_errors_are_one_line_and_leave_no_workdir(tmp_path):
  corpus, workdir = tmp_path / "corpus", tmp_path / "run"
  corpus.mkdir()
  (corpus / "a.jsonl").write_text('{"text": "one"}\n{"txt": "two"}\n')
  bad = run_train_py("--text", str(corpus), "--workdir", str(workdir))
  assert bad.returncode == 1, bad.stderr
  assert bad.stderr.strip().splitlines() == [
      f'data error: {corpus}/a.jsonl line 2: not a JSON object with a string "text" field '
      '(no "text" field); fix or remove the line'], bad.stderr
  assert not workdir.exists()


# --- resume -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, devices, compile_cache):
  cfg = tiny_cfg(steps=20, checkpoint_every=10)
  return trainer.train_and_evaluate(cfg, str(tmp_path_factory.mktemp("straight")),
                                    progress="off")


def test_resume_is_exact(straight_run, tmp_path):
  cfg = tiny_cfg(steps=20, checkpoint_every=10, stop_after=10)
  first = trainer.train_and_evaluate(cfg, str(tmp_path), progress="off")
  assert first["step"] == 10 and sorted(first["losses"]) == list(range(1, 11))
  # A run killed at step 15 had logged steps 11-15 past the checkpoint at 10.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    for step in range(11, 16):
      f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
    f.write('{"step": 16, "lo')                          # a line cut short by the kill
  cfg.train.stop_after = None
  second = trainer.train_and_evaluate(cfg, str(tmp_path), progress="off")
  assert second["start_step"] == 10 and second["step"] == 20
  losses = {**first["losses"], **second["losses"]}
  assert losses == straight_run["losses"]
  for a, b in zip(_flat(second["state"]["params"]), _flat(straight_run["state"]["params"])):
    np.testing.assert_array_equal(a, b)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert sorted(r["step"] for r in rows if "loss" in r) == list(range(1, 21))   # once each
  assert [r["loss"] for r in rows if r["step"] == 11] == [losses[11]]
  assert (tmp_path / "loss.png").exists()
  assert os.listdir(tmp_path / "tensorboard")


def test_sigkill_during_async_save_resumes_from_last_complete(straight_run, tmp_path,
                                                             compile_cache):
  """A subprocess saving every step is SIGKILLed right after an async save starts."""
  workdir = str(tmp_path)
  cmd = [sys.executable, "train.py", "--progress=lines", "--workdir", workdir,
         *tiny_flags(steps=20, checkpoint_every=1, keep_checkpoints=2)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=ROOT, env=dict(os.environ, **persistent_cache_env(compile_cache)))
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

  cfg = tiny_cfg(steps=20, checkpoint_every=1, keep_checkpoints=2)
  resumed = trainer.train_and_evaluate(cfg, workdir, progress="off")
  assert 5 <= resumed["start_step"] <= 7 and resumed["step"] == 20
  for s, loss in resumed["losses"].items():
    assert loss == straight_run["losses"][s], s
  for a, b in zip(_flat(resumed["state"]["params"]), _flat(straight_run["state"]["params"])):
    np.testing.assert_array_equal(a, b)


# --- real text ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
  from models import corpus
  return corpus.write_corpus(str(tmp_path_factory.mktemp("text_corpus")), documents=60,
                             seed=2, sentences=(1, 4))


def test_text_resume_is_exact(text_corpus, tmp_path_factory, devices):
  """Packed documents with segment_ids over seq=4: 20 steps == 10 + resume + 10, bit for bit,
  the second invocation's grain iterators restored from the checkpoint's data item."""
  straight = trainer.train_and_evaluate(tiny_text_cfg(text_corpus),
                                        str(tmp_path_factory.mktemp("text_straight")),
                                        progress="off")
  workdir = tmp_path_factory.mktemp("text_resumed")
  first = trainer.train_and_evaluate(tiny_text_cfg(text_corpus, stop_after=10), str(workdir),
                                     progress="off")
  assert first["step"] == 10 and "final_eval" not in first
  assert os.listdir(workdir / "checkpoints" / "10" / "data"), "no data item in the checkpoint"
  tokenizer = (workdir / "tokenizer.json").read_text()
  second = trainer.train_and_evaluate(tiny_text_cfg(text_corpus), str(workdir), progress="off")
  assert second["start_step"] == 10 and second["step"] == 20
  assert (workdir / "tokenizer.json").read_text() == tokenizer
  losses = {**first["losses"], **second["losses"]}
  assert losses == straight["losses"] and sorted(losses) == list(range(1, 21))
  for a, b in zip(_flat(second["state"]["params"]), _flat(straight["state"]["params"])):
    np.testing.assert_array_equal(a, b)
  assert second["final_eval"] == straight["final_eval"]
  assert straight["final_eval"]["eval_loss"] < np.log(300)     # it learned something


def test_text_flag_picks_the_text_config(text_corpus):
  """``train.py --text DIR``: data.kind='text' on DIR; configs/text_tiny.py unless --config."""
  from absl import flags
  import train
  for argv, file in ((["--text", text_corpus], "text_tiny.py"),
                     ([f"--text={text_corpus}", "--config=configs/tiny_mqar.py"],
                      "tiny_mqar.py")):
    flag_values = flags.FlagValues()
    train.define_config_flag(flag_values, sys_argv=["train.py", *argv])
    flag_values(["train.py", *[a for a in argv if a.startswith("--config")]])
    assert flag_values["config"].config_filename.endswith(file)
  missing = run_train_py("--text", text_corpus + "/missing")    # main() sets kind and path
  assert missing.returncode == 1, missing.stderr
  assert (f"config error: data.kind='text' needs data.path (or train.py --text DIR), an "
          f"existing file or folder; got '{text_corpus}/missing'") in missing.stderr
