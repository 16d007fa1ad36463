"""Tiny hybrid model on MQAR: a GLA block then a softmax attention block (layer_pattern
"LA"), both over the same sequence mesh.

Run:   python train.py --config configs/hybrid_mqar.py
On:    CPU, 8 simulated devices, mesh data=2 x seq=4: the GLA block's All-Scan and the
       attention block's Ulysses all-to-all over the same 4 sequence shards.
Task:  as configs/tiny_mqar.py (2048-token sequences, 32 segments of 64 tokens, queries
       of the previous segment's pairs; 3 segment boundaries are shard boundaries).
Model: 1 GLA block (hidden 64, 1 head, short convolution) and 1 gated attention block
       (4 query heads, 2 key / value heads of dim 16, rotary embeddings, output gate),
       SwiGLU 128 each; AdamW lr 1e-2, 600 steps of 8 x 2048.
Reach: 0.9 on training batches at step 310 (4.8 min in the loop, compile included), eval
       accuracy 0.9983 at step 400 (0.9977 on the 3,072 cross-shard queries); near chance
       until ~step 230.
Time:  0.8 s per step on the 2-core machine (16-20k tokens/s; the attention's XLA form
       skips the key blocks above the causal diagonal for each query block)
       (benchmarks/results/train_hybrid_mqar_cpu.md, 2026-12-03).
"""
from configs import tiny_mqar


def get_config():
  config = tiny_mqar.get_config()          # the task, the optimizer and the schedule
  config.model.update(
      num_layers=2, layer_pattern="LA", attn_num_heads=4, attn_num_kv_heads=2,
      attn_head_dim=16, attn_seq_method="ulysses")
  return config
