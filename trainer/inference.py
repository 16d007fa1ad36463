"""A trained run, loaded for inference: its config, latest checkpoint and tokenizer.

``generate.py`` uses :func:`load_run`; so can a notebook:

    run = load_run("runs/text_tiny", make_mesh({"data": 1, "seq": 1}))
    tokens, lengths = run.model.generate(run.encode("Once upon"), max_new_tokens=32)
    print(run.tokenizer.decode(tokens[0, :lengths[0]]))

What a workdir holds (written by :mod:`trainer.loop`): ``config.json`` (the run's config:
the model to build), ``checkpoints/<step>`` (orbax; the newest that restores is taken, with
the same shape check as a resumed run: a checkpoint of another model is an error naming the
difference) and, for text runs trained with ``data.tokenizer="bpe"``, ``tokenizer.json``.
Runs on synthetic data have no tokenizer: their prompts are UTF-8 bytes (ids 0..255).
"""
from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
from flax import nnx

from models import text as textmod
from trainer import checkpointing
from trainer.experiment import Experiment


class LoadError(RuntimeError):
  """The workdir cannot be used for inference (one line)."""


class TrainedRun(NamedTuple):
  config: ml_collections.ConfigDict     # the run's config.json
  model: nnx.Module                     # the LM with the checkpoint's parameters
  step: int                             # the checkpoint's step
  tokenizer: textmod.Tokenizer          # the run's tokenizer (bytes for synthetic data)

  def encode(self, text: str) -> np.ndarray:
    """int32 ``[1, T]``: ``text`` as a prompt (without the end-of-document token)."""
    return self.tokenizer.encode(text)[None, :-1]


def load_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, "config.json")
  if not os.path.isdir(workdir):
    raise LoadError(f"no workdir {workdir!r}: pass the --workdir of a training run "
                    "(python train.py --workdir DIR)")
  if not os.path.isfile(path):
    raise LoadError(f"{workdir!r} holds no training run (no config.json): pass the --workdir "
                    "a train.py run wrote")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def tokenizer_of(config: ml_collections.ConfigDict, workdir: str) -> textmod.Tokenizer:
  """The run's tokenizer: ``data.tokenizer`` of a text run; bytes otherwise."""
  vocab = config.model.vocab_size
  spec = config.data.tokenizer if config.data.kind == "text" else "bytes"
  if spec == "bytes":
    tok = textmod.Tokenizer()
  else:
    path = os.path.join(workdir, textmod.TOKENIZER_FILE) if spec == "bpe" else spec
    if not os.path.isfile(path):
      raise LoadError(f"the run's tokenizer ({spec!r}) is not at {path!r}; it is written when "
                      "the run starts: copy it there")
    tok = textmod.load_tokenizer(path)
  if tok.vocab_size - (spec == "bytes") > vocab:   # bytes: ids 0..255, the model's EOS aside
    raise LoadError(f"the run's model has model.vocab_size={vocab}, fewer than the "
                    f"{tok.vocab_size} tokens of its tokenizer ({spec!r}); nothing to decode")
  return tok


def load_run(workdir: str, mesh: jax.sharding.Mesh) -> TrainedRun:
  """The newest checkpoint of ``workdir`` that restores, as a model on ``mesh``."""
  config = load_config(workdir)
  tokenizer = tokenizer_of(config, workdir)
  exp = Experiment(config, mesh)
  mngr = checkpointing.checkpoint_manager(workdir, config.train)
  if mngr is None or not mngr.all_steps():
    raise LoadError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}: the run saved "
                    "none yet (train.checkpoint_every)")
  try:
    with checkpointing.quiet_closed_event_loops():
      step, state, _ = checkpointing.restore_checkpoint(mngr, exp.abstract_state, workdir,
                                                        config)
  except checkpointing.CheckpointError as e:
    raise LoadError(str(e)) from e
  finally:
    mngr.close()
  model = nnx.eval_shape(lambda: exp.model_cls(exp.model_cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract = nnx.split(model)
  nnx.replace_by_pure_dict(abstract, state["params"])
  return TrainedRun(config, nnx.merge(graphdef, abstract), int(step), tokenizer)


__all__ = ["LoadError", "TrainedRun", "load_config", "load_run", "tokenizer_of"]
