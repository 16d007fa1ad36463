"""Training data, a pure function of (seed, step): a resumed run sees exactly the same batches.

``mqar``: multi-query associative recall (Arora et al. 2023, "Zoology"), generated.
Each sequence starts with ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...``; the rest is a
pad token (0) except ``num_queries`` positions at or after ``query_from * seq_len`` that
hold a key whose value must be predicted there (the value itself is never shown again,
so every answer comes from the pair at the start). With ``query_from = 1 / seq`` the pairs
sit on the first sequence shard and every query on a later one: the answer crosses at
least one shard boundary, carried only by the state the All-Scan passes along.

``text``: byte-level language modelling on any file or folder (read recursively):
random windows, next-byte targets, vocabulary 256.

Batches are numpy dicts ``inputs``, ``targets`` (int32 ``[B, T]``) and ``mask``
(float32 ``[B, T]``, where the loss and accuracy count).
"""
from __future__ import annotations

import os

import numpy as np

EVAL_SEED_OFFSET = 1_000_003


def _rng(seed: int, step: int) -> np.random.Generator:
  return np.random.default_rng([int(seed), int(step)])


def mqar_batch(seed: int, step: int, *, batch_size: int, seq_len: int, num_keys: int,
               num_pairs: int, num_queries: int, query_from: float) -> dict:
  rng = _rng(seed, step)
  B, T = batch_size, seq_len
  inputs = np.zeros((B, T), np.int32)
  targets = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), np.float32)
  start = max(2 * num_pairs, int(query_from * T))
  for b in range(B):
    keys = rng.permutation(num_keys)[:num_pairs] + 1
    values = rng.integers(0, num_keys, num_pairs) + 1 + num_keys
    inputs[b, 0:2 * num_pairs:2] = keys
    inputs[b, 1:2 * num_pairs:2] = values
    positions = rng.permutation(T - start)[:num_queries] + start
    which = rng.integers(0, num_pairs, num_queries)
    inputs[b, positions] = keys[which]
    targets[b, positions] = values[which]
    mask[b, positions] = 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


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

  def batch(self, seed: int, step: int, *, batch_size: int, seq_len: int) -> dict:
    n = self.data.size - seq_len - 1
    if n <= 0:
      raise ValueError(f"text data {self.path!r} has {self.data.size} bytes, fewer than "
                       f"seq_len + 1 = {seq_len + 1}")
    offsets = _rng(seed, step).integers(0, n, batch_size)
    window = np.stack([self.data[o:o + seq_len + 1] for o in offsets]).astype(np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:],
            "mask": np.ones((batch_size, seq_len), np.float32)}


class Dataset:
  """``batch(step)`` for training, ``eval_batch(i)`` for a fixed held-out set."""

  def __init__(self, data_cfg: dict):
    self.cfg = dict(data_cfg)
    self.text = ByteText(data_cfg["path"]) if data_cfg["kind"] == "text" else None

  def _make(self, seed, step):
    c = self.cfg
    if self.text is not None:
      return self.text.batch(seed, step, batch_size=c["batch_size"], seq_len=c["seq_len"])
    return mqar_batch(seed, step, batch_size=c["batch_size"], seq_len=c["seq_len"],
                      num_keys=c["num_keys"], num_pairs=c["num_pairs"],
                      num_queries=c["num_queries"], query_from=c["query_from"])

  def batch(self, step: int) -> dict:
    return self._make(self.cfg["seed"], step)

  def eval_batch(self, i: int) -> dict:
    return self._make(self.cfg["seed"] + EVAL_SEED_OFFSET, i)
