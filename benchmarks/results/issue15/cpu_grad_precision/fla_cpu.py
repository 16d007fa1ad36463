"""FLA 0.6.0's GLA model (its layer and block code) in float32 on a CPU, its Triton ops
replaced by torch references, GLA-340M's depth and init at a narrower width, trained on the
token stream and lr schedule of train24.py: python fla_cpu.py BATCHES.npz HIDDEN."""
import math, sys, numpy as np, torch, torch.nn as nn, torch.nn.functional as F
import fla.layers.gla as L
import fla.modules.mlp as M
from fla.models import GLAConfig, GLAForCausalLM


def chunk_gla_torch(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                    **_):
  """o[t] = scale q_t S_t, S_t = diag(e^{g_t}) S_{t-1} + k_t v_t^T; [B, T, H, D], chunks of 64."""
  B, T, H, K = q.shape
  V, C = v.shape[-1], 64
  scale = K ** -0.5 if scale is None else scale
  q, k, v, g = (x.float() for x in (q, k, v, g))
  S = q.new_zeros(B, H, K, V)
  out = []
  mask = torch.tril(torch.ones(C, C, dtype=torch.bool))
  for t0 in range(0, T, C):
    qc, kc, vc, gc = (x[:, t0:t0 + C].transpose(1, 2) for x in (q, k, v, g))  # [B,H,C,D]
    b = gc.cumsum(2)
    o = (qc * b.exp()) @ S
    e = b[:, :, :, None, :] - b[:, :, None, :, :]               # [B,H,C,C,K]: b_t - b_s
    e = torch.where(mask[None, None, :, :, None], e, torch.full_like(e, -1e30))
    A = (qc[:, :, :, None, :] * kc[:, :, None, :, :] * e.exp()).sum(-1)
    out.append(scale * (o + A @ vc))
    bl = b[:, :, -1:, :]
    S = bl.transpose(2, 3).exp() * S + (kc * (bl - b).exp()).transpose(2, 3) @ vc
  return torch.cat(out, 2).transpose(1, 2), (S if output_final_state else None)


class TorchRMSNorm(nn.Module):
  def __init__(self, dim, eps):
    super().__init__()
    self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

  def forward(self, x):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


L.chunk_gla = chunk_gla_torch
M.swiglu = lambda a, b: F.silu(a) * b
data = np.load(sys.argv[1])
hidden = int(sys.argv[2])
inputs, lrs = data["inputs"], data["lrs"]
std = 0.006
config = GLAConfig(hidden_size=hidden, num_hidden_layers=24, num_heads=4, expand_k=0.5,
                   expand_v=1.0, hidden_ratio=4, vocab_size=32000, attn_mode="chunk",
                   use_gk=True, use_gv=False, tie_word_embeddings=True,
                   fuse_cross_entropy=False, fuse_norm=False, fuse_swiglu=False,
                   use_cache=False, initializer_range=std)
torch.manual_seed(0)
model = GLAForCausalLM(config).float()
for layer in model.model.layers:
  layer.attn.g_norm = TorchRMSNorm(layer.attn.head_v_dim, config.norm_eps)
  layer.attn.gate_fn = F.silu
with torch.no_grad():
  for name, p in model.named_parameters():
    if name.endswith(("o_proj.weight", "down_proj.weight")):
      p.normal_(0.0, std / math.sqrt(2 * config.num_hidden_layers))
print(sum(p.numel() for p in model.parameters()), flush=True)
decay = [p for p in model.parameters() if p.ndim >= 2]
no_decay = [p for p in model.parameters() if p.ndim < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                         {"params": no_decay, "weight_decay": 0.0}],
                        lr=float(lrs[0]), betas=(0.9, 0.95), eps=1e-8)
for s in range(len(lrs)):
  for group in opt.param_groups:
    group["lr"] = float(lrs[s])
  ids = torch.from_numpy(inputs[s].astype(np.int64))
  loss = model(input_ids=ids, labels=ids).loss
  loss.backward()
  gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
  opt.step()
  opt.zero_grad(set_to_none=True)
  print(s, round(loss.item(), 4), round(gn.item(), 3), flush=True)
