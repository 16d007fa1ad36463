"""Tiny Gated DeltaNet on multi-query associative recall (MQAR), the GDN twin of tiny_mqar.

Run:   python train.py --config configs/gdn_mqar.py
On:    CPU, 8 simulated devices (mesh data=2 x seq=4): zeco_gated_delta_rule's All-Scan
       over 4 sequence shards.
Task:  as configs/tiny_mqar.py (2048-token sequences, 32 segments of 64 tokens, pairs at
       each segment's end, queries in the next; 3 boundaries are seq-shard boundaries).
Model: 1 Gated DeltaNet block (hidden 64, 1 head, key dim 32, value dim 64, short
       convolutions, output gate and norm), SwiGLU 128.
       About 50k parameters; AdamW lr 1e-2, 600 steps of 8 x 2048 (as tiny_mqar).
Reach: eval accuracy 0.9971 after 600 steps (0.9987 on the 3,072 queries whose pair is on
       an earlier seq shard); 0.9816 at step 200; near chance until ~step 120
       (benchmarks/results/train_gdn_mqar_cpu.md).
Time:  4 min 6 s wall for the 600 steps on the 2-core machine shared with a test run
       (jax 0.10.2, Python 3.11, 2026-12-03); unloaded about 1-1.5 s per step.
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      family="gdn", vocab_size=128, hidden_size=64, num_layers=1, num_heads=1,
      expand_k=0.5, expand_v=1.0, intermediate_size=128, chunk_size=64, use_short_conv=True,
      init_std=0.15)
  config.data.update(
      kind="mqar", layout="boundaries", num_segments=32, query_window=56, seq_len=2048,
      batch_size=8, num_keys=32, num_pairs=8, num_queries=32)
  config.train.update(
      steps=600, lr=1e-2, warmup_steps=20, weight_decay=0.01, log_every=10, eval_every=100,
      eval_batches=4, checkpoint_every=100)
  return config
