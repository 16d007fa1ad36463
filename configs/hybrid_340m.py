"""A GLA-340M-sized hybrid: GLA-340M's 24 blocks with every fourth one softmax attention
(layer_pattern "LLLA", Qwen3-Next's 3 : 1), all over the same sequence mesh.

Run:   python train.py --config configs/hybrid_340m.py --config.data.path=/path/to/corpus \
           [--config.mesh=data=1,seq=8]
On:    GPUs/TPUs. As configs/gla_340m.py (16384-token sequences over ``seq``, bf16
       compute), the 6 attention blocks by Ulysses: 8 query heads and 2 key / value heads
       of 128 (the key heads are repeated up to the seq axis's size when it is larger),
       rotary embeddings, an output gate.
Size:  338.4M parameters (nnx.eval_shape; GLA-340M here: 341.7M).
TPU:   python train.py --config configs/hybrid_340m.py --compile_only=v5p:2x2x2
       --config.mesh=data=1,seq=8 compiles the whole step (the Mosaic GLA kernels and the
       splash attention kernels, 234 Mosaic calls) in 285 s on the 2-core host: 21.17 GiB
       per chip of 95 (temporaries 16.28), all-to-all 1.31 GiB and all-reduce 1.21 GiB per
       chip per step, 361 of 364 collective-permutes with compute beside them (2026-12-03;
       the attention's XLA form needed 34.13 GiB).
H200:  142,375 tokens/s at 1 x 16384 (0.86x GLA-340M's 164,815 in the same call), peak
       21.44 GiB (GLA-340M: 22.22); the 6 attention blocks run cuDNN flash attention, 19.9
       of the 115 ms step (benchmarks/results/hybrid_h200.md, 2026-12-03).
"""
from configs import gla_340m


def get_config():
  config = gla_340m.get_config()
  config.model.update(
      layer_pattern="LLLA", attn_num_heads=8, attn_num_kv_heads=2, attn_head_dim=128,
      attn_seq_method="ulysses", rope_theta=10000.0)
  return config
