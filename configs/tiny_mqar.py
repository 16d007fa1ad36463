"""Tiny GLA on multi-query associative recall (MQAR): the default of ``python train.py``.

Run:   python train.py            (same as: python train.py --config tiny_mqar)
On:    CPU, 8 simulated devices (made by train.py), mesh data=2 x seq=4; on a GPU/TPU
       host the real devices (mesh "auto": seq = 4, 2 or 1 dividing the device count).
Task:  sequences of 2048 tokens in 4 segments of 512 (= the 4 seq shards). Before each of
       the 3 inner boundaries sit 4 fresh key-value pairs (16 keys, 16 values, keys distinct
       within a sequence, so 12 pairs live in the state by the end); the first 256
       tokens after the boundary hold 128 queries of those keys whose value must be
       predicted (it is never shown again); everything else is a pad token. Every
       answer is on another seq shard than its pair: only the All-Scan state carries it.
       Chance is 1/16 (1/4 knowing which pairs are recent).
Model: 1 GLA block (hidden 64, 1 head, key dim 32, value dim 64, fla's short convolution
       on q/k/v, SwiGLU 128), 0.05M parameters; AdamW lr 1e-2, 500 steps of 8 x 2048.
Time:  MEASURED_TIME
Reach: MEASURED_ACC
"""
CONFIG = {
    "model": {
        "vocab_size": 64,
        "hidden_size": 64,
        "num_layers": 1,
        "num_heads": 1,
        "intermediate_size": 128,
        "chunk_size": 64,
        "use_short_conv": True,
        "gate_bias_init": 2.0,
        "init_std": 0.15,
    },
    "data": {
        "kind": "mqar",
        "layout": "boundaries",
        "num_segments": 32,
        "query_window": 56,
        "seq_len": 2048,
        "batch_size": 8,
        "num_keys": 16,
        "num_pairs": 4,
        "num_queries": 32,
    },
    "train": {
        "steps": 500,
        "lr": 1e-2,
        "warmup_steps": 20,
        "weight_decay": 0.01,
        "log_every": 10,
        "eval_every": 100,
        "eval_batches": 4,
        "checkpoint_every": 100,
    },
    "mesh": "auto",
}
