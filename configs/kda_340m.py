"""Kimi Delta Attention 340M: 24 layers, hidden 1024, 8 heads of key and value dim 128
(FLA's KDA layer with head_dim 128, expand_v 1: expand_k = expand_v = 1.0 here), short
convolutions, the per-channel gate, sigmoid output gate and norm, SwiGLU with
hidden_ratio 4; the head tied to the embedding, as this repository's other models.

Run:   python train.py --config configs/kda_340m.py --config.data.path=/path/to/corpus \
           [--config.mesh=data=2,seq=4]
On:    GPUs/TPUs; sequence length 16384 split over ``seq`` (zeco_kda's All-Scan), global
       batch 8 over ``data``; bf16 compute, float32 params.
Size:  354.2M parameters (the benchmark's count; FLA would add an untied 32.8M head).
Op:    the KDA Pallas kernels on GPU and TPU (``model.backend="auto"``), the jnp chunked
       path on CPU: one H200 trains 1 x 16384 tokens at 92,338 tokens/s in 26.5 GiB,
       against GLA-340M's 162,280 in 22.2 GiB (2026-12-06, 3e1e428's defaults); one H100
       84,223 against 146,497 the same day (the jnp path: 15,188); with the chunk
       states kept for the backward (the default since 2026-12-07) 88,129 in 28.0 GiB
       against 145,421 on an H100 (benchmarks/results/kda_h200.md).
Reach: not measured (no corpus or long GPU run here).
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      family="kda", vocab_size=32000, hidden_size=1024, num_layers=24, num_heads=8,
      expand_k=1.0, expand_v=1.0, hidden_ratio=4.0, init_std=0.02, chunk_size=64,
      use_short_conv=True, conv_size=4, remat=False)
  config.data.update(kind="text", seq_len=16384, batch_size=8)
  config.train.update(
      steps=20000, lr=3e-4, warmup_steps=1000, weight_decay=0.01, compute_dtype="bfloat16",
      log_every=10, eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
  return config
