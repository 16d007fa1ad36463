"""GLA-7B (flash-linear-attention's ``gla_7B.json``): 32 layers, hidden 4096, 16 heads.

Shape from fla-org/flame ``configs/gla_7B.json`` (read in the fork zaydzuhri/flame at
829cab8): hidden_size 4096, num_hidden_layers 32, num_heads 16, expand_k 0.5, expand_v 1
(key dim 128, value dim 256 per head), intermediate_size 11008, hidden_act swish,
initializer_range 0.006, norm_eps 1e-6, no short convolution, output gate; vocabulary
32000 (fla's Llama tokenizer). One difference: fla's 7B does not tie the output head to the
embedding (``tie_word_embeddings: false``); this model always ties them, so it has 131M
(4096 x 32000) fewer parameters: 6.6B here.

Run:   python train.py --config configs/gla_7b.py --config.data.path=/path/to/corpus \
           --config.mesh=data=8,seq=8
On:    TPU/GPU slices only. Float32 parameters, gradients and AdamW moments take 16 bytes
       per parameter (106 GB), more than one v5p chip's 95 GiB of HBM, so the parameters
       are sharded FSDP-style (``train.sharding_rules.embed=data``; with a data axis of 1,
       ``--config.train.sharding_rules.embed=seq`` shards them over the sequence axis).
       Per-block rematerialisation, bf16 compute, the loss in 4096-token chunks. Compile it
       for a TPU topology without a TPU: python train.py --config configs/gla_7b.py \
       --compile_only=v5p:4x4x4 --config.mesh=data=1,seq=64 \
       --config.train.sharding_rules.embed=seq
       (benchmarks/results/scale_aot.md).
Time:  not measured (never run).
Reach: not measured here.
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=16, expand_k=0.5,
      expand_v=1.0, hidden_ratio=4.0, intermediate_size=11008, gate_low_rank_dim=16,
      init_std=0.006, norm_eps=1e-6, chunk_size=64, use_short_conv=False, remat=True)
  config.data.update(kind="text", seq_len=32768, batch_size=8)
  config.train.update(
      steps=50000, lr=3e-4, warmup_steps=1000, weight_decay=0.01, compute_dtype="bfloat16",
      loss_chunk_size=4096,   # no [T, 32000] float32 logits: 2 GiB per 16K tokens per chip
      log_every=10, eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
  config.train.sharding_rules.embed = "data"
  return config
