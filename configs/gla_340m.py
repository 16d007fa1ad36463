"""GLA-340M (flash-linear-attention's ``gla_340M.json``): 24 layers, hidden 1024, 4 heads.

Run:   python train.py --config configs/gla_340m.py --config.data.path=/path/to/corpus \
           [--config.mesh=data=2,seq=4]
       (a folder of .txt / .jsonl documents, or --text DIR: a 32000-token BPE trained on
       it, documents packed with segment_ids; models/text.py. Synthetic tokens instead:
       --config.data.kind=mqar.)
On:    GPUs/TPUs. Sequence length 16384 split over the ``seq`` axis (ZeCO All-Scan);
       the global batch of 8 sequences over ``data``. bf16 compute, float32 params.
Time:  one H200, batch 1 x 16384 tokens, bf16, chunked cross-entropy
       (train.loss_chunk_size=4096): 164k tokens/s, 100 ms/step, 22.2 GiB peak
       (benchmarks/results/train_gla340m_h200.md; dense logits, loss_chunk_size=0: 138k
       tokens/s, 25.6 GiB, at an earlier commit). 20k steps of 8 x 16384 tokens = 2.6B
       tokens: about 0.7 h on 8 H200s if it scaled perfectly (not measured).
Reach: not measured here (no corpus or long GPU run in this repo's CI). For reference,
       fla's GLA-340M reaches about 28 wikitext perplexity after 15B SlimPajama tokens
       with a 32k BPE tokenizer (another corpus and tokenizer: not comparable).
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      vocab_size=32000, hidden_size=1024, num_layers=24, num_heads=4, expand_k=0.5,
      expand_v=1.0, hidden_ratio=4.0, gate_low_rank_dim=16, init_std=0.006, chunk_size=64,
      remat=False)
  config.data.update(kind="text", seq_len=16384, batch_size=8)
  config.train.update(
      steps=20000, lr=3e-4, warmup_steps=1000, weight_decay=0.01, compute_dtype="bfloat16",
      loss_chunk_size=4096,
      log_every=10, eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
  return config
