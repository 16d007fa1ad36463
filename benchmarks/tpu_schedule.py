"""The All-Scan's overlap in the TPU schedule, compiled by libtpu without a TPU.

zeco_gla forward and forward + backward (value_and_grad) over seq = 8 chips of a v5p
topology, B1 x 16384 tokens per chip, H16 K=V=128, bf16, backend from $BK (default
auto: Mosaic kernels), method $M (default all_scan), overlap_pieces $OP (default: None,
the TPU default). $FAM=gated_delta or kda: ``zeco_gated_delta_rule`` / ``zeco_kda``
instead, B1 x 8192 tokens per chip (``benchmarks.tpu_aot_kernels.SP_SHAPE``), g and beta float32.
Prints, per collective-permute start/done pair in schedule order, (compute ops, custom
calls) between them (zeco_jax.runtime.hlo_stats.async_overlap). Results:
benchmarks/results/tpu_schedule.md.

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 python -m benchmarks.tpu_schedule [topology] [--out DIR]
  OP=1 python -m benchmarks.tpu_schedule      # the unsplit local pass, for comparison
  FAM=gated_delta python -m benchmarks.tpu_schedule   # the delta rule's head groups

A CPU host with libtpu (``pip install -e '.[tpu]'``). The compiled HLO goes to
/tmp/sched_{fwd,fwd+bwd}.hlo; with --out, the rows (tpu_schedule.json) and the environment
record (tpu_schedule.env.json) go there too.
"""
import argparse
import json
import os
import time

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zeco_jax  # noqa: E402
from benchmarks import _harness as harness  # noqa: E402
from zeco_jax.runtime import hlo_stats  # noqa: E402

B, L, H, K, V = 1, 16384, 16, 128, 128


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("topology", nargs="?", default="v5p:2x2x2")
  family = os.environ.get("FAM", "gla")
  ap.add_argument("--out", default=None, help="folder for tpu_schedule.json and .env.json")
  a = ap.parse_args(argv)
  topo = topologies.get_topology_desc(platform="tpu", topology_name=a.topology)
  mesh = Mesh(np.array(topo.devices).reshape(1, 8), ("data", "seq"))
  T = 8 * L
  s = NamedSharding(mesh, P("data", "seq"))
  sd = lambda d, dt: jax.ShapeDtypeStruct((B, T, H, d), dt, sharding=s)
  backend = os.environ.get("BK", "auto")
  method = os.environ.get("M", "all_scan")
  pieces = int(os.environ["OP"]) if os.environ.get("OP") else None

  if family == "gla":
    def fwd(*x):
      return zeco_jax.zeco_gla(*x, mesh=mesh, backend=backend, method=method,
                               batch_axes="data", overlap_pieces=pieces)[0]

    args = (sd(K, jnp.bfloat16), sd(K, jnp.bfloat16), sd(V, jnp.bfloat16),
            sd(K, jnp.float32))
  else:
    from benchmarks import tpu_aot_kernels as aot
    mesh = Mesh(np.array(topo.devices).reshape(8), ("seq",))
    args = aot.sp_arguments(family, mesh, aot.SP_SHAPE, jnp.bfloat16)

    def fwd(*x):
      return aot.SP_OPS[family](*x, mesh=mesh, backend=backend, method=method,
                                overlap_pieces=pieces)[0]

  def fb(*x):
    loss = lambda *y: fwd(*y).astype(jnp.float32).sum()
    return jax.value_and_grad(loss, argnums=tuple(range(len(x))))(*x)

  rows = []
  for name, f in (("fwd", fwd), ("fwd+bwd", fb)):
    t = time.time()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      compiled = jax.jit(f).lower(*args).compile()
    text = compiled.as_text()
    with open(f"/tmp/sched_{name}.hlo", "w") as fh:
      fh.write(text)
    ov = hlo_stats.async_overlap(text)
    row = {"family": family, "program": name, "topology": a.topology, "backend": backend,
           "method": method,
           "overlap_pieces": pieces, "compile_s": round(time.time() - t, 1),
           "custom_calls": text.count("tpu_custom_call"), "permutes": len(ov),
           "with_compute": sum(x[0] > 0 for x in ov), "with_kernel": sum(x[1] > 0 for x in ov),
           "pairs": ov}
    rows.append(row)
    print(name, f"{row['compile_s']}s", "custom calls", row["custom_calls"], "permutes",
          row["permutes"], "overlapped", row["with_compute"], "with kernels",
          row["with_kernel"], ov, flush=True)
  if a.out:
    harness.write_environment(a.out, "tpu_schedule", devices=False)
    with open(os.path.join(a.out, "tpu_schedule.json"), "w") as fh:
      json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  main()
