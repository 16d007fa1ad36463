"""The same model's bf16 gradients with a float32 residual stream (block outputs and the
embedding added in float32, norms' outputs cast to bf16 for the matmuls; monkeypatched,
not a library option) against plain bf16, both against float32 compute, at the states of
a chunked bf16 trajectory."""
import os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
import configs.gla_340m as C
import trainer
from models import gla as G
from zeco_jax.losses import embedding_lookup
from benchmarks.train_gla340m import settings, token_stream, lm_batch
F32, BF = jnp.float32, jnp.bfloat16
def block_call(self, x, mesh=None, segment_ids=None):       # float32 residual stream
  x = x.astype(F32)
  x = x + self.attn(self.attn_norm(x).astype(BF), mesh, segment_ids=segment_ids).astype(F32)
  return x + self.mlp(self.mlp_norm(x).astype(BF)).astype(F32)
def hidden(self, tokens_BxT, mesh=None, segment_ids=None):
  x = embedding_lookup(self.embed[...], tokens_BxT).astype(F32)
  for block in self.blocks():
    x = block(x, mesh, segment_ids)
  return self.norm(x).astype(BF)
layers, T = 2, 2048
def make(dtype, chunk=1024):
  cfg = settings(C.get_config(), T, 10, False)
  cfg.model.num_layers = layers
  cfg.train.loss_chunk_size = chunk
  cfg.train.compute_dtype = dtype
  return cfg, trainer.Experiment(cfg, trainer.make_mesh({"data": 1, "seq": 1}))
cfg, eb = make("bfloat16")
_, e32 = make("float32")
orig = (G.GLABlock.__call__, G.GLALM.hidden)
G.GLABlock.__call__, G.GLALM.hidden = block_call, hidden
_, er = make("bfloat16")          # traced lazily: patch stays for er only if traced now
toks = token_stream(cfg, 10)
batches = [eb.put_batch(lm_batch(toks[s])) for s in range(5)]
state = eb.init_state()
# trace er now with the patch in place
_ = er.loss_and_grad(state["params"], batches[0])
G.GLABlock.__call__, G.GLALM.hidden = orig
def norm(g): return np.sqrt(sum(float(jnp.sum(x.astype(F32) ** 2)) for x in jax.tree.leaves(g)))
def rel(a, b):
  fa = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)])
  fb = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)])
  return np.linalg.norm(fa - fb) / np.linalg.norm(fb)
for s in range(5):
  _, _, gb = eb.loss_and_grad(state["params"], batches[s])
  _, _, g32 = e32.loss_and_grad(state["params"], batches[s])
  _, _, gr = er.loss_and_grad(state["params"], batches[s])
  print(f"step {s}: |g| bf16 {norm(gb):.3f} f32-resid {norm(gr):.3f} f32 {norm(g32):.3f};"
        f" rel err vs f32: bf16 {rel(gb, g32):.3e}, f32-resid {rel(gr, g32):.3e};"
        f" embed: bf16 {rel(gb['embed'], g32['embed']):.3e} f32-resid {rel(gr['embed'], g32['embed']):.3e}", flush=True)
  state, m = eb.train_step(state, batches[s])
