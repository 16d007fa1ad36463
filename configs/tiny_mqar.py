"""Tiny GLA on multi-query associative recall (MQAR): the default of ``python train.py``.

Run:   python train.py            (same as: python train.py --config tiny_mqar)
On:    CPU, 8 simulated devices (made by train.py), mesh data=2 x seq=4; or the real
       devices of a GPU/TPU host (mesh "auto").
Time:  TBD
Reach: TBD
"""
CONFIG = {
    "model": {
        "vocab_size": 128,
        "hidden_size": 128,
        "num_layers": 2,
        "num_heads": 2,
        "intermediate_size": 256,
        "chunk_size": 64,
        "gate_bias_init": 4.0,
    },
    "data": {
        "kind": "mqar",
        "seq_len": 2048,
        "batch_size": 8,
        "num_keys": 32,
        "num_pairs": 8,
        "num_queries": 64,
        "query_from": 0.25,
    },
    "train": {
        "steps": 600,
        "lr": 3e-3,
        "warmup_steps": 30,
        "weight_decay": 0.01,
        "log_every": 10,
        "eval_every": 100,
        "eval_batches": 4,
        "checkpoint_every": 100,
    },
    "mesh": "auto",
}
