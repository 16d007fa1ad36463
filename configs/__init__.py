"""Config files for ``train.py``: load by name or path, override from the command line, validate.

A config is a small Python file defining ``CONFIG``, a nested dict with the sections
``model`` (fields of :class:`models.GLAConfig`), ``data``, ``train`` and ``mesh``; its
docstring says how to run it, on what, how long it takes and what it should reach.
Missing fields take the defaults in :data:`DEFAULTS`; a key that is not in DEFAULTS is an
error (a typo must not silently train the wrong thing).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import os
from typing import Any, Mapping, Sequence

from models.gla import GLAConfig

HERE = os.path.dirname(os.path.abspath(__file__))

DEFAULTS: dict[str, Any] = {
    "model": {f.name: f.default for f in dataclasses.fields(GLAConfig)},
    "data": {
        "kind": "mqar",          # "mqar" (generated) or "text" (bytes of a file or folder)
        "path": None,            # text: a file or a folder (read recursively)
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
        "compute_dtype": "float32",   # or "bfloat16" (params and optimizer stay float32)
        "seed": 0,                    # parameter init
        "log_every": 10,
        "eval_every": 0,              # 0: only at the end
        "eval_batches": 4,
        "checkpoint_every": 100,
        "keep_checkpoints": 3,
        "async_checkpointing": True,
        "stop_after": None,           # stop at this step as if interrupted (tests, demos)
        "workdir": None,              # default runs/<config name>
        "sharding_rules": {},         # logical axis -> mesh axis overrides, e.g. {"embed": "data"}
    },
    # "auto": seq = largest of 4, 2, 1 dividing the device count, data = the rest.
    "mesh": "auto",
}


def _load_file(path: str) -> dict:
  spec = importlib.util.spec_from_file_location(f"zeco_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "CONFIG"):
    raise ValueError(f"config {path}: defines no CONFIG dict")
  return module.CONFIG


def resolve_path(name_or_path: str) -> str:
  if os.path.isfile(name_or_path):
    return name_or_path
  candidate = os.path.join(HERE, name_or_path + ("" if name_or_path.endswith(".py") else ".py"))
  if os.path.isfile(candidate):
    return candidate
  names = sorted(f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and not f.startswith("_"))
  raise ValueError(f"config {name_or_path!r}: neither a file nor one of {names}")


def _merge(base: dict, update: Mapping, where: str) -> dict:
  out = copy.deepcopy(base)
  for key, value in update.items():
    if key not in base:
      raise ValueError(f"config: unknown key {where}{key!r}; known: {sorted(base)}")
    if isinstance(base[key], dict) and key != "sharding_rules":
      if not isinstance(value, Mapping):
        raise ValueError(f"config: {where}{key} must be a dict, got {value!r}")
      out[key] = _merge(base[key], value, f"{where}{key}.")
    else:
      out[key] = value
  return out


def parse_value(text: str):
  """A command-line value: a Python literal (4, 1e-3, True, None, "x", {...}) or a string."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def apply_overrides(cfg: dict, overrides: Sequence[str]) -> dict:
  """``["model.num_layers=4", "train.lr=3e-4"]`` -> a new config."""
  cfg = copy.deepcopy(cfg)
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"--set {item!r}: expected section.key=value")
    dotted, text = item.split("=", 1)
    keys = dotted.strip().split(".")
    node, schema = cfg, DEFAULTS
    for key in keys[:-1]:
      if not isinstance(schema, dict) or key not in schema:
        raise ValueError(f"--set {item!r}: unknown section {key!r}")
      node, schema = node[key], schema[key]
    if not isinstance(schema, dict) or keys[-1] not in schema:
      known = sorted(schema) if isinstance(schema, dict) else []
      raise ValueError(f"--set {item!r}: unknown key {dotted!r}; known here: {known}")
    node[keys[-1]] = parse_value(text)
  return cfg


def load(name_or_path: str = "tiny_mqar", overrides: Sequence[str] = ()) -> dict:
  path = resolve_path(name_or_path)
  cfg = _merge(DEFAULTS, _load_file(path), "")
  cfg = apply_overrides(cfg, overrides)
  cfg["name"] = os.path.splitext(os.path.basename(path))[0]
  return cfg


def parse_mesh(text) -> dict:
  """``"data=2,seq=4"`` or a dict -> ``{"data": 2, "seq": 4}``; "auto" stays "auto"."""
  if text == "auto" or isinstance(text, dict):
    return text
  out = {}
  for part in str(text).split(","):
    name, _, size = part.partition("=")
    if name.strip() not in ("data", "seq") or not size.strip().isdigit():
      raise ValueError(f"--mesh {text!r}: expected data=N,seq=M")
    out[name.strip()] = int(size)
  return out


def resolve_mesh(mesh, num_devices: int) -> dict:
  if mesh == "auto":
    seq = next(s for s in (4, 2, 1) if num_devices % s == 0)
    return {"data": num_devices // seq, "seq": seq}
  mesh = parse_mesh(mesh)
  mesh = {"data": int(mesh.get("data", 1)), "seq": int(mesh.get("seq", 1))}
  if mesh["data"] < 1 or mesh["seq"] < 1 or mesh["data"] * mesh["seq"] != num_devices:
    raise ValueError(f"mesh data={mesh['data']} x seq={mesh['seq']} = "
                     f"{mesh['data'] * mesh['seq']} devices, but {num_devices} are available; "
                     "the axes must multiply to the device count (e.g. --mesh data="
                     f"{num_devices // mesh['seq'] if num_devices % mesh['seq'] == 0 else 1},"
                     f"seq={mesh['seq'] if num_devices % mesh['seq'] == 0 else num_devices}).")
  return mesh


def validate(cfg: dict, num_devices: int) -> dict:
  """Checks a loaded config against the devices; returns the resolved mesh shape."""
  mesh = resolve_mesh(cfg["mesh"], num_devices)
  model = GLAConfig(**cfg["model"])
  model.validate()
  data, train = cfg["data"], cfg["train"]
  T, B = data["seq_len"], data["batch_size"]
  if T % (mesh["seq"] * model.chunk_size):
    raise ValueError(f"data.seq_len={T} is not divisible by seq axis ({mesh['seq']}) x "
                     f"model.chunk_size ({model.chunk_size}) = {mesh['seq'] * model.chunk_size}"
                     "; every sequence shard must hold whole chunks.")
  if B % mesh["data"]:
    raise ValueError(f"data.batch_size={B} is not divisible by the data axis ({mesh['data']})")
  if data["kind"] == "mqar":
    if model.vocab_size < 1 + 2 * data["num_keys"]:
      raise ValueError(f"MQAR needs model.vocab_size >= 1 + 2 * data.num_keys = "
                       f"{1 + 2 * data['num_keys']}, got {model.vocab_size}")
    if data["layout"] == "start":
      episodes, region = 1, T - max(2 * data["num_pairs"], int(data["query_from"] * T))
    elif data["layout"] == "boundaries":
      S = data["num_segments"]
      if S < 2 or T % S:
        raise ValueError(f"data.num_segments={S} must be >= 2 and divide seq_len={T}")
      if T // S <= 2 * data["num_pairs"]:
        raise ValueError(f"data: a segment of seq_len / num_segments = {T // S} tokens cannot "
                         f"hold num_pairs={data['num_pairs']} pairs and queries; use fewer "
                         "segments or pairs")
      episodes, region = S - 1, min(data["query_window"], T // S - 2 * data["num_pairs"])
    else:
      raise ValueError(f"data.layout must be 'boundaries' or 'start', got {data['layout']!r}")
    if not 0 < min(episodes, 2) * data["num_pairs"] <= data["num_keys"]:
      raise ValueError(f"data: two consecutive episodes of num_pairs={data['num_pairs']} "
                       f"distinct keys do not fit in num_keys={data['num_keys']}")
    if not 0 < data["num_queries"] <= region:
      raise ValueError(f"data.num_queries={data['num_queries']} does not fit in a query "
                       f"region of {region} positions")
  elif data["kind"] == "text":
    if not data["path"] or not os.path.exists(data["path"]):
      raise ValueError(f"data.kind='text' needs data.path, an existing file or folder; got "
                       f"{data['path']!r}")
    if model.vocab_size < 256:
      raise ValueError(f"byte-level text needs model.vocab_size >= 256, got {model.vocab_size}")
  else:
    raise ValueError(f"data.kind must be 'mqar' or 'text', got {data['kind']!r}")
  if train["compute_dtype"] not in ("float32", "bfloat16"):
    raise ValueError(f"train.compute_dtype must be 'float32' or 'bfloat16', got "
                     f"{train['compute_dtype']!r}")
  if train["steps"] < 1 or train["warmup_steps"] < 0 or train["warmup_steps"] >= train["steps"]:
    raise ValueError(f"train.steps={train['steps']} must be >= 1 and > train.warmup_steps="
                     f"{train['warmup_steps']}")
  return mesh
