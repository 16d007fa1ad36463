"""Gated DeltaNet 340M (flash-linear-attention's ``gated_deltanet_340M.json`` shape): 21
layers, hidden 1024, 6 heads of key dim 256 and value dim 512 (FLA's head_dim 256,
expand_v 2; here expand_k = 1.5, expand_v = 3.0 of the hidden size, models/gdn.py),
short convolutions, output gate, SwiGLU with hidden_ratio 4.

Run:   python train.py --config configs/gdn_340m.py --config.data.path=/path/to/corpus \
           [--config.mesh=data=2,seq=4]
On:    GPUs/TPUs; sequence length 16384 split over ``seq`` (zeco_gated_delta_rule's
       All-Scan), global batch 8 over ``data``; bf16 compute, float32 params.
Size:  479.5M parameters here (counted with nnx.eval_shape). FLA names this shape 340M;
       with its untied output head it would be 512.3M (32.8M more, computed); here the
       head is tied to the embedding, as in this repository's GLA model.
Op:    the Gated DeltaNet Pallas kernels on GPU and TPU (``model.backend="auto"``), at
       this shape's K = 256, V = 512 per head; the jnp chunked path on CPU.
Time:  one H100 trains 1 x 16384 tokens at 64,597 tokens/s in 31.6 GiB on the kernels
       (GLA-340M: 145,993 in 22.2 GiB on the same machine, 2026-12-06); the delta kernels
       and 479.5M parameters' matmuls take most of the step; on the jnp path (an H200)
       22,416 in 95.0 GiB (benchmarks/results/gdn_h200.md).
Reach: not measured (no corpus or long GPU run here).
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      family="gdn", vocab_size=32000, hidden_size=1024, num_layers=21, num_heads=6,
      expand_k=1.5, expand_v=3.0, hidden_ratio=4.0, init_std=0.02, chunk_size=64,
      use_short_conv=True, conv_size=4, remat=False)
  config.data.update(kind="text", seq_len=16384, batch_size=8)
  config.train.update(
      steps=20000, lr=3e-4, warmup_steps=1000, weight_decay=0.01, compute_dtype="bfloat16",
      log_every=10, eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
  return config
