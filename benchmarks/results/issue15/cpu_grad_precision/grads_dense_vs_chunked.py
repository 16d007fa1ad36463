"""Gradients of a 2-layer GLA-340M-width model (T 2048, the benchmark's settings) in bf16
compute with dense and with chunked cross-entropy, each against float32 compute, per
parameter, at the states of a dense bf16 trajectory. CPU, jnp path. Run from anywhere."""
import os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
import configs.gla_340m as C
import trainer
from benchmarks.train_gla340m import settings, token_stream, lm_batch
layers, T, steps = 2, 2048, 5
def make(chunk, dtype="bfloat16"):
  cfg = settings(C.get_config(), T, 10, False)
  cfg.model.num_layers = layers
  cfg.train.loss_chunk_size = chunk
  cfg.train.compute_dtype = dtype
  return cfg, trainer.Experiment(cfg, trainer.make_mesh({"data": 1, "seq": 1}))
cfg, ed = make(0)
_, ec = make(1024)
_, e32 = make(0, "float32")
toks = token_stream(cfg, 10)
state = ed.init_state()
def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
for s in range(steps):
  batch = ed.put_batch(lm_batch(toks[s]))
  _, _, gd = ed.loss_and_grad(state["params"], batch)
  _, _, gc = ec.loss_and_grad(state["params"], batch)
  _, _, g32 = e32.loss_and_grad(state["params"], batch)
  fd, fc, f32 = (jax.tree_util.tree_flatten_with_path(g)[0] for g in (gd, gc, g32))
  print(f"step {s}: |g| dense {np.sqrt(sum(float(jnp.sum(x.astype(jnp.float32)**2)) for _, x in fd)):.3f}"
        f" chunked {np.sqrt(sum(float(jnp.sum(x.astype(jnp.float32)**2)) for _, x in fc)):.3f}"
        f" f32 {np.sqrt(sum(float(jnp.sum(x.astype(jnp.float32)**2)) for _, x in f32)):.3f}", flush=True)
  for (p, a), (_, b), (_, c) in zip(fd, fc, f32):
    name = jax.tree_util.keystr(p)
    n = float(np.linalg.norm(np.asarray(c, np.float64)))
    print(f"   {name:60s} |g32| {n:9.4f}  dense {rel(a, c):.2e}  chunked {rel(b, c):.2e}", flush=True)
  state, m = ed.train_step(state, batch)
