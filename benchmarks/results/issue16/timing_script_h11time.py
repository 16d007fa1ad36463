import sys, os, time, json
d = sys.argv[1]; tag = sys.argv[2]
sys.path.insert(0, os.path.abspath(d))
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
import pallas_kernels
from pallas_kernels import state, intra, grads
from zeco_jax import chunk_gla
assert pallas_kernels.__file__.startswith(os.path.abspath(d)), pallas_kernels.__file__

def tl(fn, iters=20, reps=5):
  if os.environ.get('H11_CPU'): iters, reps = 1, 1
  jax.block_until_ready(fn())
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters): r = fn()
    jax.block_until_ready(r); ts.append((time.perf_counter() - t0) / iters * 1e3)
  return float(np.median(ts))

SH = [(1, 128, 1, 32, 32)] if os.environ.get('H11_CPU') else [(1, 16384, 16, 128, 128), (8, 4096, 4, 128, 256)]
for (B, T, H, K, V) in SH:
  dt = jnp.bfloat16
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  q = jax.random.normal(ks[0], (B, T, H, K), dt); k = jax.random.normal(ks[1], (B, T, H, K), dt)
  v = jax.random.normal(ks[2], (B, T, H, V), dt); do = jax.random.normal(ks[4], (B, T, H, V), dt)
  g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H, K), jnp.float32)) / 16
  cfg = pallas_kernels.default_config("gpu", B, T, H, K, V, dt, sm_count=132)
  if os.environ.get('H11_CPU'):
    import dataclasses; cfg = dataclasses.replace(cfg, interpret=True)
  kw = dict(chunk_size=64, config=cfg)
  res = {}
  f = jax.jit(lambda q, k, v, g: chunk_gla(q, k, v, g, chunk_size=64, backend="pallas", kernel_config=cfg))
  fb = jax.jit(lambda q, k, v, g, do: jax.vjp(lambda *a: chunk_gla(*a, chunk_size=64, backend="pallas", kernel_config=cfg)[0], q, k, v, g)[1](do))
  res["fwd"] = tl(lambda: f(q, k, v, g)); res["fwdbwd"] = tl(lambda: fb(q, k, v, g, do))
  p, s = jax.jit(lambda g: state.chunk_cumsum(g, **kw))(g)
  dA = jax.jit(lambda do, v: intra.score_grad(do, v, scale=0.1, **kw))(do, v)
  c = jax.jit(lambda g: state.chunk_cumsum(g, **kw)); res["cumsum"] = tl(lambda: c(g))
  sc = jax.jit(lambda q, k, g, p, s: intra.scores(q, k, g, p, s, **kw)); res["scores"] = tl(lambda: sc(q, k, g, p, s))
  dd = jax.jit(lambda q, k, g, dA: grads.diag_grads(q, k, g, dA, **kw)); res["dqdk_diag"] = tl(lambda: dd(q, k, g, dA))
  print(tag, (B, T, H, K, V), json.dumps({a: round(b, 4) for a, b in res.items()}), flush=True)
