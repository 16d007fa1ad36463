"""Tiny GLA on multi-query associative recall (MQAR): the default of ``python train.py``.

Run:   python train.py           (same as: python train.py --config configs/tiny_mqar.py)
On:    CPU, 8 simulated devices (train.py's default --local-device-count on a CPU-only
       host), mesh data=2 x seq=4; on a GPU/TPU host the real devices (mesh "auto":
       seq = 4, 2 or 1 dividing the device count).
Task:  MQAR, sequences of 2048 tokens (512 per seq shard) in 32 segments of 64 tokens.
       Each segment ends with 8 fresh key-value pairs (32 keys, 32 values; keys new
       relative to the previous episode); the first 56 tokens of the next segment hold
       32 queries of those keys (the value is never shown again; predict it); the rest
       is a pad token. 3 of the 31 boundaries are seq-shard boundaries: for the queries
       behind them only the All-Scan state carries the answer, and eval reports their
       accuracy separately. Chance 1/32 (1/8 knowing which pairs are recent).
Model: 1 GLA block (hidden 64, 1 head, key dim 32, value dim 64, fla's short convolution
       on q/k/v, SwiGLU 128), 51,488 parameters; AdamW lr 1e-2, 600 steps of 8 x 2048.
Time:  2 min 57 s wall (173 s in the loop, ~60k tokens/s) on a 2-core CPU, jax 0.11.2;
       plateau near chance until ~step 200.
Reach: eval accuracy 0.9996 on 31,744 held-out queries; 1.0000 on the 3,072 whose pair
       is on an earlier seq shard (>= 0.9 by step 300; measured 2026-11-30,
       benchmarks/results/train_tiny_mqar_cpu.md). Re-run 2026-12-01 after the exact-decay
       jnp path: 0.9990, cross-shard 0.9993, 3 min 2 s wall.
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      vocab_size=128, hidden_size=64, num_layers=1, num_heads=1, intermediate_size=128,
      chunk_size=64, use_short_conv=True, gate_bias_init=2.0, init_std=0.15)
  config.data.update(
      kind="mqar", layout="boundaries", num_segments=32, query_window=56, seq_len=2048,
      batch_size=8, num_keys=32, num_pairs=8, num_queries=32)
  config.train.update(
      steps=600, lr=1e-2, warmup_steps=20, weight_decay=0.01, log_every=10, eval_every=100,
      eval_batches=4, checkpoint_every=100)
  return config
