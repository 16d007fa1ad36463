"""Tiny Gated DeltaNet on multi-query associative recall (MQAR), the GDN twin of tiny_mqar.

Run:   python train.py --config configs/gdn_mqar.py
On:    CPU, 8 simulated devices (mesh data=2 x seq=4): zeco_gated_delta_rule's All-Scan
       over 4 sequence shards.
Task:  as configs/tiny_mqar.py (2048-token sequences, 32 segments of 64 tokens, pairs at
       each segment's end, queries in the next; 3 boundaries are seq-shard boundaries).
Model: 1 Gated DeltaNet block (hidden 64, 1 head, key dim 32, value dim 64, short
       convolutions, output gate and norm), SwiGLU 128.
       About 50k parameters; AdamW lr 1e-2, 600 steps of 8 x 2048 (as tiny_mqar).
Reach: eval accuracy 0.9816 at step 200 (0.9769 on the 3,072 queries whose pair is on an
       earlier seq shard), train-batch accuracy > 0.9 from step 180; near chance until
       ~step 120 (2026-12-01, benchmarks/results/issue14/train_gdn_mqar_cpu.txt).
Time:  not measured on an idle machine. Two runs shared the 2 cores with other jobs
       (load 4-22) and were stopped at step ~210: step 100 at 2 min 42 s wall (load ~5,
       compile included), step 200 at 19.7 / 37.2 min (load 15-22 / 9-10). At the
       low-load rate (~1.5 s/step) step 200 would be at ~5 min. The full 600 steps and
       their final accuracy were not run.
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
