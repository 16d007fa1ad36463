"""Cross-document MQAR: does resetting the state at document starts keep documents apart?

Run:   python train.py --config configs/tiny_mqar_docs.py
       python train.py --config configs/tiny_mqar_docs.py --config.data.document_resets=false \
           --workdir runs/tiny_mqar_docs_noreset       (the same model without segment_ids)
On:    CPU, 8 simulated devices, mesh data=2 x seq=4 (as configs/tiny_mqar.py).
Task:  rows of 2048 tokens packed with documents of 48-96 tokens (segment_ids per token;
       documents cross seq-shard boundaries). Each document opens with 8 key-value pairs
       (keys drawn afresh from 32, values from 32 more), then 24 scored queries of its own
       keys and 4 unscored "stale" queries of keys that were only in the previous document
       (models/data.py mqar_docs_batch). Eval reports the accuracy on the scored queries and
       ``eval_stale_recall``: how often a stale query gets the previous document's value.
       With resets that is chance (about 1/32: the model cannot see the previous document);
       a model without resets recalls across the boundary.
Model: as tiny_mqar: 1 GLA block, hidden 64, 1 head, short convolution, SwiGLU 128;
       AdamW lr 1e-2, 600 steps of 8 x 2048.
Reach: step 600: eval accuracy 1.0000 on 21,847 scored queries (1.0000 on the 1,092 whose
       pair is on an earlier seq shard), stale recall 0.0277 (chance); without resets
       0.8733 and stale recall 0.1528. 8 min 26 s wall on the 2-core machine under load
       (measured 2026-12-01, benchmarks/results/train_mqar_docs_cpu.md).
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      vocab_size=128, hidden_size=64, num_layers=1, num_heads=1, intermediate_size=128,
      chunk_size=64, use_short_conv=True, gate_bias_init=2.0, init_std=0.15)
  config.data.update(
      kind="mqar_docs", document_resets=True, seq_len=2048, batch_size=8, num_keys=32,
      num_pairs=8, num_queries=24, stale_queries=4, doc_len_min=48, doc_len_max=96)
  config.train.update(
      steps=600, lr=1e-2, warmup_steps=20, weight_decay=0.01, log_every=10, eval_every=100,
      eval_batches=4, checkpoint_every=100)
  return config
