#!/usr/bin/env python
"""Continue a prompt with a trained model: ``python generate.py --workdir runs/x --prompt "..."``.

    python train.py --text corpus/ --workdir runs/story          # train (a short run)
    python generate.py --workdir runs/story --prompt "Once upon a time" --max_new_tokens 64
    python generate.py --workdir runs/story --prompt_file p.txt --temperature 0.8 --top_p 0.95 \\
        --num_samples 4 --seed 1
    python generate.py --workdir runs/long --prompt_file book.txt --mesh data=1,seq=8

Loads ``WORKDIR/config.json``, the newest checkpoint that restores and the run's tokenizer
(``--text`` runs; UTF-8 bytes for runs on synthetic data), prefills the prompt (split over
``--mesh``'s seq axis when it is > 1: the sequence-parallel ops), then decodes one token at a
time with each layer's recurrent state (``models.generation``) and prints the continuation.
``--temperature 0`` (the default) is greedy; the same seed prints the same text. A sample
stops at the end-of-document token or after ``--max_new_tokens``.

Exit codes: 0 printed; 1 a bad flag, an empty prompt, a workdir without a run or a
checkpoint, a checkpoint of another model (one line on stderr each).

Devices: ``--mesh data=N,seq=M`` (default one device); on a CPU-only host that many
simulated devices are made (``--local-device-count``); several processes as ``train.py``
(``--coordinator``, ``--num-processes``, ``--process-id``).
"""
from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from trainer import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "the training run's workdir (train.py "
                               "--workdir): config.json, checkpoints/, tokenizer.json")
_PROMPT = flags.DEFINE_string("prompt", None, "the text to continue")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "a UTF-8 file holding the prompt")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate per sample")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; else sample at this "
                                  "temperature")
_TOP_K = flags.DEFINE_integer("top_k", 0, "sample among the k most likely tokens (0: all)")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "sample among the most likely tokens whose "
                            "probability reaches p (1.0: all)")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "continuations of the prompt (one batch)")
_SEED = flags.DEFINE_integer("seed", 0, "the sampling seed")
_MESH = flags.DEFINE_string("mesh", "data=1,seq=1", "devices: data=N,seq=M (the prompt is "
                            "split over seq; the samples over data)")
_PROCESSES = cli.define_process_flags()      # several processes (trainer/cli.py)
_LOCAL_DEVICE_COUNT = flags.DEFINE_integer(
    "local-device-count", None, "simulated CPU devices of this process (CPU backend only; "
    "default: what --mesh needs)")


def fail(text: str):
  sys.exit(f"generate.py: {text}")


def read_prompt() -> str:
  if (_PROMPT.value is None) == (_PROMPT_FILE.value is None):
    fail("give the text to continue as exactly one of --prompt TEXT or --prompt_file FILE")
  if _PROMPT_FILE.value is not None:
    try:
      with open(_PROMPT_FILE.value, encoding="utf-8") as f:
        text = f.read()
    except (OSError, UnicodeDecodeError) as e:
      fail(f"--prompt_file={_PROMPT_FILE.value!r}: {e}")
  else:
    text = _PROMPT.value
  if not text:
    fail("the prompt is empty; give at least one character to continue")
  return text


def check_flags() -> dict:
  import configs
  if _WORKDIR.value is None:
    fail("--workdir is required: the training run to load (train.py --workdir DIR)")
  for name, ok, why in (("max_new_tokens", _MAX_NEW.value > 0, "a positive count"),
                        ("num_samples", _NUM_SAMPLES.value > 0, "a positive count"),
                        ("temperature", _TEMPERATURE.value >= 0, ">= 0 (0: greedy)"),
                        ("top_k", _TOP_K.value >= 0, ">= 0 (0: no cut)"),
                        ("top_p", 0 < _TOP_P.value <= 1, "in (0, 1] (1: no cut)")):
    if not ok:
      fail(f"--{name}={flags.FLAGS[name].value}: must be {why}")
  try:
    mesh = configs.parse_mesh(_MESH.value)
  except ValueError as e:
    fail(f"--mesh: {e}")
  mesh = {"data": int(mesh.get("data", 1)), "seq": int(mesh.get("seq", 1))}
  if _NUM_SAMPLES.value % mesh["data"]:
    fail(f"--num_samples={_NUM_SAMPLES.value} must be a multiple of the mesh's data axis "
         f"({mesh['data']}): the samples are split over it")
  return mesh


def main(argv):
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  text = read_prompt()
  mesh_shape = check_flags()
  try:   # before anything starts the jax backend
    _PROCESSES.initialize(_LOCAL_DEVICE_COUNT.value
                          or mesh_shape["data"] * mesh_shape["seq"])
  except ValueError as e:
    fail(f"multi-process settings: {e}")
  import jax
  import numpy as np

  from trainer import inference, make_mesh
  if jax.device_count() < mesh_shape["data"] * mesh_shape["seq"]:
    fail(f"--mesh={_MESH.value} needs {mesh_shape['data'] * mesh_shape['seq']} devices, "
         f"{jax.device_count()} are available")
  devices = np.array(jax.devices()[:mesh_shape["data"] * mesh_shape["seq"]])
  mesh = make_mesh(mesh_shape, devices=devices)
  try:
    run = inference.load_run(_WORKDIR.value, mesh)
  except inference.LoadError as e:
    fail(str(e))
  prompt = run.encode(text)
  T, P = prompt.shape[1], mesh_shape["seq"]
  # Left padding to whole sequence shards (each at least a short convolution's halo).
  cfg = run.config.model
  shard = max(-(-T // P), cfg.conv_size - 1 if cfg.use_short_conv else 1)
  width = shard * P
  rows = np.zeros((_NUM_SAMPLES.value, width), np.int32)
  rows[:, width - T:] = prompt
  mask = np.zeros(rows.shape, bool)
  mask[:, width - T:] = True
  try:
    tokens, lengths = run.model.generate(
        rows, prompt_mask=mask, max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value, top_p=_TOP_P.value, eos_id=run.tokenizer.eos_id,
        seed=_SEED.value, mesh=mesh)
  except NotImplementedError as e:       # a model whose layers cannot decode yet
    fail(str(e))
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  if jax.process_index() != 0:
    return
  for i in range(_NUM_SAMPLES.value):
    if _NUM_SAMPLES.value > 1:
      print(f"--- sample {i} ---")
    print(run.tokenizer.decode(tokens[i, :lengths[i]]), flush=True)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
