"""Tiny GLA language model on a folder of text: ``python train.py --text DIR``.

Run:   python train.py --text DIR      (this config is the default with --text; or
       python train.py --config configs/text_tiny.py --config.data.path=DIR)
       DIR: .txt files (one document each) or .jsonl files (one {"text": ...} per line);
       no corpus at hand: python -m models.corpus /tmp/corpus makes a generated one.
On:    CPU, 8 simulated devices (data=2 x seq=4); GPU/TPU hosts use their real devices.
Data:  a byte-level BPE of 512 tokens trained on the corpus (kept in WORKDIR/tokenizer.json),
       documents packed into rows of 512 tokens with segment_ids: every layer's state and
       short convolution restart at each document, and no prediction across a document
       boundary is scored (models/text.py). Every 20th document is held out for eval.
Model: 2 GLA blocks, hidden 64, 2 heads, short convolution, SwiGLU 128; AdamW lr 3e-3,
       300 steps of 8 x 512 tokens.
Time:  3 min 28 s wall on the 2-core machine under load (193 s in the loop, 43 s compile),
       on python -m models.corpus's 2000 generated documents (2026-12-01).
Reach: there, eval loss 0.643 nats/token, next-token accuracy 0.763 on held-out documents
       after 300 steps (benchmarks/results/train_text_cpu.md): a smoke run on
       templated text, not a language-modelling result.
"""
import configs


def get_config():
  config = configs.defaults()
  config.model.update(
      vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
      chunk_size=64, use_short_conv=True, gate_bias_init=2.0)
  config.data.update(kind="text", tokenizer="bpe", seq_len=512, batch_size=8)
  config.train.update(
      steps=300, lr=3e-3, warmup_steps=20, weight_decay=0.01, log_every=10, eval_every=100,
      eval_batches=2, checkpoint_every=100)
  return config
