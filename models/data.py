"""Training data, a pure function of (seed, step): a resumed run sees exactly the same batches.

``mqar``: multi-query associative recall (Arora et al. 2023, "Zoology"), generated.
Key-value pairs ``k1 v1 k2 v2 ...`` are shown once; later positions hold a key alone (the
query: its value must be predicted there and is never shown again), the rest is a pad
token 0. In the default ``boundaries`` layout the pairs sit at the end of one sequence
segment and their queries at the start of the next; with segments = seq shards every
answer crosses a shard boundary, carried only by the state the All-Scan passes along.
See :func:`mqar_batch`.

``text``: byte-level language modelling on any file or folder (read recursively):
random windows, next-byte targets, vocabulary 256.

Batches are numpy dicts ``inputs``, ``targets`` (int32 ``[B, T]``) and ``mask``
(float32 ``[B, T]``, where the loss and accuracy count).
"""
from __future__ import annotations

import os

import numpy as np

EVAL_SEED_OFFSET = 1_000_003


def _rng(seed: int, step: int, row: int | None = None) -> np.random.Generator:
  key = [int(seed), int(step)] + ([] if row is None else [int(row)])
  return np.random.default_rng(key)


def _row_range(rows, batch_size: int) -> range:
  """The batch rows to build: all, or a slice (a process builds only its own rows)."""
  return range(batch_size)[rows] if rows is not None else range(batch_size)


def mqar_batch(seed: int, step: int, *, batch_size: int, seq_len: int, num_keys: int,
               num_pairs: int, num_queries: int, query_from: float = 0.25,
               layout: str = "boundaries", num_segments: int = 4,
               query_window: int = 256, rows=None) -> dict:
  """One MQAR batch, or only its ``rows`` (a slice; each row has its own random stream).

  Pad token 0; keys 1..num_keys; values num_keys+1..2*num_keys.

  ``layout="start"`` (Zoology): ``num_pairs`` pairs at the start, ``num_queries`` queries
  at positions >= ``query_from * seq_len``.
  ``layout="boundaries"``: the sequence is ``num_segments`` equal segments (= the seq
  shards when seq = num_segments). Each of the first ``num_segments - 1`` segments ends
  with ``num_pairs`` fresh pairs (keys distinct across the whole sequence when the key
  alphabet allows, else distinct from the previous episode's, with new values); the next
  segment opens with ``num_queries`` queries of those keys, in its first ``query_window``
  positions. Every answer is on the other side of a segment boundary from its pair.
  """
  row_ids = _row_range(rows, batch_size)
  B, T = len(row_ids), seq_len
  inputs = np.zeros((B, T), np.int32)
  targets = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), np.float32)
  source = np.full((B, T), -1, np.int32)     # position of the pair a query recalls

  def episode(b, keys, values, kv_start, q_lo, q_hi):
    inputs[b, kv_start:kv_start + 2 * num_pairs:2] = keys
    inputs[b, kv_start + 1:kv_start + 2 * num_pairs:2] = values
    positions = rng.permutation(q_hi - q_lo)[:num_queries] + q_lo
    which = rng.integers(0, num_pairs, num_queries)
    inputs[b, positions] = keys[which]
    targets[b, positions] = values[which]
    mask[b, positions] = 1.0
    source[b, positions] = kv_start + 2 * which

  for b, row in enumerate(row_ids):
    rng = _rng(seed, step, row)
    if layout == "start":
      keys = rng.permutation(num_keys)[:num_pairs] + 1
      values = rng.integers(0, num_keys, num_pairs) + 1 + num_keys
      episode(b, keys, values, 0, max(2 * num_pairs, int(query_from * T)), T)
    else:
      L = T // num_segments
      distinct = (num_segments - 1) * num_pairs <= num_keys
      all_keys = rng.permutation(num_keys)[:(num_segments - 1) * num_pairs] + 1
      keys = np.zeros(0, np.int64)
      for s in range(1, num_segments):
        if distinct:
          keys = all_keys[(s - 1) * num_pairs:s * num_pairs]
        else:   # fresh keys, none from the previous episode (older ones may come back)
          pool = np.setdiff1d(np.arange(1, num_keys + 1), keys)
          keys = rng.permutation(pool)[:num_pairs]
        values = rng.integers(0, num_keys, num_pairs) + 1 + num_keys
        window = min(query_window, L - 2 * num_pairs)
        episode(b, keys, values, s * L - 2 * num_pairs, s * L, s * L + window)
  return {"inputs": inputs, "targets": targets, "mask": mask, "source": source}


def cross_shard_mask(batch: dict, num_shards: int) -> np.ndarray:
  """1.0 where a query's pair lies on an earlier sequence shard than the query itself."""
  T = batch["mask"].shape[1]
  shard = np.arange(T) // (T // num_shards)
  src = batch.get("source")
  if src is None:
    return np.zeros_like(batch["mask"])
  cross = (src >= 0) & (shard[np.maximum(src, 0)] < shard[None, :])
  return (batch["mask"] * cross).astype(np.float32)


class ByteText:
  """All bytes of a file, or of every file under a folder (sorted, concatenated)."""

  def __init__(self, path: str):
    if os.path.isdir(path):
      files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    else:
      files = [path]
    chunks = [np.fromfile(f, np.uint8) for f in files if os.path.isfile(f)]
    self.data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    self.path = path

  def batch(self, seed: int, step: int, *, batch_size: int, seq_len: int, rows=None) -> dict:
    n = self.data.size - seq_len - 1
    if n <= 0:
      raise ValueError(f"text data {self.path!r} has {self.data.size} bytes, fewer than "
                       f"seq_len + 1 = {seq_len + 1}")
    offsets = _rng(seed, step).integers(0, n, batch_size)[_row_range(rows, batch_size)]
    window = np.stack([self.data[o:o + seq_len + 1] for o in offsets]).astype(np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:],
            "mask": np.ones((len(offsets), seq_len), np.float32)}


class Dataset:
  """``batch(step)`` for training, ``eval_batch(i)`` for a fixed held-out set."""

  def __init__(self, data_cfg: dict):
    self.cfg = dict(data_cfg)
    self.text = ByteText(data_cfg["path"]) if data_cfg["kind"] == "text" else None

  def _make(self, seed, step, rows=None):
    c = self.cfg
    if self.text is not None:
      return self.text.batch(seed, step, batch_size=c["batch_size"], seq_len=c["seq_len"],
                             rows=rows)
    return mqar_batch(seed, step, batch_size=c["batch_size"], seq_len=c["seq_len"],
                      num_keys=c["num_keys"], num_pairs=c["num_pairs"],
                      num_queries=c["num_queries"], query_from=c["query_from"],
                      layout=c["layout"], num_segments=c["num_segments"],
                      query_window=c["query_window"], rows=rows)

  def batch(self, step: int, rows=None) -> dict:
    """Training batch of ``step``: ``inputs``, ``targets``, ``mask`` (only ``rows`` if given:
    what one process of a multi-process run builds)."""
    out = self._make(self.cfg["seed"], step, rows)
    return {k: out[k] for k in ("inputs", "targets", "mask")}

  def eval_batch(self, i: int, num_shards: int = 1, rows=None) -> dict:
    """Held-out batch ``i``, plus ``cross``: the queries whose answer is on an earlier shard."""
    out = self._make(self.cfg["seed"] + EVAL_SEED_OFFSET, i, rows)
    out["cross"] = cross_shard_mask(out, num_shards)
    return {k: out[k] for k in ("inputs", "targets", "mask", "cross")}
