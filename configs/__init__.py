"""Configs for ``train.py``: every field with its default, and start-up validation.

A config file (``configs/tiny_mqar.py``, ...) defines ``get_config()``, which returns
:func:`defaults` with some fields changed; its docstring says how to run it, on what, how
long it takes and what it reaches. ``train.py`` reads it with ml_collections'
``config_flags.DEFINE_config_file(..., lock_config=True)``, so any field can be overridden
from the command line (``--config.model.num_layers=4 --config.train.lr=3e-4``) and a field
that does not exist is an error, in a config file as on the command line (a typo must not
silently train the wrong thing). :func:`validate` checks a config against the devices at
start-up and raises ValueError naming the field: first every field's type and range
(``configs/schema.py``, one table), then the rules between fields and the devices.

Sections: ``model`` (every family's fields, :func:`models.all_fields`; ``model.family``
picks one), ``data``, ``train``, and ``mesh`` ("auto" or "data=N,seq=M"). The rules
between data fields live with the data (:func:`models.data.validate`).
"""
from __future__ import annotations

import typing

import ml_collections
from ml_collections.config_dict import placeholder

from configs.schema import MESH_AXES, SCHEMA, parse_mesh  # noqa: F401 (re-exported)
from configs import schema
from models import FAMILIES, all_fields, model_from_config, sharding
from models import data as datamod


def _model_defaults() -> dict:
  """Every family's model fields; an Optional field with default None becomes a typed
  placeholder."""
  hints = {}
  for family in reversed(list(FAMILIES.values())):
    hints.update(typing.get_type_hints(family.config))
  out = {}
  for name, field in all_fields().items():
    if field.default is None:
      (kind,) = [t for t in typing.get_args(hints[name]) if t is not type(None)]
      out[name] = placeholder(kind)
    else:
      out[name] = field.default
  out["family"] = "gla"    # a key of models.FAMILIES
  return out


def defaults() -> ml_collections.ConfigDict:
  """Every config field with its default value, locked (no new fields)."""
  config = ml_collections.ConfigDict({
      "model": _model_defaults(),
      "data": {
          # "mqar" (generated), "mqar_docs" (cross-document MQAR, packed documents) or
          # "text" (documents of .txt / .jsonl files, tokenized and packed; models/text.py)
          "kind": "mqar",
          "path": placeholder(str),  # text: a file or a folder (read recursively)
          # text: "bpe" (trained on the corpus, kept in WORKDIR/tokenizer.json), "bytes",
          # or a tokenizer.json file
          "tokenizer": "bpe",
          # mqar_docs / text: pass segment_ids to the model (its state resets at each
          # document start); false: rows are one sequence to the model (for comparison)
          "document_resets": True,
          "seq_len": 2048,
          "batch_size": 8,         # global batch (split over the data axis)
          "seed": 0,
          # MQAR (models/data.py): key-value pairs, later queries of those keys (answer hidden).
          "layout": "boundaries",  # pairs before each segment boundary, queries after; or "start"
          "num_segments": 4,       # boundaries layout: segments (= seq shards at seq=4)
          "query_window": 256,     # boundaries layout: queries in a segment's first N tokens
          "num_keys": 64,          # key alphabet; values use another num_keys tokens
          "num_pairs": 8,          # pairs per episode
          "num_queries": 64,       # queried positions per episode (keys repeat)
          "query_from": 0.25,      # start layout: queries at positions >= query_from * seq_len
          # mqar_docs: document lengths, and queries per document of the previous one's keys
          "doc_len_min": 48,
          "doc_len_max": 96,
          "stale_queries": 4,
      },
      "train": {
          "steps": 1000,
          "lr": 1e-3,
          "min_lr_ratio": 0.1,
          "warmup_steps": 100,
          "weight_decay": 0.1,
          "b1": 0.9,
          "b2": 0.95,
          "grad_clip": 1.0,
          # cross-entropy this many tokens at a time, never forming the [B, T, vocab] logits
          # (zeco_jax.losses.linear_cross_entropy); 0: dense float32 logits
          "loss_chunk_size": 0,
          "compute_dtype": "float32",   # or "bfloat16" (params and optimizer stay float32)
          "seed": 0,                    # parameter init
          "log_every": 10,
          "eval_every": 0,              # 0: only at the end
          "eval_batches": 4,
          "checkpoint_every": 100,      # 0: no checkpoints
          "keep_checkpoints": 3,
          "async_checkpointing": True,
          # Steps whose loss or gradient norm is not finite are skipped (not applied); this
          # many in a row stop the run (exit 3), keeping the last finite checkpoint. 10: an
          # isolated bad batch is skipped and training goes on, while parameters that give
          # non-finite losses on 10 different batches will not recover (a skipped step
          # leaves them unchanged); it wastes at most 10 + log_every steps.
          "max_bad_steps": 10,
          # End this invocation at that step (checkpointed); the same command resumes.
          "stop_after": placeholder(int),
          # Mesh axis of each logical axis (models/sharding.py), e.g. embed=data for FSDP.
          "sharding_rules": {name: axis if axis is not None else placeholder(str)
                             for name, axis in sharding.DEFAULT_RULES},
      },
      # "auto": seq = largest of 4, 2, 1 dividing the device count, data = the rest.
      "mesh": "auto",
  })
  config.lock()
  return config


def resolve_mesh(mesh, num_devices: int) -> dict:
  if mesh == "auto":
    seq = next(s for s in (4, 2, 1) if num_devices % s == 0)
    return {"data": num_devices // seq, "seq": seq}
  mesh = parse_mesh(mesh)
  mesh = {"data": int(mesh.get("data", 1)), "seq": int(mesh.get("seq", 1))}
  if mesh["data"] < 1 or mesh["seq"] < 1 or mesh["data"] * mesh["seq"] != num_devices:
    raise ValueError(f"mesh data={mesh['data']} x seq={mesh['seq']} = "
                     f"{mesh['data'] * mesh['seq']} devices, but {num_devices} are available; "
                     "the axes must multiply to the device count (e.g. --config.mesh=data="
                     f"{num_devices // mesh['seq'] if num_devices % mesh['seq'] == 0 else 1},"
                     f"seq={mesh['seq'] if num_devices % mesh['seq'] == 0 else num_devices}).")
  return mesh


def validate(config: ml_collections.ConfigDict, num_devices: int) -> dict:
  """Checks a config against the devices; returns the resolved mesh shape.

  Raises:
    ValueError: naming the field, its value and what would fit.
  """
  schema.check(config)
  mesh = resolve_mesh(config.mesh, num_devices)
  model, _ = model_from_config(config.model.to_dict())
  model.validate()
  data, train = config.data.to_dict(), config.train.to_dict()
  T, B = data["seq_len"], data["batch_size"]
  if T % (mesh["seq"] * model.chunk_size):
    raise ValueError(f"data.seq_len={T} is not divisible by seq axis ({mesh['seq']}) x "
                     f"model.chunk_size ({model.chunk_size}) = {mesh['seq'] * model.chunk_size}"
                     "; every sequence shard must hold whole chunks.")
  if B % mesh["data"]:
    raise ValueError(f"data.batch_size={B} is not divisible by the data axis ({mesh['data']})")
  datamod.validate(data, model, mesh)
  if train["warmup_steps"] >= train["steps"]:
    raise ValueError(f"train.steps={train['steps']} must be > train.warmup_steps="
                     f"{train['warmup_steps']}")
  if train["eval_every"] and not train["eval_batches"]:
    raise ValueError(f"train.eval_every={train['eval_every']} needs train.eval_batches >= 1 "
                     "(or eval_every=0)")
  return mesh
