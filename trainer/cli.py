"""What the command lines (``train.py``, ``generate.py``) share: the flags of a run over
several processes (:func:`zeco_jax.runtime.distributed.initialize`; without them: the
``JAX_*`` environment variables, else SLURM / TPU-pod detection, else one process)."""
from __future__ import annotations

from typing import NamedTuple, Optional

from absl import flags

from zeco_jax.runtime import distributed


class ProcessFlags(NamedTuple):
  coordinator: flags.FlagHolder
  num_processes: flags.FlagHolder
  process_id: flags.FlagHolder

  def initialize(self, local_device_count: Optional[int]):
    """Starts the multi-process runtime (first: before anything starts the jax backend)."""
    return distributed.initialize(self.coordinator.value, self.num_processes.value,
                                  self.process_id.value, local_device_count)


def define_process_flags() -> ProcessFlags:
  """``--coordinator``, ``--num-processes``, ``--process-id``."""
  return ProcessFlags(
      flags.DEFINE_string("coordinator", None,
                          "HOST:PORT of process 0, the same on every process"),
      flags.DEFINE_integer("num-processes", None, "number of processes"),
      flags.DEFINE_integer("process-id", None, "this process, 0 .. N-1"))
