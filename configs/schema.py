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
from zeco_jax.ops._dispatch import BACKENDS
from zeco_jax.ops.attention.op import BACKENDS as ATTENTION_BACKENDS
from zeco_jax.ops.attention.parallel import ATTENTION_METHODS
from zeco_jax.sp.scan import SCAN_METHODS

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
  doc: str = ""                 # what the field is (every field of SCHEMA has one)

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


def _doc(field: Field, doc: str) -> Field:
  return dataclasses.replace(field, doc=doc)


SCHEMA: dict[str, Field] = {name: _doc(field, doc) for name, (field, doc) in {
    # model: every family's fields (models.all_fields); model.family picks the family
    "model.family": (choice("gla", "gdn", "kda", note="models.FAMILIES"),
                     "the token mixer: GLA, Gated DeltaNet or Kimi Delta Attention"),
    "model.vocab_size": (integer(1), "tokens in the vocabulary (embedding and tied head)"),
    "model.hidden_size": (integer(1), "model width"),
    "model.num_layers": (integer(1), "blocks (mixer + SwiGLU)"),
    "model.num_heads": (integer(1), "heads of the token mixer"),
    "model.expand_k": (number(0, lo_open=True), "key dim = hidden_size * expand_k"),
    "model.expand_v": (number(0, lo_open=True), "value dim = hidden_size * expand_v"),
    "model.hidden_ratio": (number(0, lo_open=True),
                           "SwiGLU width / hidden_size when intermediate_size is unset"),
    "model.intermediate_size": (integer(1, optional=True, note="None: from hidden_ratio"),
                                "SwiGLU width"),
    "model.gate_low_rank_dim": (integer(1), "GLA: rank of the decay gate's projection"),
    "model.kda_lower_bound": (number(hi=0, hi_open=True, optional=True, note="None: unbounded"),
                              "KDA: lower bound of the log-decay (FLA's lower_bound, e.g. -5)"),
    "model.gate_logit_normalizer": (number(0, lo_open=True),
                                    "GLA: g = logsigmoid(...) / this"),
    "model.gate_bias_init": (number(), "GLA: initial gate bias (> 0: slower decay)"),
    "model.norm_eps": (number(0, lo_open=True), "RMSNorm epsilon"),
    "model.init_std": (number(0, lo_open=True), "std of the projections at init"),
    "model.chunk_size": (integer(16, note="a multiple of 16"), "tokens per chunk of the op"),
    "model.backend": (choice(*BACKENDS), "GLA: jnp path or Pallas kernels (auto: by target)"),
    "model.seq_method": (choice(*SCAN_METHODS), "the state scan over the seq axis"),
    "model.num_blocks": (integer(1, optional=True, note="None: the op's default"),
                         "All-Scan pipeline blocks along V"),
    "model.seq_group_size": (integer(1, optional=True, note="None: the op's default"),
                             "all_scan_2level: ranks per group along the sequence"),
    "model.seq_axis": (choice("seq", note="the mesh's sequence axis"),
                       "mesh axis the sequence is split over"),
    "model.batch_axes": (choice("data", optional=True,
                                note="None: the trainer sets it from the batch sharding"),
                         "mesh axis the batch is split over"),
    "model.remat": (Field(bool), "recompute each block in the backward"),
    "model.use_short_conv": (Field(bool), "causal short convolution on q, k, v"),
    "model.conv_size": (integer(1), "the short convolution's width"),
    "model.layer_pattern": (Field(str, note="'': every block linear; letters L and A tiled"),
                            "hybrid models: linear (L) and softmax attention (A) blocks"),
    "model.attn_num_heads": (integer(0, note="0: num_heads"), "attention blocks' query heads"),
    "model.attn_num_kv_heads": (integer(0, note="0: attn_num_heads"),
                                "attention blocks' key / value heads (dividing the query heads)"),
    "model.attn_head_dim": (integer(0, note="0: hidden_size / attention heads"),
                            "attention blocks' dim per head"),
    "model.attn_seq_method": (choice(*ATTENTION_METHODS),
                              "attention over the seq axis (zeco_jax.ATTENTION_METHODS)"),
    "model.attn_window": (integer(1, optional=True, note="None: the whole document"),
                          "attention blocks' sliding window"),
    "model.attn_backend": (choice(*ATTENTION_BACKENDS),
                           "attention blocks' local attention (cuDNN on GPU, splash on TPU)"),
    "model.rope_theta": (number(0, lo_open=True), "attention blocks' rotary embedding base"),
    # data: models/data.py (rules between fields: models.data.validate)
    "data.kind": (choice("mqar", "mqar_docs", "text"),
                  "generated recall, packed recall documents, or a text corpus"),
    "data.path": (Field(str, optional=True, note="a file or folder; data.kind='text'"),
                  "the corpus: .txt files or .jsonl lines"),
    "data.tokenizer": (Field(str, note="'bpe', 'bytes' or a tokenizer.json file"),
                       "text: the tokenizer"),
    "data.document_resets": (Field(bool), "pass segment_ids to the model (state resets)"),
    "data.doc_len_min": (integer(1), "mqar_docs: shortest document"),
    "data.doc_len_max": (integer(1), "mqar_docs: longest document"),
    "data.stale_queries": (integer(0), "mqar_docs: queries of the previous document's keys"),
    "data.seq_len": (integer(1), "tokens per row"),
    "data.batch_size": (integer(1), "rows per step (global; split over data)"),
    "data.seed": (integer(0), "data order and generation"),
    "data.layout": (choice("boundaries", "start"), "mqar: where pairs and queries sit"),
    "data.num_segments": (integer(2), "mqar boundaries: segments of a row"),
    "data.query_window": (integer(1), "mqar boundaries: queries in a segment's first N"),
    "data.num_keys": (integer(1), "mqar: key alphabet"),
    "data.num_pairs": (integer(1), "mqar: pairs per episode"),
    "data.num_queries": (integer(1), "mqar: queried positions per episode"),
    "data.query_from": (number(0, 1, hi_open=True), "mqar start: first query position / T"),
    # train
    "train.steps": (integer(1), "optimizer steps"),
    "train.lr": (number(0, lo_open=True), "peak learning rate"),
    "train.min_lr_ratio": (number(0, 1), "final / peak learning rate (cosine)"),
    "train.warmup_steps": (integer(0), "linear warmup steps"),
    "train.weight_decay": (number(0), "AdamW decay (matrices only)"),
    "train.b1": (number(0, 1, hi_open=True), "AdamW beta1"),
    "train.b2": (number(0, 1, hi_open=True), "AdamW beta2"),
    "train.grad_clip": (number(0, lo_open=True, note="global norm"), "gradient clipping"),
    "train.loss_chunk_size": (integer(0, note="0: dense logits; else tokens per chunk"),
                              "cross-entropy without [B, T, vocab] logits"),
    "train.compute_dtype": (choice("float32", "bfloat16"),
                            "dtype of the forward (params stay float32)"),
    "train.seed": (integer(0), "parameter init"),
    "train.log_every": (integer(1), "steps per metrics row"),
    "train.eval_every": (integer(0, note="0: only at the end"), "steps between evaluations"),
    "train.eval_batches": (integer(0, note="0: no evaluation"), "held-out batches per eval"),
    "train.checkpoint_every": (integer(0, note="0: no checkpoints"),
                               "steps between checkpoints"),
    "train.keep_checkpoints": (integer(1), "newest checkpoints kept"),
    "train.async_checkpointing": (Field(bool), "write checkpoints in the background"),
    "train.stop_after": (integer(1, optional=True, note="None: run to train.steps"),
                         "end this invocation at that step (resumable)"),
    "train.max_bad_steps": (integer(1, note="consecutive non-finite steps before the run "
                                            "stops"), "divergence guard"),
    **{f"train.sharding_rules.{name}": (choice(*MESH_AXES, optional=True,
                                               note="None: replicated"),
                                        f"mesh axis of the logical axis {name!r}")
       for name, _ in sharding.DEFAULT_RULES},
    "mesh": (Field(str, parse=parse_mesh, note="'auto' or data=N,seq=M"), "the device mesh"),
}.items()}


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
