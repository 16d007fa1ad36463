"""Compile the trainer's whole training step for a TPU topology, without a TPU.

    python train.py --config configs/gla_1b3.py --compile_only=v5p:4x4x4 --config.mesh=data=1,seq=64

With libtpu installed (``pip install -e '.[train,tpu]'``: the trainer's own packages too),
JAX compiles for a TPU topology on a
CPU-only host (JAX's ``jax.experimental.topologies``): :func:`compile_train_step`
builds the trainer's :class:`trainer.experiment.Experiment` on the topology's abstract devices and
lowers its jitted ``train_step`` (forward, backward, AdamW update; ``backend="auto"``, so
the Mosaic TPU kernels) with ``jax.ShapeDtypeStruct`` arguments carrying the state and
batch shardings: no array is allocated and no data is read. libtpu compiles it under
``use_abstract_mesh`` (Pallas needs it to see a TPU). :func:`analyse` reads the compiled
program: per-chip memory (``memory_analysis``: arguments, outputs, temporaries, the total
against the chip's HBM), FLOPs per chip (``cost_analysis``), every collective kind with its
count and bytes sent per chip per step (:func:`zeco_jax.runtime.hlo_stats.collective_bytes` of the
compiled HLO) and, from the scheduled HLO, how many collective-permutes (the All-Scan's
sends) have compute scheduled between their start and done
(:func:`zeco_jax.runtime.hlo_stats.async_overlap`). A program over HBM fails to compile in libtpu
("Ran out of memory on HBM"); that is reported as not fitting, with libtpu's figures.

``benchmarks/scale_aot.py`` sweeps configs, contexts, topologies and scan methods with it.

Meshes: ``data`` x ``seq``. With ``data`` > 1 the trainer passes the batch axis to the GLA
layers (``batch_axes``) so the Mosaic kernels run per (data, seq) shard (a kernel cannot be
partitioned by the compiler); with ``data`` = 1 the mesh is built with the ``seq`` axis alone
(the same program). ``--config.model.backend=jax`` compiles the jnp path instead. Limits:
FLOPs from ``cost_analysis`` do not count the Mosaic kernels' work (the kernels carry no
cost estimate); :func:`analyse` also gives 6 N D (parameters x tokens).
"""
from __future__ import annotations

import copy
import os
import re
import time

# libtpu looks up this host's own TPU (there is none here) at start-up and prints "Failed to
# find host bounds for accelerator type" and a worker-hostname error without these two.
# They name only the (absent) local chip: the programs compiled for a topology are
# byte-identical with and without them (checked for v5e, v5p and v6e topologies).
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
# Several processes may compile for TPU at once on one host (no TPU is opened).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import configs
from trainer.experiment import Experiment, make_mesh
from zeco_jax.runtime import hlo_stats

# HBM per chip, GiB: Google Cloud TPU docs (cloud.google.com/tpu/docs/v5e: 16 GiB;
# /tpu/docs/v5p: 95 GiB; /tpu/docs/v6e: 32 GiB). libtpu's own limit, which decides whether
# a program compiles, is a little lower (15.75G of v5e's 16).
HBM_GIB = {"v5e": 16, "v5p": 95, "v6e": 32}
GIB = 2 ** 30
_OOM = re.compile(r"Ran out of memory in memory space hbm|Ran out of memory on HBM", re.I)


def generation(topology: str) -> str:
  """``"v5p:8x8x8"`` -> ``"v5p"``."""
  gen = topology.split(":", 1)[0]
  if gen not in HBM_GIB or ":" not in topology:
    raise ValueError(f"compile_only: topology {topology!r}: expected GEN:SHAPE with GEN one "
                     f"of {sorted(HBM_GIB)}, e.g. v5p:2x2x2 or v5e:4x4")
  return gen


def topology_devices(topology: str) -> list:
  """The abstract TPU devices of ``topology`` (needs libtpu; no TPU)."""
  generation(topology)
  try:
    import libtpu  # noqa: F401
  except ImportError as e:
    raise ValueError("compile_only: the TPU compiler is not installed: pip install -e "
                     "'.[train,tpu]'") from e
  from jax.experimental import topologies
  return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def build_mesh(mesh_shape: dict, devices) -> jax.sharding.Mesh:
  """The trainer's (data, seq) mesh over ``devices``; with data = 1, the seq axis alone
  (the same program, and every mesh axis manual inside zeco_gla's shard_map, which the
  Mosaic kernels need: see the module docstring)."""
  if mesh_shape["data"] == 1:
    return jax.make_mesh((mesh_shape["seq"],), ("seq",), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))
  return make_mesh(mesh_shape, devices=devices)


def abstract_batch(exp: Experiment, config) -> dict:
  """The train step's batch as ShapeDtypeStructs with the batch sharding (no data)."""
  shape = (config.data.batch_size, config.data.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "mask" else jnp.int32,
                                  sharding=exp.batch_sharding)
          for k in exp.batch_keys}     # inputs, targets, mask (+ segment_ids: packed docs)


def compile_train_step(config: ml_collections.ConfigDict, topology: str):
  """Compiles ``config``'s train step for ``topology``; returns ``(compiled, info)``.

  ``info``: topology, generation, chips, mesh shape, device kind, lower and compile
  seconds, parameter count, tokens per chip. ``compiled`` is None when libtpu reports the
  program does not fit HBM; ``info["oom"]`` then holds its message.

  Raises:
    ValueError: a bad topology or config (validated against the topology's chip count),
      or no libtpu.
  """
  devices = topology_devices(topology)
  if config.data.kind == "text" and not config.data.path:
    config = copy.deepcopy(config)
    config.data.path = os.curdir     # no data is read: the corpus path check does not apply
  mesh_shape = configs.validate(config, len(devices))
  mesh = build_mesh(mesh_shape, devices)
  exp = Experiment(config, mesh)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(exp.abstract_state["params"]))
  B, T = config.data.batch_size, config.data.seq_len
  info = {"topology": topology, "generation": generation(topology), "chips": len(devices),
          "device_kind": devices[0].device_kind, "mesh": dict(mesh_shape),
          "params": n_params, "batch": B, "seq_len": T,
          "tokens_per_chip": B * T // len(devices), "oom": None}
  t0 = time.perf_counter()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = exp.train_step.lower(exp.abstract_state, abstract_batch(exp, config))
    info["lower_s"] = time.perf_counter() - t0
    try:
      compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - libtpu raises XlaRuntimeError for HBM
      if not _OOM.search(str(e)):
        raise
      compiled, info["oom"] = None, " ".join(str(e).split())[:400]
  info["compile_s"] = time.perf_counter() - t0 - info["lower_s"]
  return compiled, info


def oom_required_bytes(message: str):
  """The bytes libtpu said the program needs, from its out-of-memory message, or None."""
  m = re.search(r"required[^(]*\(([\d.]+)([KMGT])\)", message or "")
  if not m:
    return None
  return float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024


def analyse(compiled, info: dict, hlo_text: str | None = None) -> dict:
  """The report of one compiled train step (see the module docstring); JSON-ready."""
  hbm = HBM_GIB[info["generation"]] * GIB
  report = {**info, "hbm_bytes": hbm}
  if compiled is None:
    need = oom_required_bytes(info["oom"])
    report.update(fits=False, memory={"required_bytes_libtpu": need}, flops=None,
                  collectives={}, permute_overlap=None)
    return report
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
  report["memory"] = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
                      "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
                      "code": m.generated_code_size_in_bytes, "total": total}
  report["fits"] = total <= hbm
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  report["flops"] = float(cost.get("flops", 0.0))
  report["model_flops_6nd"] = 6.0 * info["params"] * info["tokens_per_chip"]
  text = compiled.as_text() if hlo_text is None else hlo_text
  n = info["chips"]
  sent = hlo_stats.collective_bytes(text, n)
  counts = hlo_stats.collective_counts(text)
  report["collectives"] = {
      kind: {"count": counts.get(kind, 0), "bytes_per_chip": float(np.max(sent[kind])),
             "bytes_per_chip_mean": float(np.mean(sent[kind]))}
      for kind in sorted(set(sent) | set(counts))}
  for kind in report["collectives"]:
    report["collectives"][kind].setdefault("bytes_per_chip", 0.0)
  between = hlo_stats.async_overlap(text)
  report["permute_overlap"] = {"pairs": len(between),
                               "with_compute": sum(1 for c, _ in between if c),
                               "with_kernel": sum(1 for _, k in between if k)}
  report["tpu_custom_calls"] = text.count('custom_call_target="tpu_custom_call"')
  return report


def _fmt_bytes(x) -> str:
  if x is None:
    return "?"
  for unit, size in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if abs(x) >= size:
      return f"{x / size:.2f} {unit}"
  return f"{x:.0f} B"


def format_report(r: dict) -> str:
  """The report as lines for a terminal."""
  mesh = r["mesh"]
  lines = [f"compiled train step for {r['topology']} ({r['chips']} x {r['device_kind']}), mesh "
           f"data={mesh['data']} x seq={mesh['seq']}, batch {r['batch']} x {r['seq_len']} "
           f"tokens ({r['tokens_per_chip']} per chip), {r['params'] / 1e6:.1f}M params; "
           f"lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s"]
  hbm = r["hbm_bytes"]
  if r["memory"].get("total") is None:
    lines.append(f"memory per chip: DOES NOT FIT {r['generation']} HBM ({_fmt_bytes(hbm)}): "
                 f"libtpu: {r['oom']}")
    return "\n".join(lines)
  mem = r["memory"]
  lines.append(
      f"memory per chip: arguments {_fmt_bytes(mem['arguments'])}, outputs "
      f"{_fmt_bytes(mem['outputs'])} ({_fmt_bytes(mem['aliased'])} aliased to arguments), "
      f"temporaries {_fmt_bytes(mem['temporaries'])}, code {_fmt_bytes(mem['code'])}; total "
      f"{_fmt_bytes(mem['total'])} of {_fmt_bytes(hbm)} {r['generation']} HBM "
      f"({100 * mem['total'] / hbm:.1f}%: {'fits' if r['fits'] else 'DOES NOT FIT'})")
  lines.append(f"FLOPs per chip (cost_analysis, without the {r['tpu_custom_calls']} Mosaic "
               f"kernel calls): {r['flops']:.3e}; 6 N D per chip: {r['model_flops_6nd']:.3e}")
  lines.append("collectives per step (bytes sent per chip, most of any chip):")
  for kind, c in r["collectives"].items():
    lines.append(f"  {kind}: {c['count']} ops, {_fmt_bytes(c['bytes_per_chip'])} per chip")
  if not r["collectives"]:
    lines.append("  none")
  ov = r["permute_overlap"]
  lines.append(f"collective-permutes with compute scheduled between start and done: "
               f"{ov['with_compute']} of {ov['pairs']} ({ov['with_kernel']} with a Mosaic "
               "kernel)")
  return "\n".join(lines)


def run(config: ml_collections.ConfigDict, topology: str) -> dict:
  """Compile, analyse and print; returns the report (``train.py --compile_only``)."""
  compiled, info = compile_train_step(config, topology)
  report = analyse(compiled, info)
  print(format_report(report), flush=True)
  return report
