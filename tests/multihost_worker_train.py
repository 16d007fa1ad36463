"""Helper for tests/test_multihost_train.py: restore a train.py checkpoint, dump the params.

    python tests/multihost_worker_train.py WORKDIR OUT.npz --config tiny_mqar \\
        --mesh data=1,seq=8 --set KEY=VALUE ...                     # one process
    python -m zeco_jax.launch --processes 2 --devices-per-process 4 -- \\
        tests/multihost_worker_train.py WORKDIR OUT.npz ...          # two processes

Builds the same experiment train.py would (config, mesh, abstract sharded state), restores
the latest checkpoint under WORKDIR/checkpoints with orbax onto the (global) mesh, and
process 0 writes the step and every parameter, gathered to the host, to OUT.npz (keys are
the parameter paths). One process gets 8 simulated CPU devices unless XLA_FLAGS says
otherwise.
"""
import argparse
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("workdir")
  p.add_argument("out")
  p.add_argument("--config", default="tiny_mqar")
  p.add_argument("--mesh", default=None)
  p.add_argument("--set", action="append", default=[])
  args = p.parse_args(argv)

  from zeco_jax import distributed
  distributed.initialize()           # no-op in one process; the launcher's env otherwise
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  import configs
  import train

  cfg = configs.load(args.config, args.set)
  if args.mesh:
    cfg["mesh"] = configs.parse_mesh(args.mesh)
  mesh_shape = configs.validate(cfg, len(jax.devices()))
  exp = train.get_experiment(cfg, mesh_shape)
  mngr = ocp.CheckpointManager(os.path.abspath(os.path.join(args.workdir, "checkpoints")))
  step = mngr.latest_step()
  if step is None:
    raise SystemExit(f"no checkpoint under {args.workdir}/checkpoints")
  state = mngr.restore(step, args=ocp.args.StandardRestore(exp.abstract_state))
  params = multihost_utils.process_allgather(state["params"], tiled=True)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  arrays = {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}
  if distributed.is_main_process():
    np.savez(args.out, __step__=np.asarray(step), **arrays)
  print(f"restored step {step}: {len(arrays)} arrays on {jax.process_count()} process(es), "
        f"{len(jax.devices())} devices")


if __name__ == "__main__":
  main()
