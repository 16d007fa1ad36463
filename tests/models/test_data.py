"""The synthetic data of models/data.py: cross-document MQAR, whose pairs open each
document, whose scored queries ask its own keys, and whose stale queries ask keys only
the previous document had (unscored; target = that value); its config
(configs/tiny_mqar_docs.py) validates, and refuses documents too short for its pairs."""
import numpy as np
import pytest

import configs
import configs.tiny_mqar_docs
from models.data import mqar_docs_batch


def test_mqar_docs_batch():
  c = configs.tiny_mqar_docs.get_config().data
  P, K = c.num_pairs, c.num_keys
  out = mqar_docs_batch(0, 5, batch_size=2, seq_len=2048, num_keys=K, num_pairs=P,
                        num_queries=c.num_queries, stale_queries=c.stale_queries,
                        doc_len_min=c.doc_len_min, doc_len_max=c.doc_len_max)
  n_stale = 0
  for b in range(2):
    seg, x, y = out["segment_ids"][b], out["inputs"][b], out["targets"][b]
    assert seg[0] == 1 and set(np.diff(seg)) <= {0, 1}        # documents 1, 2, 3, ...
    prev = {}
    for d in range(1, seg.max() + 1):
      pos = np.flatnonzero(seg == d)
      s, L = pos[0], len(pos)
      assert c.doc_len_min <= L <= c.doc_len_max or pos[-1] == 2047
      if L < 2 * P:
        continue
      keys, values = x[s:s + 2 * P:2], x[s + 1:s + 2 * P:2]
      assert len(set(keys)) == P and (keys >= 1).all() and (keys <= K).all()
      pairs = dict(zip(keys.tolist(), values.tolist()))
      for t in pos[2 * P:]:
        if out["mask"][b, t]:
          assert pairs[int(x[t])] == y[t]                       # own key, own value
          assert out["stale"][b, t] == 0
        elif out["stale"][b, t]:
          n_stale += 1
          assert int(x[t]) not in pairs and prev[int(x[t])] == y[t]
        else:
          assert x[t] == 0
      prev = pairs
  assert n_stale > 50 and out["mask"].sum() > 1000
  config = configs.tiny_mqar_docs.get_config()
  assert configs.validate(config, 8) == {"data": 2, "seq": 4}
  config.data.doc_len_min = 40
  with pytest.raises(ValueError, match="cannot hold num_pairs=8"):
    configs.validate(config, 8)
