"""The token stream and per-step learning rates of ``train24.py MODE 256 2048 8`` as the
``batches.npz`` that ``fla_cpu.py`` reads: python make_batches.py OUT.npz"""
import os, sys, numpy as np, optax
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
import configs.gla_340m as C
from benchmarks.train_gla340m import settings, token_stream
cfg = settings(C.get_config(), 2048, 8, False)
cfg.model.hidden_size = 256
t = cfg.train
schedule = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, t.steps,
                                              end_value=t.lr * t.min_lr_ratio)
np.savez(sys.argv[1], inputs=token_stream(cfg, 8),
         lrs=np.array([float(schedule(s)) for s in range(8)], np.float32))
