"""The sequence-parallel layer every family shares; it knows Transitions, not families.

* :mod:`zeco_jax.sp.scan`: the exclusive scan of states over a mesh axis and its methods
  (the registry ``SCAN_METHODS``: All-Scan, all-gather, ring, tree, the two-level
  All-Scan), with their cost models;
* :mod:`zeco_jax.sp.transitions`: what a rank applies to the state it receives (the
  algebra the scan is written against);
* :mod:`zeco_jax.sp.shard`: the mesh half: checks, the :class:`~zeco_jax.sp.shard.ShardSpec`
  and the one shard_map wrapper.

A family plugs in with its local pass (local outputs, its segment's own state ``S_p`` and
its :class:`~zeco_jax.sp.transitions.Transition`) and its fix-up; ``README.md`` here
tabulates what each family hands over.
"""
from zeco_jax.sp import scan, shard, transitions
from zeco_jax.sp.scan import SCAN_METHODS, ScanMethod, all_scan

__all__ = ["SCAN_METHODS", "ScanMethod", "all_scan", "scan", "shard", "transitions"]
