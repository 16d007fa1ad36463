"""A GLA-340M-sized hybrid: GLA-340M's 24 blocks with every fourth one softmax attention
(layer_pattern "LLLA", Qwen3-Next's 3 : 1), all over the same sequence mesh.

Run:   python train.py --config configs/hybrid_340m.py --config.data.path=/path/to/corpus \
           [--config.mesh=data=1,seq=8]
On:    GPUs/TPUs. As configs/gla_340m.py (16384-token sequences over ``seq``, bf16
       compute), the 6 attention blocks by Ulysses: 8 query heads and 2 key / value heads
       of 128 (the key heads are repeated up to the seq axis's size when it is larger),
       rotary embeddings, an output gate.
Size:  338.4M parameters (nnx.eval_shape; GLA-340M here: 341.7M).
Time / reach: not measured (no device time in the session that added it; the attention
       runs the XLA form on every platform: no cuDNN / splash kernels yet).
"""
from configs import gla_340m


def get_config():
  config = gla_340m.get_config()
  config.model.update(
      layer_pattern="LLLA", attn_num_heads=8, attn_num_kv_heads=2, attn_head_dim=128,
      attn_seq_method="ulysses", rope_theta=10000.0)
  return config
