#!/usr/bin/env python
"""Train the GLA language model with ZeCO sequence parallelism: ``python train.py``.

    python train.py                                   # tiny MQAR default (configs/tiny_mqar.py)
    python train.py --text corpus/                    # a folder of .txt / .jsonl documents
    python train.py --config configs/gla_340m.py --config.data.path=corpus/ \\
        --config.mesh=data=1,seq=8
    python train.py --config.model.num_layers=4 --config.train.lr=3e-4 --workdir runs/x
    python train.py --config configs/gla_1b3.py --compile_only=v5p:4x4x4 \\
        --config.mesh=data=1,seq=64     # compile for a TPU topology only (trainer/aot.py)

The config is a file of ``configs/`` (ml_collections ``get_config()``); every field can be
overridden as ``--config.SECTION.FIELD=VALUE`` and an unknown field is an error. Rerunning
a command resumes from its workdir's latest checkpoint that restores (default workdir:
runs/<config>).

Exit codes: 0 trained to ``train.steps`` (or ``train.stop_after``), or the checkpoint is
already exactly there; 1 a config error (any field's type or range, checked before anything
compiles), a checkpoint past the step asked for, a checkpoint of another model, or no
checkpoint that restores; 3 the run diverged (``train.max_bad_steps`` non-finite steps in a
row; the last finite checkpoint is kept). Each failure is one line on stderr.

Devices: on a CPU-only host the run gets 8 simulated CPU devices (``--local-device-count``;
``$ZECO_LOCAL_DEVICE_COUNT`` or an ``XLA_FLAGS`` device count take precedence); GPU/TPU
hosts use their real devices. Several processes: ``--coordinator HOST:PORT
--num-processes N --process-id I``, or the ``JAX_*`` environment variables, or SLURM /
TPU-pod detection (``zeco_jax.runtime.distributed``); locally ``python -m zeco_jax.runtime.launch
--processes 2 --devices-per-process 4 -- train.py ...``.

This file is the command line and the start-up only; the trainer is the package
:mod:`trainer`.
"""
from __future__ import annotations

import os
import re
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

import configs
import trainer
from trainer import cli, metrics
from zeco_jax.runtime import distributed

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                              "tiny_mqar.py")
# The default config when --text is given without --config.
TEXT_CONFIG = os.path.join(os.path.dirname(DEFAULT_CONFIG), "text_tiny.py")
DEFAULT_CPU_DEVICES = 8      # python train.py on a CPU-only host: mesh data=2 x seq=4

_TEXT = flags.DEFINE_string(
    "text", None, "train on a folder of documents: .txt files (one document each) or .jsonl "
    "files (one {\"text\": ...} per line); sets data.kind='text', data.path=DIR; without "
    "--config the config is configs/text_tiny.py")
_WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints, metrics.jsonl, tensorboard/ "
                               "and loss.png (default: runs/<config file name>)")
_PROGRESS = flags.DEFINE_enum("progress", "bar", list(metrics.PROGRESS_MODES),
                              "a tqdm bar, plain log lines, or nothing")
_PROCESSES = cli.define_process_flags()      # several processes (trainer/cli.py)
_COMPILE_ONLY = flags.DEFINE_string(
    "compile_only", None, "a TPU topology (v5p:2x2x2, v5e:4x4, v6e:8x8, ...): compile the "
    "training step for it ahead of time (needs libtpu, no TPU; nothing runs, no data is read) "
    "and print per-chip memory, FLOPs and collectives (trainer/aot.py)")
_LOCAL_DEVICE_COUNT = flags.DEFINE_integer(
    "local-device-count", None, f"simulated CPU devices of this process (CPU backend only; "
    f"default {DEFAULT_CPU_DEVICES} unless $ZECO_LOCAL_DEVICE_COUNT or an XLA_FLAGS device "
    f"count sets it)")

# An unknown field (AttributeError / KeyError), a value of the wrong type, a missing file.
CONFIG_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError)


def config_error(e: BaseException) -> str:
  """One line: the flag, its value, what the field allows (configs/schema.py) and why."""
  while e.args and isinstance(e.args[0], BaseException):   # ml_collections nests them
    e = e.args[0]
  text = str(e.args[0] if e.args else e)
  # ml_collections' own type check of an override: "flag --config.train.lr=abc: could not
  # convert string to float: 'abc'"; add what the field takes.
  bad_value = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", text, re.S)
  if bad_value and configs.schema.allowed(bad_value[1]):
    name, value, why = bad_value.groups()
    return f"config error: {name}={value!r}: {configs.schema.allowed(name)} ({why})"
  return f"train.py: {text}"


def define_config_flag(flag_values=flags.FLAGS, sys_argv=None) -> None:
  """``--config FILE`` with its ``--config.SECTION.FIELD=VALUE`` overrides (locked).

  ml_collections reads the overrides from ``sys_argv`` (default ``sys.argv``) here. The
  default file is configs/tiny_mqar.py, or configs/text_tiny.py when ``--text`` is given.
  """
  argv = sys.argv if sys_argv is None else sys_argv
  text = any(a == "--text" or a.startswith("--text=") for a in argv)
  config_flags.DEFINE_config_file(
      "config", TEXT_CONFIG if text else DEFAULT_CONFIG, "a config file (configs/*.py); "
      "override its fields as --config.model.num_layers=4", flag_values=flag_values,
      lock_config=True, sys_argv=sys_argv)


def parse_flags(argv):
  try:   # --config FILE is read here, with its --config.* overrides
    return flags.FLAGS(argv)
  except CONFIG_ERRORS as e:
    sys.exit(config_error(e))


def _cpu_device_count():
  """This flag, else None if the environment says how many CPU devices to make, else 8."""
  if _LOCAL_DEVICE_COUNT.value is not None:
    return _LOCAL_DEVICE_COUNT.value
  if (distributed.ENV_LOCAL_DEVICE_COUNT in os.environ or "JAX_NUM_CPU_DEVICES" in os.environ
      or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")):
    return None
  return DEFAULT_CPU_DEVICES


def main(argv):
  if len(argv) > 1:
    sys.exit(f"train.py: unexpected arguments {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)      # orbax logs every save at INFO; -v 0 shows it
  if _COMPILE_ONLY.value:   # ahead-of-time for a TPU topology: no devices, no data
    from trainer import aot
    try:
      aot.run(flags.FLAGS.config, _COMPILE_ONLY.value)
    except ValueError as e:
      sys.exit(f"train.py: {e}")
    return
  try:   # first: before anything starts the jax backend
    _PROCESSES.initialize(_cpu_device_count())
  except ValueError as e:
    sys.exit(f"multi-process settings: {e}")
  config = flags.FLAGS.config
  if _TEXT.value is not None:
    config.data.kind, config.data.path = "text", _TEXT.value
  try:
    configs.validate(config, jax.device_count())
  except (ValueError, OSError) as e:     # OSError: the config file could not be loaded
    sys.exit(f"config error: {e}")
  name = os.path.splitext(os.path.basename(config_flags.get_config_filename(
      flags.FLAGS["config"])))[0]
  try:
    trainer.train_and_evaluate(config, _WORKDIR.value or os.path.join("runs", name),
                               progress=_PROGRESS.value)
  except trainer.RunError as e:      # one line and the exit code (docs/training.md)
    line = str(e) if isinstance(e, trainer.DataError) else f"train.py: {e}"
    print(line, file=sys.stderr, flush=True)
    sys.exit(e.exit_code)


if __name__ == "__main__":
  try:   # the default config file is read here, with any --config.* overrides
    define_config_flag()
  except CONFIG_ERRORS as e:
    sys.exit(config_error(e))
  app.run(main, flags_parser=parse_flags)
