"""Gated DeltaNet 340M: GLA-340M's shape (configs/gla_340m.py) with the Gated DeltaNet token
mixer: 24 layers, hidden 1024, 4 heads of key dim 128 and value dim 256 (expand_k = 0.5,
expand_v = 1.0 of the hidden size, models/gdn.py), short convolutions, output gate, SwiGLU
with hidden_ratio 4; the head tied to the embedding, as this repository's other models.

Run:   python train.py --config configs/gdn_340m.py --config.data.path=/path/to/corpus \
           [--config.mesh=data=2,seq=4]
On:    GPUs/TPUs; sequence length 16384 split over ``seq`` (zeco_gated_delta_rule's
       All-Scan), global batch 8 over ``data``; bf16 compute, float32 params, chunked
       cross-entropy (train.loss_chunk_size=4096).
Size:  341.5M parameters (nnx.eval_shape; GLA-340M: 341.7M). FLA's
       ``gated_deltanet_340M.json`` is another shape, 21 layers of 6 heads with K = 256,
       V = 512: 479.5M parameters with a tied head (``--config.model.num_layers=21
       --config.model.num_heads=6 --config.model.expand_k=1.5 --config.model.expand_v=3.0``).
Op:    the Gated DeltaNet Pallas kernels on GPU and TPU (``model.backend="auto"``), the
       jnp chunked path on CPU.
Time:  one H100 trains 1 x 16384 tokens at 127,102 tokens/s in 22.21 GiB, GLA-340M
       148,027 in 22.21 in the same call (0.859x; 0.841x-0.874x over the figures of three
       sessions, 2026-12-07; before
       the chunk states were kept for the backward: 120,168-121,328 in 20.71 GiB).
       FLA's shape: 65,015 tokens/s in 31.58 GiB with the states walked again
       (benchmarks/results/gdn_h200.md).
Reach: not measured (no corpus or long GPU run here).
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      family="gdn", vocab_size=32000, hidden_size=1024, num_layers=24, num_heads=4,
      expand_k=0.5, expand_v=1.0, hidden_ratio=4.0, init_std=0.02, chunk_size=64,
      use_short_conv=True, conv_size=4, remat=False)
  config.data.update(kind="text", seq_len=16384, batch_size=8)
  config.train.update(
      steps=20000, lr=3e-4, warmup_steps=1000, weight_decay=0.01, compute_dtype="bfloat16",
      loss_chunk_size=4096,
      log_every=10, eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
  return config
