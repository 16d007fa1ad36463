"""The All-Scan's overlap in the TPU schedule (issue 12), compiled by libtpu without a TPU.

zeco_gla forward and forward + backward (value_and_grad) over seq = 8 chips of a v5p topology,
B1 x 16384 tokens per chip, H16 K=V=128, bf16, backend from $BK (default auto: Mosaic
kernels), method $M (default all_scan), overlap_pieces $OP (default: None, the TPU default).
Prints, per collective-permute start/done pair in schedule order, (compute ops, custom calls)
between them (zeco_jax.hlo_stats.async_overlap).

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/tpu_schedule.py [topology]
  OP=1 python benchmarks/tpu_schedule.py      # the unsplit local pass, for comparison
"""
import os, sys, time
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import topologies
sys.path.insert(0, ".")
import zeco_jax
from zeco_jax import hlo_stats
topo = topologies.get_topology_desc(platform="tpu", topology_name=sys.argv[1] if len(sys.argv)>1 else "v5p:2x2x2")
mesh = Mesh(np.array(topo.devices).reshape(1, 8), ("data", "seq"))
B, L, H, K, V = 1, 16384, 16, 128, 128
T = 8 * L
s = NamedSharding(mesh, P("data", "seq"))
sd = lambda d, dt: jax.ShapeDtypeStruct((B, T, H, d), dt, sharding=s)
backend = os.environ.get("BK", "auto")
method = os.environ.get("M", "all_scan")
def fwd(q, k, v, g):
  return zeco_jax.zeco_gla(q, k, v, g, mesh=mesh, backend=backend, method=method, batch_axes="data", overlap_pieces=(int(os.environ["OP"]) if os.environ.get("OP") else None))[0]
def fb(q, k, v, g):
  return jax.value_and_grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0,1,2,3))(q, k, v, g)
args = (sd(K, jnp.bfloat16), sd(K, jnp.bfloat16), sd(V, jnp.bfloat16), sd(K, jnp.float32))
for nm, f in (("fwd", fwd), ("fwd+bwd", fb)):
  t = time.time()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    c = jax.jit(f).lower(*args).compile()
  txt = c.as_text()
  open(f"/tmp/sched_{nm}.hlo", "w").write(txt)
  ov = hlo_stats.async_overlap(txt)
  print(nm, f"{time.time()-t:.1f}s", "custom calls", txt.count("tpu_custom_call"), "permutes", len(ov), "overlapped", sum(x[0]>0 for x in ov), "with kernels", sum(x[1]>0 for x in ov), ov, flush=True)
