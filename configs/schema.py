"""The type and range of every config field: one table, checked at start-up before anything
compiles.

:data:`SCHEMA` maps each dotted field name (``train.lr``) to a :class:`Field`: its type
(int, float, str or bool), its range or its choices, and whether it may be unset (a
placeholder, None). :func:`check` walks a config, raises ValueError naming the first
field outside its :class:`Field` with its value and what is allowed, and also rejects a
field the table does not know, so a new config field cannot go unchecked.
ml_collections' locked ConfigDict already refuses a value of the wrong type on the command
line (``--config.train.lr=abc``); :func:`allowed` gives the text ``train.py`` adds to that
error. Rules that relate two fields (``warmup_steps < steps``, ``seq_len`` divisible by
seq x chunk size, ...) are in :func:`configs.validate`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from models import sharding
from zeco_jax.ops import BACKENDS
from zeco_jax.scan import SCAN_METHODS

MESH_AXES = ("data", "seq")


@dataclasses.dataclass(frozen=True)
class Field:
  """One field's type and range; ``lo`` / ``hi`` are inclusive unless ``*_open``."""
  kind: type
  lo: Optional[float] = None
  hi: Optional[float] = None
  lo_open: bool = False
  hi_open: bool = False
  choices: Optional[tuple] = None
  optional: bool = False        # None (an unset placeholder) is allowed
  note: str = ""                # what a special value means, e.g. "0: no checkpoints"
  parse: Optional[Callable] = None   # a further check; raises ValueError naming the field

  def allowed(self) -> str:
    """What the field accepts, as a phrase: "an integer >= 1 (0: off)"."""
    if self.choices is not None:
      text = "one of " + ", ".join(repr(c) for c in self.choices)
    elif self.kind is bool:
      text = "true or false"
    elif self.kind is str:
      text = "a string"
    else:
      text = "an integer" if self.kind is int else "a finite number"
      lo = None if self.lo is None else ("> " if self.lo_open else ">= ") + f"{self.lo:g}"
      hi = None if self.hi is None else ("< " if self.hi_open else "<= ") + f"{self.hi:g}"
      if lo and hi:
        text += (f" in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                 f"{')' if self.hi_open else ']'}")
      elif lo or hi:
        text += " " + (lo or hi)
    if self.optional:
      text += " or unset (None)"
    return text + (f" ({self.note})" if self.note else "")

  def problem(self, value) -> Optional[str]:
    """None if ``value`` fits, else why not."""
    if value is None:
      return None if self.optional else "unset"
    if self.kind is bool:
      ok_type = isinstance(value, bool)
    elif self.kind is int:
      ok_type = isinstance(value, int) and not isinstance(value, bool)
    elif self.kind is float:
      ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
      ok_type = isinstance(value, str)
    if not ok_type:
      return f"a {type(value).__name__}"
    if self.choices is not None:
      return None if value in self.choices else "not a choice"
    if self.kind in (int, float):
      if not math.isfinite(value):
        return "not finite"
      if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
        return "too small"
      if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
        return "too large"
    return None


def integer(lo=None, hi=None, **kw) -> Field:
  return Field(int, lo, hi, **kw)


def number(lo=None, hi=None, **kw) -> Field:
  return Field(float, lo, hi, **kw)


def choice(*values, **kw) -> Field:
  return Field(type(values[0]), choices=values, **kw)


def parse_mesh(text: str):
  """``"data=2,seq=4"`` -> ``{"data": 2, "seq": 4}``; "auto" stays "auto"."""
  if text == "auto":
    return text
  out = {}
  for part in str(text).split(","):
    name, _, size = part.partition("=")
    if name.strip() not in MESH_AXES or not size.strip().isdigit():
      raise ValueError(f"mesh {text!r}: expected 'auto' or data=N,seq=M "
                       f"(--config.mesh=data=2,seq=4)")
    out[name.strip()] = int(size)
  return out


SCHEMA: dict[str, Field] = {
    # model: models.GLAConfig (the GLA layer checks divisibility and chunk sizes itself)
    "model.vocab_size": integer(1),
    "model.hidden_size": integer(1),
    "model.num_layers": integer(1),
    "model.num_heads": integer(1),
    "model.expand_k": number(0, lo_open=True),
    "model.expand_v": number(0, lo_open=True),
    "model.hidden_ratio": number(0, lo_open=True),
    "model.intermediate_size": integer(1, optional=True, note="None: from hidden_ratio"),
    "model.gate_low_rank_dim": integer(1),
    "model.gate_logit_normalizer": number(0, lo_open=True),
    "model.gate_bias_init": number(),
    "model.norm_eps": number(0, lo_open=True),
    "model.init_std": number(0, lo_open=True),
    "model.chunk_size": integer(16, note="a multiple of 16"),
    "model.backend": choice(*BACKENDS),
    "model.seq_method": choice(*SCAN_METHODS),
    "model.num_blocks": integer(1, optional=True, note="None: zeco_gla's default"),
    "model.seq_axis": choice("seq", note="the mesh's sequence axis"),
    "model.batch_axes": choice("data", optional=True,
                               note="None: the trainer sets it from the batch sharding"),
    "model.remat": Field(bool),
    "model.use_short_conv": Field(bool),
    "model.conv_size": integer(1),
    "model.family": choice("gla", "gdn", note="the token mixer: models/gdn.py"),
    # data: models/data.py
    "data.kind": choice("mqar", "mqar_docs", "text"),
    "data.path": Field(str, optional=True, note="a file or folder; data.kind='text'"),
    "data.tokenizer": Field(str, note="'bpe', 'bytes' or a tokenizer.json file"),
    "data.document_resets": Field(bool),
    "data.doc_len_min": integer(1),
    "data.doc_len_max": integer(1),
    "data.stale_queries": integer(0),
    "data.seq_len": integer(1),
    "data.batch_size": integer(1),
    "data.seed": integer(0),
    "data.layout": choice("boundaries", "start"),
    "data.num_segments": integer(2),
    "data.query_window": integer(1),
    "data.num_keys": integer(1),
    "data.num_pairs": integer(1),
    "data.num_queries": integer(1),
    "data.query_from": number(0, 1, hi_open=True),
    # train
    "train.steps": integer(1),
    "train.lr": number(0, lo_open=True),
    "train.min_lr_ratio": number(0, 1),
    "train.warmup_steps": integer(0),
    "train.weight_decay": number(0),
    "train.b1": number(0, 1, hi_open=True),
    "train.b2": number(0, 1, hi_open=True),
    "train.grad_clip": number(0, lo_open=True, note="global norm"),
    "train.loss_chunk_size": integer(0, note="0: dense logits; else tokens per chunk"),
    "train.compute_dtype": choice("float32", "bfloat16"),
    "train.seed": integer(0),
    "train.log_every": integer(1),
    "train.eval_every": integer(0, note="0: only at the end"),
    "train.eval_batches": integer(0, note="0: no evaluation"),
    "train.checkpoint_every": integer(0, note="0: no checkpoints"),
    "train.keep_checkpoints": integer(1),
    "train.async_checkpointing": Field(bool),
    "train.stop_after": integer(1, optional=True, note="None: run to train.steps"),
    "train.max_bad_steps": integer(1, note="consecutive non-finite steps before the run "
                                          "stops"),
    **{f"train.sharding_rules.{name}": choice(*MESH_AXES, optional=True, note="None: "
                                              "replicated")
       for name, _ in sharding.DEFAULT_RULES},
    "mesh": Field(str, parse=parse_mesh, note="'auto' or data=N,seq=M"),
}


def allowed(name: str) -> Optional[str]:
  """``"train.lr must be a finite number > 0"``, or None for a field not in the table."""
  field = SCHEMA.get(name)
  return None if field is None else f"{name} must be {field.allowed()}"


def flatten(config: dict, prefix: str = "") -> dict:
  """``{"train": {"lr": 1e-3}}`` -> ``{"train.lr": 1e-3}``."""
  out = {}
  for key, value in config.items():
    if isinstance(value, dict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def check(config) -> None:
  """Every field of ``config`` (a ConfigDict or dict) against :data:`SCHEMA`.

  Raises:
    ValueError: "train.log_every=0: train.log_every must be an integer >= 1".
  """
  values = flatten(config.to_dict() if hasattr(config, "to_dict") else dict(config))
  for name, value in values.items():
    field = SCHEMA.get(name)
    if field is None:
      raise ValueError(f"{name}: not a config field (configs/schema.py lists them all)")
    why = field.problem(value)
    if why is not None:
      reason = "" if why in ("too small", "too large", "not a choice") else f" ({why})"
      raise ValueError(f"{name}={value!r}{reason}: {allowed(name)}")
    if field.parse is not None:
      field.parse(value)          # raises its own ValueError naming the field
  missing = sorted(set(SCHEMA) - set(values))
  if missing:
    raise ValueError(f"config fields missing: {', '.join(missing)} (start from "
                     "configs.defaults())")
