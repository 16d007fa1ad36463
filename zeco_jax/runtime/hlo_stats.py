"""Bytes each rank sends in the collectives of a compiled XLA program, read from its HLO.

Used by the communication-volume test and ``benchmarks/comm_volume.py``: the numbers
come from what XLA actually compiled, not from a model. For a collective-permute, each
``{source, target}`` pair moves the operand once from source; an all-gather over G ranks
has each rank send its shard to G - 1 others (ring) and receive (G - 1) shards; a
reduce-scatter or all-reduce is counted the same way, by its per-rank input.
"""
from __future__ import annotations

import collections
import re

import numpy as np

_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8,
                "u64": 8, "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2}
_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s32|u32|s64|u64|pred|s8|u8|s16|u16)\[([0-9,]*)\]")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS = re.compile(r"replica_groups=(\{[^=]*?\}\})|replica_groups=\[(\d+),(\d+)\]")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def _shape_bytes(dtype: str, dims: str) -> int:
  """Bytes of one HLO array type, e.g. ("f32", "2,16,32")."""
  n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
  return n * _DTYPE_BYTES[dtype]


def _result_shapes(line: str) -> str:
  """The text between '=' and the op name: the instruction's result type (a tuple type, as
  an async start's on TPU, starts with its own parenthesis)."""
  lhs, _, rhs = line.partition("=")
  op = re.search(r"\s[a-z][\w\-]*\(", rhs)
  return rhs[:op.start()] if op else rhs


def collective_bytes(hlo_text: str, num_devices: int) -> dict:
  """Per-kind bytes sent by each device: ``{kind: np.array([bytes per device])}``.

  Kinds: ``collective-permute``, ``all-gather``, ``all-reduce``, ``reduce-scatter``,
  ``all-to-all``. Async pairs (``-start`` / ``-done``) are counted once, at the start.
  """
  sent = collections.defaultdict(lambda: np.zeros(num_devices))
  for raw in hlo_text.splitlines():
    line = raw.strip()
    m = re.search(r"\s(collective-permute|all-gather|all-reduce|reduce-scatter|all-to-all)"
                  r"(-start)?\(", line)
    if not m or "-done" in line.split("(")[0]:
      continue
    kind = m.group(1)
    result = _result_shapes(line)
    if kind == "collective-permute":
      pairs = _PAIRS.search(line)
      if not pairs:
        continue
      # Result of a -start is a tuple (operand, result, ...): count one buffer.
      nbytes = _shape_bytes(*_SHAPE.findall(result)[0])
      for src, _ in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)):
        sent[kind][int(src)] += nbytes
    else:
      group_size = _group_size(line, num_devices)
      shapes = _SHAPE.findall(result)
      if not shapes:
        continue
      if kind == "all-gather" and m.group(2):   # -start: (operands..., results...)
        shapes = shapes[len(shapes) // 2:]
      # A combined collective (TPU merges the gradient all-reduces) has a tuple of results.
      nbytes = sum(_shape_bytes(*s) for s in shapes)
      if kind == "all-gather":          # result holds G shards; each rank sends its one G-1 times
        per_rank = nbytes / group_size * (group_size - 1)
      elif kind == "reduce-scatter":    # result is one shard; ring sends G-1 shards
        per_rank = nbytes * (group_size - 1)
      elif kind == "all-to-all":        # each rank keeps 1/G of its buffer, sends the rest
        per_rank = nbytes * (group_size - 1) / group_size
      else:                             # all-reduce (ring: 2 (G-1)/G of the buffer)
        per_rank = nbytes * 2 * (group_size - 1) / group_size
      sent[kind] += per_rank
  return dict(sent)


def collective_counts(hlo_text: str) -> dict:
  """``{kind: number of collective ops}`` of an HLO module (an async pair counts once)."""
  counts = collections.Counter()
  for line in hlo_text.splitlines():
    m = re.search(r"\s(collective-permute|all-gather|all-reduce|reduce-scatter|all-to-all)"
                  r"(-start)?\(", line)
    if m and "-done" not in line.split("(")[0]:
      counts[m.group(1)] += 1
  return dict(counts)


def _group_size(line: str, num_devices: int) -> int:
  mesh = _MESH_GROUPS.search(line)   # replica_groups=mesh['data'=2,'seq'=4] {'seq'}
  if mesh:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
    return int(np.prod([sizes[a] for a in re.findall(r"'([^']+)'", mesh.group(2))]))
  m = _GROUPS.search(line)
  if not m:
    return num_devices
  if m.group(1):
    first = re.search(r"\{([\d,]+)\}", m.group(1))
    return len(first.group(1).split(",")) if first else num_devices
  return int(m.group(3))


_COMPUTE = re.compile(r"\s(fusion|custom-call|dot|convolution|while|call)\(")
_ASYNC_START = re.compile(r"^(?:ROOT )?(\S+) = .*\s(collective-permute|all-gather|all-reduce)"
                          r"-start\(")


def _scheduled_computations(hlo_text: str) -> dict:
  """``{name: [instruction lines in schedule order]}`` of a compiled module's text (the
  compiled HLO is printed in schedule order when ``is_scheduled=true``)."""
  comps, name, body = {}, None, []
  for raw in hlo_text.splitlines():
    line = raw.strip()
    if name is None:
      m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{$", line)
      if m and "=" not in line.split("(")[0]:
        name, body = m.group(1), []
      continue
    if line == "}":
      comps[name] = body
      name = None
    elif line:
      body.append(line)
  return comps


def async_overlap(hlo_text: str, kind: str = "collective-permute") -> list:
  """For each async ``kind`` start/done pair of a scheduled HLO module, in schedule order:
  ``(compute, kernels)``, the number of compute instructions (fusions, custom calls, dots,
  convolutions, loops, calls) and of those the custom calls (Pallas kernels, library
  calls) the schedule places between the start and its done.

  A pair with no compute is exposed: nothing runs while its data is in flight
  (docs/design.md §4: the All-Scan is "zero overhead" only when its sends overlap the
  local work). Small fusions (the chain's own bookkeeping) count as compute; ``kernels``
  says whether real local work is there.
  """
  report = []
  for body in _scheduled_computations(hlo_text).values():
    starts = {}
    for i, line in enumerate(body):
      m = _ASYNC_START.match(line)
      if m and m.group(2) == kind:
        starts[m.group(1).lstrip("%")] = i
        continue
      m = re.search(rf"\s{kind}-done\(%?([\w.\-]+)\)", line)
      if m and m.group(1) in starts:
        between = body[starts[m.group(1)] + 1:i]
        report.append((sum(1 for b in between if _COMPUTE.search(b)),
                       sum(1 for b in between if " custom-call(" in b)))
  return report
