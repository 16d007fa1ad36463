"""Tiny Kimi Delta Attention on multi-query associative recall (MQAR), the KDA twin of
gdn_mqar.

Run:   python train.py --config configs/kda_mqar.py
On:    CPU, 8 simulated devices (mesh data=2 x seq=4): zeco_kda's All-Scan over 4 sequence
       shards (its K x K transitions, one K x V state per rank each way).
Task:  as configs/tiny_mqar.py (2048-token sequences, 32 segments of 64 tokens, pairs at
       each segment's end, queries in the next; 3 boundaries are seq-shard boundaries).
Model: 1 KDA block (hidden 64, 1 head, key dim 32, value dim 64, short convolutions, the
       per-channel gate, sigmoid output gate and norm), SwiGLU 128.
       About 60k parameters; AdamW lr 1e-2, 600 steps of 8 x 2048 (as gdn_mqar).
Reach: 0.9 on training batches at step 210; eval accuracy 0.9838 at step 300 (0.9889 on the
       3,072 cross-shard queries), 0.9959 after 600 steps
       (benchmarks/results/train_kda_mqar_cpu.md).
Time:  7 min 39 s to 0.9 and 21 min 25 s for the 600 steps, wall, on the 2-core machine
       (jax 0.10.2, Python 3.11, 2026-12-04); about 2.1 s per step.
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      family="kda", vocab_size=128, hidden_size=64, num_layers=1, num_heads=1,
      expand_k=0.5, expand_v=1.0, intermediate_size=128, chunk_size=64, use_short_conv=True,
      init_std=0.15)
  config.data.update(
      kind="mqar", layout="boundaries", num_segments=32, query_window=56, seq_len=2048,
      batch_size=8, num_keys=32, num_pairs=8, num_queries=32)
  config.train.update(
      steps=600, lr=1e-2, warmup_steps=20, weight_decay=0.01, log_every=10, eval_every=100,
      eval_batches=4, checkpoint_every=100)
  return config
