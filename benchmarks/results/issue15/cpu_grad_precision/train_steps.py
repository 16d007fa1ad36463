"""10 training steps of the 2-layer model: python train_steps.py CHUNK LAYERS T STEPS
(CHUNK 0: dense logits); prints step, (loss, grad norm)."""
import os, sys, time, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
import configs.gla_340m as C
import trainer
from benchmarks.train_gla340m import settings, token_stream, lm_batch
chunk = int(sys.argv[1]); layers = int(sys.argv[2]); T = int(sys.argv[3]); steps = int(sys.argv[4])
cfg = C.get_config()
cfg = settings(cfg, T, steps, False)
cfg.model.num_layers = layers
cfg.train.loss_chunk_size = chunk
toks = token_stream(cfg, steps)
exp = trainer.Experiment(cfg, trainer.make_mesh({"data": 1, "seq": 1}))
state = exp.init_state()
out = []
for s in range(steps):
  state, m = exp.train_step(state, exp.put_batch(lm_batch(toks[s])))
  out.append((float(m["loss"]), float(m.get("grad_norm", np.nan))))
  print(s, out[-1], flush=True)
