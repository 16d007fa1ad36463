"""The text loader (models/text.py, models/corpus.py): real documents packed into rows.

* documents of .txt / .jsonl files, the BPE tokenizer (deterministic, cached), packing:
  segment ids change exactly after an end-of-document token, the loss mask is 0 exactly
  where a target is in another document (and at a row's last position);
* the loader is deterministic, each batch row reads its own disjoint documents (what one
  process builds is the slice of the full batch), held-out documents never train;
* the iterators' state, through JSON, continues on exactly the next batch, also when the
  rows are split over processes differently than when it was saved;
* what the corpus must be, checked when it is indexed: a bad .jsonl line, empty folders,
  .txt files that are not UTF-8 or not text.
"""
import json
import os

import numpy as np
import pytest

import configs
import configs.text_tiny
from models import corpus, text
from models.data import Dataset, batch_keys

SEQ, ROWS = 128, 4


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
  return corpus.write_corpus(str(tmp_path_factory.mktemp("corpus")), documents=60, seed=1,
                             sentences=(1, 4))


def _cfg(path, **kw):
  return {"kind": "text", "path": path, "tokenizer": "bpe", "document_resets": True,
          "seq_len": SEQ, "batch_size": ROWS, "seed": 3, **kw}


@pytest.fixture(scope="module")
def data(corpus_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("work"))
  return text.TextData(_cfg(corpus_dir), 300, workdir), workdir


def test_documents_and_tokenizer(corpus_dir, data):
  loader, workdir = data
  docs = loader.docs
  txt = sorted(f for f in os.listdir(corpus_dir) if f.endswith(".txt"))
  lines = sum(1 for f in os.listdir(corpus_dir) if f.endswith(".jsonl")
              for line in open(os.path.join(corpus_dir, f)) if line.strip())
  assert len(docs) == len(txt) + lines == 60            # one per .txt file, one per line
  first = json.loads(open(os.path.join(corpus_dir, "part-0.jsonl")).readline())["text"]
  assert docs[0] == first                               # files in sorted order
  assert docs[len(docs) - 1] == open(os.path.join(corpus_dir, txt[-1])).read()
  tok = loader.tokenizer
  assert tok.vocab_size == 300 and tok.eos_id == 0
  ids = tok.encode(first)
  assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
  assert tok.decode(ids) == first
  assert len(ids) < 0.8 * len(first.encode())          # BPE merges, not bytes
  # Deterministic (every process trains the same), and cached for the resumed run.
  again = text.train_bpe((docs[int(i)] for i in loader.train_ids), 300)
  assert again.to_str() == tok.to_str()
  assert open(os.path.join(workdir, text.TOKENIZER_FILE)).read() == tok.to_str()
  byte_tok = text.get_tokenizer("bytes", docs, loader.train_ids, 257, None)
  assert byte_tok.decode(byte_tok.encode("été")) == "été"
  with pytest.raises(ValueError, match="more than model.vocab_size=100"):
    text.get_tokenizer(os.path.join(workdir, text.TOKENIZER_FILE), docs, [], 100, None)
  empty = os.path.join(workdir, "empty")
  os.makedirs(empty, exist_ok=True)
  with pytest.raises(ValueError, match="holds no documents"):
    text.Documents(empty)


def test_pack_rows_mask():
  tokens = np.array([[5, 6, 7, 8, 9, 10]])
  seg = np.array([[1, 1, 2, 2, 2, -1]])          # a padding token at the end
  out = text.pack_rows(tokens, seg)
  np.testing.assert_array_equal(out["targets"], [[6, 7, 8, 9, 10, 0]])
  # 6 -> 7 crosses into document 2; 9 -> pad; the last position has no target.
  np.testing.assert_array_equal(out["mask"], [[1, 0, 1, 1, 0, 0]])
  np.testing.assert_array_equal(out["segment_ids"], seg)


def test_packed_rows_have_documents_and_their_boundaries(data):
  loader, _ = data
  eos = loader.tokenizer.eos_id
  batch = loader.eval_batch(0)
  for key in ("inputs", "targets", "mask", "segment_ids"):
    assert batch[key].shape == (ROWS, SEQ)
  x, seg, mask = batch["inputs"], batch["segment_ids"], batch["mask"]
  np.testing.assert_array_equal(batch["targets"][:, :-1], x[:, 1:])
  change = seg[:, 1:] != seg[:, :-1]
  np.testing.assert_array_equal(change, x[:, :-1] == eos)   # a new id right after each EOS
  np.testing.assert_array_equal(mask[:, :-1], ~change)
  assert not mask[:, -1].any() and (seg >= 1).all() and change.any()
  # A whole document inside a row decodes to a held-out document.
  held_out = {loader.docs[int(i)] for i in loader.eval_ids}
  whole = [x[r, seg[r] == s] for r in range(ROWS) for s in np.unique(seg[r])[1:-1]]
  assert whole and all(loader.tokenizer.decode(ids) in held_out for ids in whole)


def test_loader_is_deterministic_and_rows_read_their_own_documents(corpus_dir, data):
  loader, workdir = data
  other = text.TextData(_cfg(corpus_dir), 300, workdir)
  halves = [text.TextData(_cfg(corpus_dir), 300, workdir) for _ in range(2)]
  fresh = text.TextData(_cfg(corpus_dir), 300, workdir)
  for step in range(3):
    full, a = fresh.batch(step), other.batch(step)
    parts = [halves[0].batch(step, slice(0, 1)), halves[1].batch(step, slice(1, ROWS))]
    for k in a:
      np.testing.assert_array_equal(a[k], full[k])
    for k in a:
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), a[k])
  # Row b reads training documents b, b + B, ...: disjoint, all of them, none held out.
  per_row = [set(loader.train_ids[b::ROWS].tolist()) for b in range(ROWS)]
  assert set().union(*per_row) == set(loader.train_ids.tolist())
  assert sum(map(len, per_row)) == len(loader.train_ids)
  assert not set(loader.train_ids.tolist()) & set(loader.eval_ids.tolist())
  reseeded = text.TextData(_cfg(corpus_dir, seed=4), 300, workdir).batch(0)["inputs"]
  assert not np.array_equal(reseeded, text.TextData(_cfg(corpus_dir), 300, workdir)
                            .batch(0)["inputs"])


def test_state_resumes_on_the_next_batch_with_any_row_split(corpus_dir, data):
  _, workdir = data
  straight = text.TextData(_cfg(corpus_dir), 300, workdir)
  batches = [straight.batch(s) for s in range(6)]
  saver = text.TextData(_cfg(corpus_dir), 300, workdir)
  for s in range(3):
    saver.batch(s)
  assert saver.state(3) == saver.state(saver._step)
  saver.batch(3)                                   # the trainer builds one batch ahead
  state = json.loads(json.dumps(saver.state(3)))   # as the checkpoint's JSON item
  # Saved by 2 processes of 2 rows each, merged (checkpointing.gather_data_state), then
  # restored by processes of 1 and 3 rows.
  procs = [text.TextData(_cfg(corpus_dir), 300, workdir) for _ in range(2)]
  for s in range(4):
    procs[0].batch(s, slice(0, 2))
    procs[1].batch(s, slice(2, 4))
  merged = {**procs[0].state(3), "rows": {**procs[0].state(3)["rows"],
                                          **procs[1].state(3)["rows"]}}
  assert json.loads(json.dumps(merged)) == state
  resumed = [text.TextData(_cfg(corpus_dir), 300, workdir) for _ in range(2)]
  resumed[0].restore(state, slice(0, 1))
  resumed[1].restore(state, slice(1, 4))
  for s in range(3, 6):
    got = [resumed[0].batch(s, slice(0, 1)), resumed[1].batch(s, slice(1, 4))]
    for k in batches[s]:
      np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), batches[s][k])
  with pytest.raises(ValueError, match="come in order"):
    resumed[0].batch(2, slice(0, 1))
  with pytest.raises(ValueError, match="batch_size 4, this run has 2"):
    text.TextData(_cfg(corpus_dir, batch_size=2), 300, workdir).restore(state)


def test_text_config_and_dataset_keys(corpus_dir):
  config = configs.text_tiny.get_config()
  config.data.path = corpus_dir
  assert configs.validate(config, 8) == {"data": 2, "seq": 4}
  assert batch_keys(config.data) == ("inputs", "targets", "mask", "segment_ids")
  config.data.document_resets = False
  assert batch_keys(config.data) == ("inputs", "targets", "mask")
  config.data.path = corpus_dir + "/missing"
  with pytest.raises(ValueError, match="data.kind='text' needs data.path"):
    configs.validate(config, 8)
  ds = Dataset({**_cfg(corpus_dir, batch_size=2), "kind": "text"}, vocab_size=300)
  assert ds.stateful and set(ds.batch(0)) == {"inputs", "targets", "mask", "segment_ids"}


# --- what the corpus must be, checked when it is indexed ----------------------------------

def _write(folder, name, content):
  path = os.path.join(folder, name)
  with open(path, "wb" if isinstance(content, bytes) else "w") as f:
    f.write(content)
  return path


@pytest.mark.parametrize("line,why", [
    ("{not json", "JSONDecodeError"),
    ('{"body": "no text here"}', 'no "text" field'),
    ('{"text": 42}', '"text" is a int, not a string'),
    ('["text"]', "TypeError"),
])
def test_a_bad_jsonl_line_is_found_when_indexing(tmp_path, line, why):
  # The bad line is document 40 (held out, read only by the final evaluation) and past
  # what a cached tokenizer would read: the index finds it before anything trains.
  good = [json.dumps({"text": f"document {i}"}) for i in range(60)]
  _write(tmp_path, "a.jsonl", "\n".join(good[:40] + [line] + good[40:]) + "\n")
  with pytest.raises(ValueError, match=rf"a\.jsonl line 41: not a JSON object with a string "
                     rf"\"text\" field \(.*{why}"):
    text.Documents(str(tmp_path))


def test_empty_folders_say_what_they_hold(tmp_path):
  with pytest.raises(ValueError, match=r"holds no documents \(no \.txt or \.jsonl file\)"):
    text.Documents(str(tmp_path))
  _write(tmp_path, "notes.md", "not a document")
  _write(tmp_path, "empty.txt", "")
  with pytest.raises(ValueError, match=r"holds no documents \(1 file\(s\), none with a "):
    text.Documents(str(tmp_path))


def test_text_files_not_utf8_are_noted_and_binary_ones_skipped(tmp_path):
  _write(tmp_path, "good.txt", "plain text\n")
  _write(tmp_path, "latin1.txt", ("caf\xe9 na\xefve " * 10).encode("latin-1"))
  _write(tmp_path, "blob.txt", bytes(np.random.default_rng(0).integers(0, 256, 4000,
                                                                       dtype=np.uint8)))
  docs = text.Documents(str(tmp_path))
  assert [os.path.basename(f) for f in docs.files] == ["good.txt", "latin1.txt"]
  assert len(docs) == 2 and docs[1].count("\ufffd") == 20
  assert len(docs.warnings) == 2
  assert "blob.txt: skipped, not text" in docs.warnings[0]
  assert docs.warnings[1].endswith("latin1.txt: 20 byte sequence(s) not UTF-8, read as U+FFFD")
