"""Worker for test_multihost_train.py next to it: restore train.py checkpoints, dump the
params.

    PYTHONPATH=. python -m zeco_jax.runtime.launch --processes 2 --devices-per-process 4 -- \\
        tests/multihost/multihost_worker_train.py --workdir W --out OUT.npz \\
        [--workdir W2 --out OUT2.npz ...] --config.mesh=data=1,seq=8 ...

Builds the same experiment train.py would (config with its overrides, mesh, abstract
sharded state), restores the latest checkpoint under W/checkpoints with orbax onto the
(global) mesh, and process 0 writes the step and every parameter, gathered to the host, to
OUT.npz (keys are the parameter paths); then the same for each further (--workdir, --out)
pair, in order, in the same processes. Processes and devices: the launcher's environment.
"""
import os

from absl import app, flags
from ml_collections import config_flags

from zeco_jax.runtime import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(ROOT, "configs", "tiny_mqar.py"), lock_config=True)
_WORKDIR = flags.DEFINE_multi_string("workdir", None, "train.py's workdir (repeatable)",
                                     required=True)
_OUT = flags.DEFINE_multi_string("out", None, "the .npz file to write, one per --workdir",
                                 required=True)


def main(argv):
  del argv
  distributed.initialize()           # from the launcher's environment
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.experimental import multihost_utils

  import configs
  import trainer

  if len(_WORKDIR.value) != len(_OUT.value):
    raise SystemExit(f"{len(_WORKDIR.value)} --workdir but {len(_OUT.value)} --out")
  mesh_shape = configs.validate(_CONFIG.value, len(jax.devices()))
  exp = trainer.Experiment(_CONFIG.value, trainer.make_mesh(mesh_shape))
  for workdir, out in zip(_WORKDIR.value, _OUT.value):
    mngr = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")))
    step = mngr.latest_step()
    if step is None:
      raise SystemExit(f"no checkpoint under {workdir}/checkpoints")
    state = mngr.restore(step, args=ocp.args.StandardRestore(exp.abstract_state))
    params = multihost_utils.process_allgather(state["params"], tiled=True)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    arrays = {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}
    if distributed.is_main_process():
      np.savez(out, __step__=np.asarray(step), **arrays)
    print(f"restored {workdir} step {step}: {len(arrays)} arrays on {jax.process_count()} "
          f"process(es), {len(jax.devices())} devices")


if __name__ == "__main__":
  app.run(main)
