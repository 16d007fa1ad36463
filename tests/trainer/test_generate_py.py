"""``python generate.py`` on a short text run (trainer.train_and_evaluate, 4 steps): it
prints a continuation, the same seed prints the same text, greedy decoding after a prefill
split over seq = 4 prints what one device prints; a missing workdir, a checkpoint of
another model and an empty prompt are one line each on stderr with exit status 1."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import trainer
from helpers import ROOT, persistent_cache_env, tiny_text_cfg


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, compile_cache):
  from models import corpus
  folder = corpus.write_corpus(str(tmp_path_factory.mktemp("corpus")), documents=40, seed=3,
                               sentences=(1, 3))
  path = str(tmp_path_factory.mktemp("run"))
  trainer.train_and_evaluate(tiny_text_cfg(folder, steps=4, warmup_steps=1, log_every=2,
                                           checkpoint_every=4), path, progress="off")
  return path


def generate_py(*args, cache):
  return subprocess.run([sys.executable, "generate.py", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300,
                        env=dict(os.environ, **persistent_cache_env(cache)))


def test_prints_a_seeded_continuation(workdir, compile_cache):
  args = ("--workdir", workdir, "--prompt", "The dog", "--max_new_tokens", "12")
  sampled = [generate_py(*args, "--temperature", "1.0", "--seed", "3", "--num_samples", "2",
                         cache=compile_cache) for _ in range(2)]
  for proc in sampled:
    assert proc.returncode == 0, proc.stderr
  assert sampled[0].stdout == sampled[1].stdout
  lines = sampled[0].stdout.splitlines()
  assert lines[0] == "--- sample 0 ---" and "--- sample 1 ---" in lines
  assert len(sampled[0].stdout) > len("--- sample 0 ---\n--- sample 1 ---\n") + 4
  greedy = generate_py(*args, cache=compile_cache)
  split = generate_py(*args, "--mesh", "data=1,seq=4", cache=compile_cache)
  assert greedy.returncode == 0 and split.returncode == 0, (greedy.stderr, split.stderr)
  assert greedy.stdout.strip() and greedy.stdout == split.stdout


def test_errors_are_one_line(workdir, tmp_path, compile_cache):
  other = tmp_path / "other"
  shutil.copytree(workdir, other)
  config = json.loads((other / "config.json").read_text())
  config["model"]["hidden_size"] = 48
  (other / "config.json").write_text(json.dumps(config))
  cases = {
      ("--workdir", str(tmp_path / "missing"), "--prompt", "x"): "no workdir",
      ("--workdir", workdir, "--prompt="): "the prompt is empty",
      ("--workdir", str(other), "--prompt", "x"): "is of another model",
  }
  for args, words in cases.items():
    proc = generate_py(*args, cache=compile_cache)
    assert proc.returncode == 1, (args, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("generate.py:")]
    assert len(lines) == 1 and words in lines[0], (args, proc.stderr)
