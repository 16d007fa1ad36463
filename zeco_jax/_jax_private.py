"""Every use of JAX's private ``jax._src`` in zeco-jax, in one place.

Each function says which public API it stands in for, and what to move to when JAX
offers one. Each degrades to a safe answer when the private name has moved, so a JAX
upgrade can break a feature's precision here but never the import of zeco-jax.
"""
from __future__ import annotations

from typing import Optional


def backends_started() -> bool:
  """Whether a JAX backend has been created in this process.

  Public stand-in when one exists: none (``jax.devices()`` would start a backend). False
  when the private name is gone: the caller then cannot warn that it is too late to set
  the device count, and JAX's own error is the fallback.
  """
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return False


def cluster_environments() -> tuple:
  """The cluster environments ``jax.distributed.initialize()`` auto-detects (SLURM, TPU
  pods, Open MPI, Kubernetes, ...), as jax's own ``ClusterEnv`` subclasses; () when the
  private name is gone (the caller then checks the SLURM variables itself). No public list.
  """
  try:
    from jax._src import clusters
    return tuple(clusters.ClusterEnv._cluster_types)
  except (ImportError, AttributeError):
    return ()


def coordinator_address() -> Optional[str]:
  """The coordinator address ``jax.distributed.initialize`` used, or None.

  ``jax.process_index()`` / ``jax.process_count()`` are the public API for the rest of the
  distributed state; the address has none.
  """
  try:
    from jax._src import distributed as jax_distributed
    return jax_distributed.global_state.coordinator_address
  except (ImportError, AttributeError):
    return None
