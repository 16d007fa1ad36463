"""Real text for the trainer: documents, a tokenizer, and packed rows with document ids.

``data.kind="text"`` (``python train.py --text DIR``). The corpus is a file or a folder read
recursively (sorted; hidden files and folders skipped):

* ``*.txt``: one document per file (a book, an article, a web page);
* ``*.jsonl``: one document per line, its ``"text"`` field (blank lines skipped).

Tokenizer (``data.tokenizer``): ``"bpe"`` trains a byte-level BPE of ``model.vocab_size``
tokens (Hugging Face ``tokenizers``) on the training documents and keeps it as
``WORKDIR/tokenizer.json``, which a resumed run loads instead of training again; a path
loads that ``tokenizer.json``; ``"bytes"`` is UTF-8 bytes (ids 0..255, end-of-document 256).
Every document ends with the end-of-document token (``<|endoftext|>``), so the model learns
where a document ends.

Packing (:class:`TextData`): documents are tokenized and packed into rows of ``seq_len``
tokens by grain's concat-then-split packer: a row holds the end of one document, whole
documents, and the beginning of the next, which continues in the next row of that stream.
``segment_ids`` number the documents of a row (1, 2, ...; a new document starts where the
id changes; rows have no padding) and go to every GLA layer, whose state resets at each
start (``zeco_jax.segments``). ``targets[t] = inputs[t + 1]`` and ``mask[t]`` is 1 only if
both are in the same document: the prediction of another document's first token from the
end of the previous one is not scored, nor is the last position of a row (its target is in
the next row).

Loading, sharding, resume: each row ``b`` of the global ``[B, T]`` batch is its own grain
stream: training documents ``b, b + B, b + 2B, ...``, shuffled with ``(data.seed, b)``,
reshuffled each epoch, repeated forever. A process builds only the rows its devices hold
(:meth:`batch`'s ``rows``), so with data parallelism over processes each reads a disjoint
part of the corpus, and everything is deterministic. The state of each row's iterator
(:meth:`state`, a small JSON-able dict per row) is saved with the checkpoint; restoring it
(:meth:`restore`) continues on exactly the next batch, with any number of processes, as long
as ``data.batch_size``, ``data.seq_len``, the corpus and the tokenizer are the same.

Held out: every 20th document (index 0, 20, 40, ... in file order) is never trained on; the
evaluation batches are the first ``train.eval_batches`` batches of one stream over them.

What it does not do: read compressed files or other formats; stream a corpus too large for
an index of (file, offset, length) per document in memory; pad documents to rows (no row
has padding).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np

EOS = "<|endoftext|>"
HELD_OUT_EVERY = 20                      # document i is held out when i % 20 == 0
TOKENIZER_FILE = "tokenizer.json"
BPE_TRAIN_CHARS = 200_000_000            # a BPE is trained on at most this much text
EXTENSIONS = (".txt", ".jsonl")


class Documents:
  """The documents of a file or folder, read on access (a grain random-access source).

  Every document is checked when the index is built (which reads every file once): a
  ``.jsonl`` line that is not a JSON object with a string ``"text"`` is a ValueError naming
  the file and line; a ``.txt`` file that is not UTF-8 is decoded with U+FFFD for its bad
  bytes and noted in :attr:`warnings` (with the count), or skipped when most of it is not
  text (a binary file). Nothing is found later in a loader thread.
  """

  def __init__(self, path: str):
    if os.path.isdir(path):
      files = []
      for d, dirs, fs in os.walk(path):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        files += [os.path.join(d, f) for f in sorted(fs)
                  if f.endswith(EXTENSIONS) and not f.startswith(".")]
    elif os.path.isfile(path):
      files = [path]
    else:
      raise ValueError(f"data.path={path!r}: no such file or folder")
    self.path, self.files, self.warnings, index = path, [], [], []
    for f in files:
      entries = _jsonl_index(f) if f.endswith(".jsonl") else _txt_index(f, self.warnings)
      if entries:
        index += [(len(self.files), offset, length) for offset, length in entries]
        self.files.append(f)
    if not index:
      found = (f"{len(files)} file(s), none with a document" if files else
               "no .txt or .jsonl file")
      raise ValueError(f"data.path={path!r} holds no documents ({found}): expected .txt "
                       "files (one document each) or .jsonl files (one JSON object with a "
                       "\"text\" field per line)")
    self.index = np.asarray(index, np.int64)

  def __len__(self) -> int:
    return len(self.index)

  def __getitem__(self, i) -> str:
    f, offset, length = (int(x) for x in self.index[i])
    with open(self.files[f], "rb") as fh:
      fh.seek(offset)
      raw = fh.read(length)
    if not self.files[f].endswith(".jsonl"):
      return raw.decode("utf-8", errors="replace")
    return json.loads(raw)["text"]           # checked when the index was built

  def fingerprint(self) -> str:
    """Files, sizes and document count: a resumed run must read the same corpus."""
    h = hashlib.sha256()
    for f in self.files:
      h.update(f"{os.path.relpath(f, self.path)}:{os.path.getsize(f)};".encode())
    h.update(str(len(self)).encode())
    return h.hexdigest()[:16]


NOT_TEXT_FRACTION = 0.5   # a .txt file with more undecodable / control characters is skipped


def _jsonl_index(path: str) -> list:
  """(offset, length) of every non-blank line of a .jsonl file, each checked to be a JSON
  object with a string "text"; ValueError naming the file and line otherwise."""
  entries, offset = [], 0
  with open(path, "rb") as fh:
    for number, line in enumerate(fh, 1):
      if line.strip():
        try:
          text = json.loads(line)["text"]
          if not isinstance(text, str):
            raise TypeError(f"\"text\" is a {type(text).__name__}, not a string")
        except (ValueError, KeyError, TypeError) as e:
          why = "no \"text\" field" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
          raise ValueError(f"{path} line {number}: not a JSON object with a string \"text\" "
                           f"field ({why}); fix or remove the line") from None
        entries.append((offset, len(line)))
      offset += len(line)
  return entries


def _txt_index(path: str, warnings: list) -> list:
  """[(0, size)] for a .txt document; a file that is not UTF-8 is noted in ``warnings``,
  and skipped (noted too) when most of its characters are U+FFFD or control characters."""
  with open(path, "rb") as fh:
    raw = fh.read()
  if not raw:
    return []
  try:
    raw.decode("utf-8")
  except UnicodeDecodeError:
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    junk = bad + sum(1 for c in text if c < " " and c not in "\t\n\r\f")
    if junk > NOT_TEXT_FRACTION * len(text):
      warnings.append(f"{path}: skipped, not text ({junk} of {len(text)} characters are not "
                      "UTF-8 or are control characters)")
      return []
    warnings.append(f"{path}: {bad} byte sequence(s) not UTF-8, read as U+FFFD")
  return [(0, len(raw))]


class Tokenizer:
  """``encode(text)`` -> int32 ids ending with the end-of-document id; ``vocab_size``."""

  def __init__(self, hf=None):
    self.hf = hf                                  # a tokenizers.Tokenizer, or None: bytes
    if hf is None:
      self.vocab_size, self.eos_id = 257, 256
    else:
      self.vocab_size, self.eos_id = hf.get_vocab_size(), hf.token_to_id(EOS)
      if self.eos_id is None:
        raise ValueError(f"the tokenizer has no {EOS!r} token (the end-of-document token); "
                         "add it as a special token")

  def encode(self, text: str) -> np.ndarray:
    if self.hf is None:
      ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    else:
      ids = np.asarray(self.hf.encode(text).ids, np.int32)
    return np.append(ids, np.int32(self.eos_id))

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids if int(i) != self.eos_id]
    if self.hf is None:
      return bytes(ids).decode("utf-8", errors="replace")
    return self.hf.decode(ids)

  def to_str(self) -> str:
    return "bytes" if self.hf is None else self.hf.to_str()


def train_bpe(texts, vocab_size: int) -> Tokenizer:
  """A byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` is id 0) on ``texts``.

  Deterministic: the same texts give the same tokenizer (tested), so every process of a
  multi-process run trains the same one.
  """
  from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
  hf = HFTokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  hf.train_from_iterator(texts, trainer=trainer)
  return Tokenizer(hf)


def load_tokenizer(path: str) -> Tokenizer:
  from tokenizers import Tokenizer as HFTokenizer
  return Tokenizer(HFTokenizer.from_file(path))


def get_tokenizer(spec: str, docs: Documents, train_ids, vocab_size: int,
                  workdir: Optional[str], write: bool = True) -> Tokenizer:
  """``data.tokenizer``: "bytes", a tokenizer.json path, or "bpe" (trained on the training
  documents, or ``WORKDIR/tokenizer.json`` if an earlier run there wrote one)."""
  if spec == "bytes":
    tok = Tokenizer()
  elif spec != "bpe":
    if not os.path.isfile(spec):
      raise ValueError(f"data.tokenizer={spec!r}: not 'bpe', 'bytes' or an existing "
                       "tokenizer.json file")
    tok = load_tokenizer(spec)
  else:
    cached = os.path.join(workdir, TOKENIZER_FILE) if workdir else None
    if cached and os.path.isfile(cached):
      tok = load_tokenizer(cached)
    else:
      def texts():
        total = 0
        for i in train_ids:
          text = docs[int(i)]
          total += len(text)
          yield text
          if total >= BPE_TRAIN_CHARS:
            return
      tok = train_bpe(texts(), vocab_size)
      if cached and write:        # atomic: another process may read it at the same time
        os.makedirs(workdir, exist_ok=True)
        tmp = f"{cached}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
          f.write(tok.to_str())
        os.replace(tmp, cached)
  if tok.vocab_size > vocab_size:
    raise ValueError(f"data.tokenizer={spec!r} has {tok.vocab_size} tokens, more than "
                     f"model.vocab_size={vocab_size}; raise --config.model.vocab_size")
  return tok


def pack_rows(token_rows: np.ndarray, segment_rows: np.ndarray) -> dict:
  """Packed rows ``[R, T]`` (tokens, their document ids) -> the model's batch.

  ``inputs`` = the tokens; ``targets[t]`` = ``inputs[t + 1]``; ``mask[t]`` = 1 where the
  target is in the same document as ``inputs[t]`` (and not padding: a negative id), else 0
  (the last position of a row has no target); ``segment_ids`` = the document ids.
  """
  tokens = np.asarray(token_rows, np.int32)
  seg = np.asarray(segment_rows, np.int32)
  targets = np.zeros_like(tokens)
  targets[:, :-1] = tokens[:, 1:]
  mask = np.zeros(tokens.shape, np.float32)
  mask[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] >= 0)
  return {"inputs": tokens, "targets": targets, "mask": mask, "segment_ids": seg}


def _stream(docs: Documents, doc_ids, tokenizer: Tokenizer, seq_len: int,
            seed: Optional[int]):
  """grain: documents ``doc_ids`` (shuffled per epoch with ``seed``, or in order), repeated,
  tokenized and packed into rows of ``seq_len``."""
  import grain
  from grain.experimental import ConcatThenSplitIterDataset
  ds = grain.MapDataset.source(np.asarray(doc_ids, np.int64))
  if seed is not None:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat().map(lambda i: {"tokens": tokenizer.encode(docs[int(i)])})
  # One reader thread per row, a few documents ahead: grain's default (16 threads, 500
  # documents ahead per iterator) took 1 s per row to start on 2 cores. Prefetching does
  # not change the iterator state, which counts only what was consumed.
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=16))
  return ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len})


def _row_seed(seed: int, row: int) -> int:
  return int(np.random.default_rng([int(seed), int(row)]).integers(0, 2**32 - 1))


class TextData:
  """Packed text batches: ``batch(step, rows)`` in step order, ``state`` / ``restore``.

  ``workdir``: where ``data.tokenizer="bpe"`` keeps its tokenizer (None: train, keep none);
  ``write``: whether this process writes it (process 0).
  """

  def __init__(self, data_cfg: dict, vocab_size: int, workdir: Optional[str] = None,
               write: bool = True):
    self.cfg = dict(data_cfg)
    self.batch_size, self.seq_len = self.cfg["batch_size"], self.cfg["seq_len"]
    self.docs = Documents(self.cfg["path"])
    ids = np.arange(len(self.docs))
    self.train_ids = ids[ids % HELD_OUT_EVERY != 0]
    self.eval_ids = ids[ids % HELD_OUT_EVERY == 0]
    if len(self.train_ids) < self.batch_size:
      raise ValueError(
          f"data.path={self.cfg['path']!r} has {len(self.docs)} documents, "
          f"{len(self.train_ids)} for training (every {HELD_OUT_EVERY}th is held out), fewer "
          f"than data.batch_size={self.batch_size} (each batch row reads its own documents); "
          "split the text into more documents (.jsonl lines or .txt files)")
    self.tokenizer = get_tokenizer(self.cfg.get("tokenizer") or "bpe", self.docs,
                                   self.train_ids, vocab_size, workdir, write)
    self._iters = {}            # row -> grain iterator, positioned at batch self._step
    self._step = 0
    self._before = None         # (step, states before that step's batch)
    self._eval_rows = None

  def _iterator(self, row: int):
    if row not in self._iters:
      if self._step:
        raise ValueError(f"row {row} was not restored (restore() with every row's state)")
      B = self.batch_size
      stream = _stream(self.docs, self.train_ids[row::B], self.tokenizer, self.seq_len,
                       _row_seed(self.cfg["seed"], row))
      self._iters[row] = iter(stream)
    return self._iters[row]

  def batch(self, step: int, rows=None) -> dict:
    """Batch ``step`` (0, 1, 2, ... in order, from the start or a restored state): only
    ``rows`` (a slice of range(batch_size)) if given."""
    if step != self._step:
      raise ValueError(f"text batches come in order: asked for step {step}, the iterators "
                       f"are at step {self._step} (restore() the state of step {step})")
    rows = list(range(self.batch_size)[rows] if rows is not None else range(self.batch_size))
    its = [self._iterator(r) for r in rows]
    self._before = (step, {r: it.get_state() for r, it in zip(rows, its)})
    packed = [next(it) for it in its]
    self._step = step + 1
    return pack_rows(np.stack([p["tokens"] for p in packed]),
                     np.stack([p["tokens_segment_ids"] for p in packed]))

  def state(self, step: int) -> dict:
    """The iterators' state before batch ``step`` (the next one, or the one just built),
    JSON-able, with what :meth:`restore` checks."""
    if self._before is not None and self._before[0] == step:
      rows = self._before[1]
    elif step == self._step:
      rows = {r: it.get_state() for r, it in self._iters.items()}
    else:
      raise ValueError(f"no data state for step {step} (the iterators are at {self._step})")
    return {"step": step, "rows": {str(r): s for r, s in rows.items()},
            **self._identity()}

  def _identity(self) -> dict:
    return {"batch_size": self.batch_size, "seq_len": self.seq_len,
            "corpus": self.docs.fingerprint(),
            "tokenizer": hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()[:16]}

  def restore(self, state: dict, rows=None) -> None:
    """Positions this process's ``rows`` at ``state["step"]``; ValueError if ``state`` was
    written for another batch shape, corpus or tokenizer, or lacks one of the rows."""
    ours = self._identity()
    for key, value in ours.items():
      if state.get(key) != value:
        raise ValueError(f"the checkpoint's data state is for {key} {state.get(key)!r}, this "
                         f"run has {value!r}: a resumed text run needs the same data.path, "
                         "data.tokenizer, data.batch_size and data.seq_len")
    rows = list(range(self.batch_size)[rows] if rows is not None else range(self.batch_size))
    self._iters, self._step, self._before = {}, 0, None
    for r in rows:
      if str(r) not in state["rows"]:
        raise ValueError(f"the checkpoint's data state has no row {r} (rows "
                         f"{sorted(state['rows'], key=int)})")
      self._iters[r] = self._iterator(r)
      self._iters[r].set_state(state["rows"][str(r)])
    self._step = int(state["step"])

  def eval_batch(self, i: int, rows=None) -> dict:
    """Held-out batch ``i``: rows ``i * B ...`` of one stream over the held-out documents."""
    if self._eval_rows is None:
      self._eval_rows = []
    if len(self.eval_ids) == 0:
      raise ValueError("no held-out documents for evaluation")
    need = (i + 1) * self.batch_size
    if len(self._eval_rows) < need:
      if not hasattr(self, "_eval_it"):
        self._eval_it = iter(_stream(self.docs, self.eval_ids, self.tokenizer, self.seq_len,
                                     None))
      while len(self._eval_rows) < need:
        self._eval_rows.append(next(self._eval_it))
    packed = self._eval_rows[i * self.batch_size:need]
    if rows is not None:
      packed = packed[rows]
    out = pack_rows(np.stack([p["tokens"] for p in packed]),
                    np.stack([p["tokens_segment_ids"] for p in packed]))
    out["cross"] = np.zeros_like(out["mask"])
    return out
