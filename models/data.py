"""Training data. ``mqar`` and ``mqar_docs`` are a pure function of (seed, step); ``text``
is read in order and its iterator state is checkpointed: either way a resumed run sees
exactly the same batches.

``mqar``: multi-query associative recall (Arora et al. 2023, "Zoology"), generated.
Key-value pairs ``k1 v1 k2 v2 ...`` are shown once; later positions hold a key alone (the
query: its value must be predicted there and is never shown again), the rest is a pad
token 0. In the default ``boundaries`` layout the pairs sit at the end of one sequence
segment and their queries at the start of the next; with segments = seq shards every
answer crosses a shard boundary, carried only by the state the All-Scan passes along.
See :func:`mqar_batch`.

``mqar_docs``: cross-document MQAR (:func:`mqar_docs_batch`): rows packed with short
documents, each with its own pairs and queries, ``segment_ids`` per token; queries of
the previous document's keys measure whether anything is recalled across a document
start.

``text``: documents of a folder of .txt / .jsonl files, tokenized and packed with
``segment_ids`` (:mod:`models.text`).

Batches are numpy dicts ``inputs``, ``targets`` (int32 ``[B, T]``), ``mask`` (float32
``[B, T]``, where the loss and accuracy count: never across a document boundary) and, for
packed documents, ``segment_ids`` (int32 ``[B, T]``).
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


def mqar_docs_batch(seed: int, step: int, *, batch_size: int, seq_len: int, num_keys: int,
                    num_pairs: int, num_queries: int, stale_queries: int, doc_len_min: int,
                    doc_len_max: int, rows=None) -> dict:
  """Cross-document MQAR: rows packed with documents, each its own recall task.

  A row is documents of ``doc_len_min..doc_len_max`` tokens (the last one cut at the end of
  the row); ``segment_ids`` number them 1, 2, ... Each document opens with ``num_pairs``
  pairs of distinct keys (drawn afresh, so a key may come back with another value in a
  later document), then, at random positions of the rest (pad 0 elsewhere),
  ``num_queries`` queries of its own keys (target: the value; scored) and
  ``stale_queries`` queries of keys that were in the previous document but are not in
  this one. A stale query has no answer inside its document: it is never scored
  (``mask`` 0); its ``targets`` entry is the previous document's value for that key and
  ``stale`` marks it, so evaluation measures how often a model recalls across a document
  boundary (with the state reset at each start: chance, about 1 / num_keys).
  """
  row_ids = _row_range(rows, batch_size)
  B, T, P = len(row_ids), seq_len, num_pairs
  inputs = np.zeros((B, T), np.int32)
  targets = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), np.float32)
  stale = np.zeros((B, T), np.float32)
  segment_ids = np.zeros((B, T), np.int32)
  source = np.full((B, T), -1, np.int32)
  for b, row in enumerate(row_ids):
    rng = _rng(seed, step, row)
    start, doc, prev = 0, 0, {}
    while start < T:
      doc += 1
      L = int(rng.integers(doc_len_min, doc_len_max + 1))
      end = min(start + L, T)
      segment_ids[b, start:end] = doc
      keys = rng.permutation(num_keys)[:P] + 1
      values = rng.integers(0, num_keys, P) + 1 + num_keys
      pair_pos = start + 2 * np.arange(P)
      for pos, tok in ((pair_pos, keys), (pair_pos + 1, values)):
        keep = pos < end
        inputs[b, pos[keep]] = tok[keep]
      old = np.array(sorted(set(prev) - set(keys.tolist())), np.int64)
      n_stale = min(stale_queries, len(old))
      spots = rng.permutation(L - 2 * P)[:num_queries + n_stale] + start + 2 * P
      which = rng.integers(0, P, num_queries)
      asked = rng.permutation(old)[:n_stale]
      for pos, key, target, is_stale, src in (
          *zip(spots[:num_queries], keys[which], values[which], [0] * num_queries,
               pair_pos[which]),
          *zip(spots[num_queries:], asked, [prev.get(int(k), 0) for k in asked],
               [1] * n_stale, [-1] * n_stale)):
        if pos >= end:
          continue
        inputs[b, pos], targets[b, pos] = key, target
        if is_stale:
          stale[b, pos] = 1.0
        else:
          mask[b, pos], source[b, pos] = 1.0, src
      prev = dict(zip(keys.tolist(), values.tolist()))
      start = end
  return {"inputs": inputs, "targets": targets, "mask": mask, "stale": stale,
          "segment_ids": segment_ids, "source": source}


# Eval masks beyond the loss mask: batch key -> (metric name, its query count name).
EVAL_MASKS = {"cross": ("eval_cross_shard_accuracy", "eval_cross_shard_queries"),
              "stale": ("eval_stale_recall", "eval_stale_queries")}


def batch_keys(data_cfg) -> tuple:
  """The arrays of a training batch for ``data_cfg``; ``segment_ids`` when the data is
  packed documents and ``data.document_resets`` passes them to the model."""
  keys = ("inputs", "targets", "mask")
  if data_cfg["kind"] != "mqar" and data_cfg["document_resets"]:
    keys += ("segment_ids",)
  return keys


def eval_keys(data_cfg) -> tuple:
  return batch_keys(data_cfg) + (("cross", "stale") if data_cfg["kind"] == "mqar_docs"
                                 else ("cross",))


def validate(data: dict, model, mesh: dict) -> None:
  """The rules between the ``data`` fields, the model and the mesh (each field's own type
  and range are ``configs/schema.py``'s); ValueError naming the field and what would fit."""
  T = data["seq_len"]
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
  elif data["kind"] == "mqar_docs":
    if model.vocab_size < 1 + 2 * data["num_keys"]:
      raise ValueError(f"MQAR needs model.vocab_size >= 1 + 2 * data.num_keys = "
                       f"{1 + 2 * data['num_keys']}, got {model.vocab_size}")
    if data["num_pairs"] > data["num_keys"]:
      raise ValueError(f"data.num_pairs={data['num_pairs']} distinct keys do not fit in "
                       f"num_keys={data['num_keys']}")
    room = data["doc_len_min"] - 2 * data["num_pairs"]
    if data["doc_len_max"] < data["doc_len_min"] or (
        data["num_queries"] + data["stale_queries"] > room):
      raise ValueError(f"data: documents of doc_len_min={data['doc_len_min']} .. doc_len_max="
                       f"{data['doc_len_max']} tokens cannot hold num_pairs="
                       f"{data['num_pairs']} pairs and num_queries + stale_queries = "
                       f"{data['num_queries'] + data['stale_queries']} queries; raise "
                       "doc_len_min (and doc_len_max >= it)")
  elif data["kind"] == "text":
    if not data["path"] or not os.path.exists(data["path"]):
      raise ValueError(f"data.kind='text' needs data.path (or train.py --text DIR), an "
                       f"existing file or folder; got {data['path']!r}")
    need = 257 if data["tokenizer"] == "bytes" else 258
    if model.vocab_size < need:
      raise ValueError(f"text with data.tokenizer={data['tokenizer']!r} needs "
                       f"model.vocab_size >= {need} (256 bytes and the end-of-document "
                       f"token{', and merges' if need > 257 else ''}), got {model.vocab_size}")
  else:
    raise ValueError(f"data.kind must be 'mqar', 'mqar_docs' or 'text', got {data['kind']!r}")


class Dataset:
  """``batch(step)`` for training, ``eval_batch(i)`` for a fixed held-out set.

  ``mqar`` and ``mqar_docs`` batches are a function of (seed, step): any step, any order.
  ``text`` (:class:`models.text.TextData`) is read in step order from grain iterators;
  ``stateful`` is True and :meth:`state` / :meth:`restore` carry their position across a
  checkpoint. ``vocab_size``, ``workdir`` and ``write`` are for the text tokenizer.
  """

  def __init__(self, data_cfg: dict, *, vocab_size: int = 0, workdir=None, write=True):
    self.cfg = dict(data_cfg)
    self.keys, self._eval_keys = batch_keys(self.cfg), eval_keys(self.cfg)
    self.text = None
    if data_cfg["kind"] == "text":
      from models.text import TextData
      self.text = TextData(self.cfg, vocab_size, workdir, write)
    self.stateful = self.text is not None
    # What reading the corpus noticed but did not stop for (files not UTF-8, skipped ones).
    self.warnings = list(self.text.docs.warnings) if self.text is not None else []

  def _make(self, seed, step, rows=None):
    c = self.cfg
    if c["kind"] == "mqar_docs":
      return mqar_docs_batch(seed, step, batch_size=c["batch_size"], seq_len=c["seq_len"],
                             num_keys=c["num_keys"], num_pairs=c["num_pairs"],
                             num_queries=c["num_queries"], stale_queries=c["stale_queries"],
                             doc_len_min=c["doc_len_min"], doc_len_max=c["doc_len_max"],
                             rows=rows)
    return mqar_batch(seed, step, batch_size=c["batch_size"], seq_len=c["seq_len"],
                      num_keys=c["num_keys"], num_pairs=c["num_pairs"],
                      num_queries=c["num_queries"], query_from=c["query_from"],
                      layout=c["layout"], num_segments=c["num_segments"],
                      query_window=c["query_window"], rows=rows)

  def batch(self, step: int, rows=None) -> dict:
    """Training batch of ``step``: ``inputs``, ``targets``, ``mask`` and, for packed
    documents with ``data.document_resets``, ``segment_ids`` (only ``rows`` if given: what
    one process of a multi-process run builds)."""
    out = (self.text.batch(step, rows) if self.text is not None
           else self._make(self.cfg["seed"], step, rows))
    return {k: out[k] for k in self.keys}

  def eval_batch(self, i: int, num_shards: int = 1, rows=None) -> dict:
    """Held-out batch ``i``, plus ``cross`` (the queries whose answer is on an earlier
    shard) and, for ``mqar_docs``, ``stale`` (queries of the previous document's keys)."""
    if self.text is not None:
      out = self.text.eval_batch(i, rows)
    else:
      out = self._make(self.cfg["seed"] + EVAL_SEED_OFFSET, i, rows)
      out["cross"] = cross_shard_mask(out, num_shards)
    return {k: out[k] for k in self._eval_keys}

  def state(self, step: int) -> dict:
    """The text iterators' position before batch ``step`` (JSON-able; text only)."""
    return self.text.state(step)

  def restore(self, state: dict, rows=None) -> None:
    self.text.restore(state, rows)
