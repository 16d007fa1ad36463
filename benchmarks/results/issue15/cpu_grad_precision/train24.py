"""Steps of a 24-layer GLA model of GLA-340M's depth, init and settings at a narrower width
on CPU: python train24.py MODE HIDDEN T STEPS -> per-step (loss, grad norm).
MODE: float32, bfloat16, or bf16_f32res (bf16 compute, float32 residual stream: the
embedding and block outputs added in float32, as FLA's model under torch.autocast)."""
import os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
import configs.gla_340m as C
import trainer
from models import gla as G
from zeco_jax.losses import embedding_lookup
from benchmarks.train_gla340m import settings, token_stream, lm_batch
F32, BF = jnp.float32, jnp.bfloat16
mode, hidden, T, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if mode == "bf16_f32res":
  def block_call(self, x, mesh=None, segment_ids=None):
    x = x.astype(F32)
    x = x + self.attn(self.attn_norm(x).astype(BF), mesh, segment_ids=segment_ids).astype(F32)
    return x + self.mlp(self.mlp_norm(x).astype(BF)).astype(F32)
  def hid(self, tokens_BxT, mesh=None, segment_ids=None):
    x = embedding_lookup(self.embed[...], tokens_BxT).astype(F32)
    for block in self.blocks():
      x = block(x, mesh, segment_ids)
    return self.norm(x).astype(BF)
  G.GLABlock.__call__, G.GLALM.hidden = block_call, hid
cfg = settings(C.get_config(), T, steps, False)
cfg.model.hidden_size = hidden
cfg.train.compute_dtype = "float32" if mode == "float32" else "bfloat16"
cfg.train.loss_chunk_size = min(T, 1024)
toks = token_stream(cfg, steps)
exp = trainer.Experiment(cfg, trainer.make_mesh({"data": 1, "seq": 1}))
state = exp.init_state()
for s in range(steps):
  state, m = exp.train_step(state, exp.put_batch(lm_batch(toks[s])))
  print(s, round(float(m["loss"]), 4), round(float(m.get("grad_norm", np.nan)), 3), flush=True)
