"""Multi-process set-up on JAX's own runtime: ``initialize``, process-local batches, logging.

A program that runs as N processes calls :func:`initialize` once, before anything touches
the backend (``jax.devices()``, a jit, a ``device_put``). It resolves the coordinator
address, the number of processes and this process's id from, in order:

1. the arguments (``train.py --coordinator --num-processes --process-id``, see
   :func:`add_cli_args` / :func:`from_cli`);
2. the environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``
   (what ``python -m zeco_jax.runtime.launch`` sets, with ``ZECO_LOCAL_DEVICE_COUNT`` for the
   number of simulated CPU devices per process);
3. jax's own cluster detection (SLURM, Open MPI, Cloud TPU pods, Kubernetes), by calling
   ``jax.distributed.initialize()`` with whatever is still unset.

With one process and no cluster it does nothing (beyond the CPU device count), so the same
``train.py`` runs unchanged on one host. On CPU it selects gloo for the cross-process
collectives and sets the number of host devices before the backend starts.

Then :func:`global_batch` turns this process's part of a batch into a global ``jax.Array``
(``jax.make_array_from_process_local_data``), :func:`process_local_index` says which part
that is, and :func:`is_main_process` gates logging.

What it does not do: start processes (``zeco_jax.runtime.launch`` does, for one machine; SLURM,
``mpirun`` or the TPU runtime do on clusters), or anything the XLA collectives do not.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from zeco_jax import _jax_private

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "ZECO_LOCAL_DEVICE_COUNT"   # simulated CPU devices per process
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  """What :func:`initialize` resolved (``source``: "single", "explicit" or a cluster name)."""
  process_id: int
  num_processes: int
  coordinator_address: Optional[str]
  local_device_count: Optional[int]
  source: str

_NAME = "zeco_jax.runtime.distributed.initialize"   # errors name the function


def _backend_started() -> bool:
  return _jax_private.backends_started()


def detected_cluster() -> Optional[str]:
  """Name of the cluster environment jax would auto-detect (``"SlurmCluster"``, ...), or None.

  Uses jax's own detection list so it agrees with ``jax.distributed.initialize()``; opt-in
  methods (mpi4py) are skipped, as jax skips them.
  """
  types = _jax_private.cluster_environments()
  if not types:
    if all(k in os.environ for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")):
      return "SlurmCluster"
  for env in types:
    try:
      if not env.opt_in_only_method and env.is_env_present():
        return env.__name__
    except Exception:  # noqa: BLE001 (a broken detector must not break single-host runs)
      continue
  return None


def _int_setting(value, env_name, what, *, minimum):
  """An int from the argument, else from the environment variable; None if neither."""
  source = "argument"
  if value is None:
    raw = os.environ.get(env_name, "").strip()
    if not raw:
      return None
    source = f"environment variable {env_name}"
    try:
      value = int(raw)
    except ValueError:
      raise ValueError(f"{_NAME}: {source} = {raw!r} is not an integer ({what}).") from None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{_NAME}: {what} must be an int, got {value!r} (from {source}).")
  if value < minimum:
    raise ValueError(f"{_NAME}: {what} must be >= {minimum}, got {value} (from {source}).")
  return int(value)


def _check_address(address):
  if not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):\d{1,5}", address):
    raise ValueError(f"{_NAME}: coordinator address {address!r} must be HOST:PORT (e.g. "
                     "10.0.0.1:1234 or [::1]:1234); every process passes the same one, the "
                     "address of process 0.")


def _set_cpu_device_count(count: int) -> None:
  """Host-platform device count, as flag and config (the config wins if both are set)."""
  flags = re.sub(_DEVICE_COUNT_FLAG + r"=\S*", "", os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags.strip()} {_DEVICE_COUNT_FLAG}={count}".strip()
  jax.config.update("jax_num_cpu_devices", count)


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, local_device_count: Optional[int] = None, *,
               auto_detect: bool = True, fail_fast: bool = True,
               **jax_kwargs: Any) -> ProcessInfo:
  """Starts JAX's multi-process runtime if this run has several processes; call it first.

  Args:
    coordinator_address: ``HOST:PORT`` of process 0 (the same on every process); default
      ``$JAX_COORDINATOR_ADDRESS``.
    num_processes: default ``$JAX_NUM_PROCESSES``.
    process_id: this process, ``0 <= process_id < num_processes``; default ``$JAX_PROCESS_ID``.
    local_device_count: simulated CPU devices in this process (CPU only; ignored by GPU/TPU
      backends); default ``$ZECO_LOCAL_DEVICE_COUNT``, else the XLA flag / jax default.
    auto_detect: with nothing set, let ``jax.distributed.initialize()`` detect SLURM / TPU
      pods / Open MPI / Kubernetes. False: nothing set means one process.
    fail_fast: with several processes, an uncaught exception exits this process at once
      (status 1, after printing the traceback) instead of waiting in jax's shutdown
      barrier for peers that are blocked waiting for it; launchers then see the failure.
    **jax_kwargs: passed to ``jax.distributed.initialize`` (``initialization_timeout``,
      ``heartbeat_timeout_seconds``, ``local_device_ids``, ...).

  Returns:
    A :class:`ProcessInfo`. It does not start the backend: more ``jax.config`` updates may
    follow it.

  Raises:
    ValueError: partial or inconsistent settings outside a detected cluster (say a process
      id without a process count), malformed values.
    RuntimeError: called after the backend started, or again with different settings.
  """
  name = _NAME
  num = _int_setting(num_processes, ENV_NUM_PROCESSES, "num_processes", minimum=1)
  pid = _int_setting(process_id, ENV_PROCESS_ID, "process_id", minimum=0)
  local = _int_setting(local_device_count, ENV_LOCAL_DEVICE_COUNT, "local_device_count",
                       minimum=1)
  address = coordinator_address or os.environ.get(ENV_COORDINATOR, "").strip() or None
  if address is not None:
    _check_address(address)
  if num is not None and pid is not None and pid >= num:
    raise ValueError(f"{name}: process_id = {pid} is out of range for num_processes = {num} "
                     f"(ids are 0 .. {num - 1}).")

  if jax.distributed.is_initialized():
    index, count = jax.process_index(), jax.process_count()
    if (num is not None and num != count) or (pid is not None and pid != index):
      raise RuntimeError(f"{name}: already initialized as process {index} of {count}; "
                         f"cannot re-initialize as {pid} of {num}.")
    return ProcessInfo(index, count, _jax_private.coordinator_address(), local, "explicit")

  single = (num == 1) or (num is None and pid is None and address is None
                          and not (auto_detect and detected_cluster()))
  if single:
    if pid not in (None, 0):
      raise ValueError(f"{name}: process_id = {pid} with a single process; use 0 or set "
                       f"num_processes.")
    if local is not None:
      if _backend_started():
        n = len(jax.devices("cpu"))
        if n != local:
          raise RuntimeError(f"{name}: the backend already started with {n} CPU devices; "
                             f"call initialize before any jax computation to get {local}.")
      else:
        _set_cpu_device_count(local)
    return ProcessInfo(0, 1, None, local, "single")

  cluster = detected_cluster() if auto_detect else None
  missing = [flag for flag, value in (("--coordinator / " + ENV_COORDINATOR, address),
                                      ("--num-processes / " + ENV_NUM_PROCESSES, num),
                                      ("--process-id / " + ENV_PROCESS_ID, pid))
             if value is None]
  if missing and cluster is None:
    raise ValueError(
        f"{name}: partial multi-process settings (coordinator={address!r}, num_processes="
        f"{num!r}, process_id={pid!r}) and no cluster environment that jax detects (SLURM, "
        f"TPU pod, Open MPI, Kubernetes). Also set: {', '.join(missing)}; or unset all of "
        f"them for a single process.")
  if _backend_started():
    raise RuntimeError(f"{name}: the JAX backend already started (something called "
                       f"jax.devices(), a jit or device_put); call initialize first, "
                       f"before any jax computation.")
  if local is not None:
    _set_cpu_device_count(local)
  # Cross-process collectives on the CPU backend (the launcher's simulated hosts); a no-op
  # for GPU (NCCL) and TPU (ICI/DCN) devices. Keep "mpi" if the user chose it.
  if jax.config.jax_cpu_collectives_implementation != "mpi":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, num_processes=num,
                             process_id=pid, **jax_kwargs)
  index, count = jax.process_index(), jax.process_count()
  if fail_fast and count > 1:
    _install_fail_fast()
  return ProcessInfo(index, count, _jax_private.coordinator_address(), local,
                     "explicit" if not missing else cluster)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Adds ``--coordinator``, ``--num-processes``, ``--process-id``, ``--local-device-count``."""
  group = parser.add_argument_group(
      "multi-process", "one process per host or per GPU; default: the JAX_* environment "
      "variables, else SLURM / TPU-pod auto-detection, else a single process")
  group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="address of process 0 (the same on every process)")
  group.add_argument("--num-processes", type=int, default=None, metavar="N")
  group.add_argument("--process-id", type=int, default=None, metavar="I",
                     help="this process, 0 .. N-1")
  group.add_argument("--local-device-count", type=int, default=None, metavar="D",
                     help="simulated CPU devices per process (CPU only)")
  return parser


def from_cli(args: argparse.Namespace, **kwargs: Any) -> ProcessInfo:
  """:func:`initialize` from the flags :func:`add_cli_args` added."""
  return initialize(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                    getattr(args, "process_id", None), getattr(args, "local_device_count", None),
                    **kwargs)


def is_main_process() -> bool:
  """True on process 0: the one that logs, writes metrics and plots."""
  return jax.process_index() == 0


def _as_sharding(mesh, spec):
  return spec if isinstance(spec, jax.sharding.Sharding) else NamedSharding(mesh, spec)


def process_local_index(global_shape: Sequence[int], mesh, spec) -> tuple:
  """The slices of a global array of ``global_shape`` that this process's devices hold.

  ``global_host_array[process_local_index(...)]`` is what :func:`global_batch` expects
  from this process, so a data pipeline can build only that part (e.g. rows
  ``idx[0]`` of the batch, tokens ``idx[1]`` of each sequence).

  Raises:
    ValueError: this process's devices hold a non-contiguous set along some axis (a mesh
      whose device order interleaves processes); build the mesh from ``jax.devices()`` in
      order, or use ``jax.make_array_from_callback``.
  """
  sharding = _as_sharding(mesh, spec)
  global_shape = tuple(int(d) for d in global_shape)
  index_map = sharding.addressable_devices_indices_map(global_shape)
  result = []
  for dim, size in enumerate(global_shape):
    spans = sorted({idx[dim].indices(size)[:2] for idx in index_map.values()})
    lo, hi = spans[0][0], spans[-1][1]
    covered = sum(b - a for a, b in spans)
    if covered != hi - lo or any(b[0] != a[1] for a, b in zip(spans, spans[1:])):
      raise ValueError(f"process_local_index: process {jax.process_index()} holds "
                       f"{spans} of axis {dim} (size {size}) under {sharding}: not one "
                       f"contiguous block. Build the mesh from jax.devices() in order.")
    result.append(slice(lo, hi))
  return tuple(result)


def global_batch(local_data, mesh, spec, global_shape=None):
  """A global ``jax.Array`` (or pytree of them) from this process's part.

  Args:
    local_data: array or pytree of arrays: this process's block, i.e.
      ``global[process_local_index(global_shape, mesh, spec)]``. With one process, the
      whole array.
    mesh: the (global) mesh; spec: a ``PartitionSpec`` (or a ``Sharding``) for every leaf.
    global_shape: the global shape (or a pytree of them); default: inferred by jax,
      i.e. the local shape times the number of processes along each sharded axis.
  """
  sharding = _as_sharding(mesh, spec)
  leaves, treedef = jax.tree.flatten(local_data)
  if global_shape is None:
    shapes = [None] * len(leaves)
  elif jax.tree_util.treedef_is_leaf(treedef):
    shapes = [tuple(global_shape)]
  else:
    shapes = treedef.flatten_up_to(global_shape)
  arrays = [jax.make_array_from_process_local_data(sharding, np.asarray(x), shape)
            for x, shape in zip(leaves, shapes)]
  return jax.tree.unflatten(treedef, arrays)


def _install_fail_fast() -> None:
  """An uncaught exception ends this process at once, with status 1.

  Without this, Python runs jax's atexit ``jax.distributed.shutdown()``, whose barrier waits
  (up to ``shutdown_timeout_seconds``, 5 minutes by default) for peers that are themselves
  blocked in a collective waiting for this process: the whole job hangs instead of failing.
  """
  previous = sys.excepthook
  if getattr(previous, "_zeco_fail_fast", False):
    return

  def hook(exc_type, exc, tb):  # pragma: no cover (runs as the process dies)
    try:
      previous(exc_type, exc, tb)
    finally:
      for stream in (sys.stderr, sys.stdout):
        try:
          stream.flush()
        except Exception:  # noqa: BLE001
          pass
      os._exit(1)

  hook._zeco_fail_fast = True
  sys.excepthook = hook
