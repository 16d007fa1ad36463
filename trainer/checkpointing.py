"""Checkpoints of one training run's workdir: save, and resume past what does not restore.

The trainer (:mod:`trainer`) calls these; they hold what is specific to orbax and to the
files of ``WORKDIR``:

- :func:`checkpoint_manager`: an orbax ``CheckpointManager`` of ``WORKDIR/checkpoints``
  (every ``train.checkpoint_every`` steps, keep ``train.keep_checkpoints``, async, atomic);
  :func:`save` starts one save. A checkpoint holds the item ``default`` (the train state)
  and, for data read in order (text), ``data``: the data iterators' state (JSON), saved in
  the same atomic step so a resumed run continues on exactly the next batch.
  :func:`gather_data_state` collects every process's rows of it for process 0 to write.
- :func:`restore_checkpoint`: the newest checkpoint that restores. Each one's shapes and
  dtypes are read from its metadata first and compared with the run's abstract state: a
  checkpoint of another model raises :class:`CheckpointError` naming the first difference
  and the ``model.*`` fields changed since ``WORKDIR/config.json``; one that does not read
  (truncated or missing files) is skipped for the next older one.
- :func:`set_aside`: moves the skipped ones to ``WORKDIR/corrupt_checkpoints/<step>``.
- :func:`write_config`: ``WORKDIR/config.json``, what the shape check compares with.
- :func:`quiet_closed_event_loops`: drops the "Event loop is closed" tracebacks Python
  prints when tensorstore fails to read a damaged checkpoint after orbax closed its loop.

What it does not do: decide when to save or whether a state may be saved (the trainer
saves only applied, finite steps); compare the restored step with ``train.steps``; build
or shard the train state (the caller gives its abstract state); choose exit codes or print
(the trainer turns :class:`CheckpointError` into its ``RunError`` and prints the
warnings).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from zeco_jax.runtime import distributed


class CheckpointError(RuntimeError):
  """The checkpoints cannot be used: one of another model, or none restores (one line)."""


def checkpoint_manager(workdir: str, train: ml_collections.ConfigDict):
  """orbax manager of ``WORKDIR/checkpoints`` (None when ``train.checkpoint_every`` is 0)."""
  if not train.checkpoint_every:
    return None
  options = ocp.CheckpointManagerOptions(
      save_interval_steps=train.checkpoint_every, max_to_keep=train.keep_checkpoints,
      enable_async_checkpointing=train.async_checkpointing, create=True)
  # The handlers let item_metadata read a checkpoint's shapes before restoring it. The
  # state item is orbax's default item name, so checkpoints written with one item restore.
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                               options=options,
                               item_handlers={"default": ocp.StandardCheckpointHandler(),
                                              DATA_ITEM: ocp.JsonCheckpointHandler()})


DATA_ITEM = "data"


def save(mngr, step: int, state, *, force: bool = False, data_state=None) -> None:
  """Starts saving ``state`` (and ``data_state``, a JSON-able dict, if given) as checkpoint
  ``step`` (async; ``force``: whatever the interval)."""
  items = {"default": ocp.args.StandardSave(state)}
  if data_state is not None:
    items[DATA_ITEM] = ocp.args.JsonSave(data_state)
  mngr.save(step, args=ocp.args.Composite(**items), force=force)


def gather_data_state(local: dict) -> dict:
  """The data state with every process's ``rows`` merged (the same on every process).

  ``local`` is :meth:`models.data.Dataset.state` of this process: ``{"rows": {row: state},
  ...}`` for the rows it builds. orbax writes a JSON item from process 0 only, which may
  not build every row, so the rows travel as padded UTF-8 bytes through one all-gather.
  """
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils
  raw = np.frombuffer(json.dumps(local["rows"]).encode(), np.uint8)
  longest = int(np.max(multihost_utils.process_allgather(np.array([raw.size], np.int32))))
  padded = np.zeros(longest, np.uint8)
  padded[:raw.size] = raw
  rows = {}
  for buf in np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, longest):
    rows.update(json.loads(bytes(buf).rstrip(b"\0").decode()))
  return {**local, "rows": rows}


def _named_leaves(tree) -> dict:
  """``{"params.embed": leaf, "opt_state.1.0.mu.embed": leaf, ...}``: orbax's array names."""
  def name(path):
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)
  return {name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _reason(e: BaseException) -> str:
  """An exception as a short phrase (tensorstore appends kilobytes of its spec)."""
  text = " ".join(str(e).split("[tensorstore_spec")[0].split())
  return f"{type(e).__name__}: {text[:300]}"


def _mismatch(meta_tree, abstract_state, optional) -> list:
  """How a checkpoint's arrays differ from this run's state: missing, extra, other shape."""
  saved = {n: (tuple(m.shape), np.dtype(m.dtype)) for n, m in _named_leaves(meta_tree).items()}
  want = {n: (tuple(a.shape), np.dtype(a.dtype))
          for n, a in _named_leaves(abstract_state).items() if n not in optional}
  params_first = lambda n: (not n.startswith("params."), n)
  diffs = [f"{n} is in this run's model but not in the checkpoint"
           for n in sorted(want.keys() - saved.keys(), key=params_first)]
  diffs += [f"{n} is in the checkpoint but not in this run's model"
            for n in sorted(saved.keys() - want.keys() - set(optional), key=params_first)]
  diffs += [f"{n} has shape {saved[n][0]} {saved[n][1]} in the checkpoint, {want[n][0]} "
            f"{want[n][1]} now" for n in sorted(want.keys() & saved.keys(), key=params_first)
            if saved[n] != want[n]]
  return sorted(diffs, key=lambda d: not d.startswith("params."))


def _changed_model_fields(workdir: str, config: ml_collections.ConfigDict) -> str:
  """The model.* fields that differ from ``WORKDIR/config.json`` (the run that trained there)."""
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      before = json.load(f)["model"]
  except (OSError, ValueError, KeyError, TypeError):
    return "compare the model.* fields with the command that wrote it"
  now = config.model.to_dict()
  changed = [f"model.{k} {before.get(k)!r} -> {v!r}" for k, v in now.items()
             if before.get(k, v) != v]
  return ("model fields changed since the run that wrote it: " + ", ".join(changed)
          if changed else "the model.* fields are those of WORKDIR/config.json")


@contextlib.contextmanager
def quiet_closed_event_loops():
  """Drops Python's "Event loop is closed" reports while a checkpoint is read.

  When tensorstore fails to read a damaged checkpoint, its pending callbacks reach an
  asyncio loop that orbax has closed; Python prints each as an unraisable RuntimeError:
  dozens of tracebacks that bury the one line saying what happened. Exactly those are
  dropped; anything else goes to the previous hook.
  """
  previous = sys.unraisablehook

  def hook(unraisable):
    e = unraisable.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  finally:
    gc.collect()            # their finalizers run now, under this hook
    sys.unraisablehook = previous


def restore_checkpoint(mngr, abstract_state: dict, workdir: str,
                       config: ml_collections.ConfigDict, *, optional=(), data=False):
  """The newest checkpoint that restores: ``(step, state, skipped)``, or ``(None, None, [])``.

  ``data``: also restore the data iterators' state; ``state`` then has it under
  ``"data"`` (None when the checkpoint has none).

  ``abstract_state`` is the run's train state as ``jax.ShapeDtypeStruct`` leaves with their
  shardings (restored as those); ``optional`` names its top-level scalar entries that a
  checkpoint may lack (written before they existed): not compared, restored as zeros.
  ``skipped`` lists ``(step, reason)`` of newer checkpoints that did not restore (a
  truncated or missing file). A checkpoint whose arrays differ from ``abstract_state``
  (another model) raises :class:`CheckpointError` naming the first difference and the model
  fields that changed; none restoring raises too (nothing is moved or overwritten then).
  """
  ckpt_dir = os.path.join(workdir, "checkpoints")
  skipped = []
  for step in sorted(mngr.all_steps(), reverse=True):
    try:   # shapes and dtypes only; a corrupt checkpoint usually fails here already
      meta = mngr.item_metadata(step)["default"]
      meta = getattr(meta, "tree", meta)
      if not meta:
        raise ValueError("no metadata")
    except Exception as e:   # noqa: BLE001 (any failure: try the next older checkpoint)
      skipped.append((step, _reason(e)))
      continue
    diffs = _mismatch(meta, abstract_state, optional)
    if diffs:
      more = f" (and {len(diffs) - 1} more differences)" if len(diffs) > 1 else ""
      raise CheckpointError(
          f"checkpoint step {step} in {ckpt_dir} is of another model: {diffs[0]}{more}; "
          f"{_changed_model_fields(workdir, config)}. Resume with the same model.* values, "
          "or train it in a new --workdir.")
    target = {k: v for k, v in abstract_state.items() if k in meta}
    items = {"default": ocp.args.StandardRestore(target)}
    has_data = data and os.path.isdir(os.path.join(ckpt_dir, str(step), DATA_ITEM))
    if has_data:
      items[DATA_ITEM] = ocp.args.JsonRestore()
    try:
      restored = mngr.restore(step, args=ocp.args.Composite(**items))
      state = restored["default"]
      if data:
        state = {**state, "data": restored[DATA_ITEM] if has_data else None}
    except Exception as e:   # noqa: BLE001
      skipped.append((step, _reason(e)))
      continue
    for name in optional:    # a checkpoint from before the entry existed
      if name not in state:
        a = abstract_state[name]
        state[name] = jax.device_put(np.zeros(a.shape, a.dtype), a.sharding)
    return step, state, skipped
  if skipped:
    raise CheckpointError(f"no checkpoint in {ckpt_dir} restores: " + "; ".join(
        f"step {s}: {why}" for s, why in skipped) + ". Move them away (or use a new "
        "--workdir) to start afresh.")
  return None, None, []


def set_aside(mngr, workdir: str, steps) -> dict:
  """Moves checkpoints that did not restore to ``WORKDIR/corrupt_checkpoints/<step>``.

  Kept for inspection, out of orbax's way (a resumed run saves those steps again).
  Returns step -> new path.
  """
  moved = {}
  if distributed.is_main_process():
    for step in steps:
      src = os.path.join(workdir, "checkpoints", str(step))
      dst = os.path.join(workdir, "corrupt_checkpoints", str(step))
      if os.path.exists(dst):
        dst += f".{int(time.time())}"
      if os.path.isdir(src):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
        moved[step] = dst
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("zeco_jax: corrupt checkpoints moved")
  mngr.reload()
  return moved


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """``WORKDIR/config.json``: the config of the run that trains there (for the shape check)."""
  if not distributed.is_main_process():
    return
  path = os.path.join(workdir, "config.json")
  with open(path + ".tmp", "w") as f:
    f.write(config.to_json(indent=1, sort_keys=True))
  os.replace(path + ".tmp", path)

