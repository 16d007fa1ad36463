"""Worker for test_multihost.py next to it, run under ``python -m zeco_jax.runtime.launch``.

    python -m zeco_jax.runtime.launch --processes 2 --devices-per-process 4 -- \\
        tests/multihost/multihost_worker.py gla OUT.npz   # zeco_gla fwd + grads, every method
    ... -- tests/multihost/multihost_worker.py die         # process 1 fails after a first step

``gla``: every process builds only its own half of the sequence, makes global arrays with
``zeco_jax.runtime.distributed.global_batch``, runs ``jit(value_and_grad(zeco_gla))`` on the mesh
``seq=8`` spanning both processes, and process 0 writes the (replicated) results to OUT.
:func:`gla_results` is also what the test runs in one process for the reference.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, TESTS, os.path.dirname(TESTS)]     # this folder, helpers, the repository

from zeco_jax.runtime import distributed  # noqa: E402  (before anything starts the backend)

METHODS = ("all_scan", "all_gather")   # keys of zeco_jax.sp.scan.SCAN_METHODS: ppermute, all-gather
SHAPE = dict(B=2, T=128, H=2, K=8, V=16)


def gla_results(mesh, method, seed=0):
  """Loss, o, final state and the gradients of q, k, v, g, h0, all as host numpy arrays."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from helpers import cotangents, gla_inputs
  from zeco_jax import zeco_gla

  B, T, H, K, V = (SHAPE[n] for n in "BTHKV")
  host = [np.asarray(x) for x in gla_inputs(seed, B, T, H, K, V)]   # same on every process
  w_o, w_s = (np.asarray(x) for x in cotangents(seed, B, T, H, K, V))
  seq, whole = P(None, "seq"), P()

  def put(x, spec):   # this process's block only, as a data pipeline would produce it
    return distributed.global_batch(x[distributed.process_local_index(x.shape, mesh, spec)],
                                    mesh, spec, global_shape=x.shape)

  q, k, v, g = (put(x, seq) for x in host[:4])
  h0, w_o, w_s = put(host[4], whole), put(w_o, seq), put(w_s, whole)

  def loss(q, k, v, g, h0, w_o, w_s):
    o, final = zeco_gla(q, k, v, g, mesh=mesh, method=method, chunk_size=16,
                        initial_state=h0, output_final_state=True)
    return jnp.sum(o * w_o) + jnp.sum(final * w_s), (o, final)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
  (value, (o, final)), grads = step(q, k, v, g, h0, w_o, w_s)
  # Replicate on every device so each process can read the whole result.
  replicate = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, whole))
  tree = replicate({"loss": value, "o": o, "final": final,
                    **{f"d{n}": d for n, d in zip(("q", "k", "v", "g", "h0"), grads)}})
  return {name: np.asarray(x.addressable_data(0)) for name, x in tree.items()}


def main(argv):
  info = distributed.initialize()
  import jax
  import numpy as np
  from jax.sharding import Mesh

  mode = argv[0]
  print(f"process {info.process_id} of {info.num_processes} pid {os.getpid()}: "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices", flush=True)
  mesh = Mesh(np.array(jax.devices()), ("seq",))   # process p holds seq ranks 4p .. 4p+3
  if mode == "gla":
    out = {}
    for method in METHODS:
      out.update({f"{method}/{k}": v for k, v in gla_results(mesh, method).items()})
      print(f"{method}: loss {float(out[f'{method}/loss']):.6f}", flush=True)
    if distributed.is_main_process():
      np.savez(argv[1], **out)
  elif mode == "die":
    from jax.experimental import multihost_utils
    for step in range(1000):
      multihost_utils.sync_global_devices(f"step {step}")   # a cross-process collective
      print(f"step {step} done", flush=True)
      if step == 1 and jax.process_index() == 1:
        raise RuntimeError("multihost_worker: process 1 fails on purpose at step 1")
  else:
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main(sys.argv[1:])
