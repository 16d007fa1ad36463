"""How long a context hybrid-340M trains with on 64 v5p chips, Ulysses against all_gather,
compiled ahead of time on a CPU host (no TPU).

    python -m benchmarks.hybrid_reach_aot [--topology v5p:4x4x4]
        [--tokens_per_chip 32768,65536,131072,262144] [--methods ulysses,all_gather]
        [--out benchmarks/results]

For each method, ``configs/hybrid_340m.py``'s whole train step (``model.remat=True``, the
text pipeline's packed documents, bf16 compute) is compiled for the topology by libtpu
(``trainer.aot.compile_train_step``: the Mosaic GLA kernels, the splash attention kernels)
at growing tokens per chip, until one does not fit a chip's HBM. The mesh is the longest
sequence the method can span: Ulysses splits the 8 query heads over the seq axis, so its
seq axis is at most 8 (``data=8, seq=8``: 8 sequences, each over 8 chips); all_gather spans
all 64 chips (``data=1, seq=64``). Context = tokens per chip x seq.

Appends every compile's report to ``hybrid_reach_aot.jsonl`` (so a stopped run keeps what
it compiled) and writes ``hybrid_reach_aot.md`` from it, with ``.env.json``.
"""
from __future__ import annotations

import argparse
import json
import os

from benchmarks import _harness as harness

MESHES = {"ulysses": "data=8,seq=8", "all_gather": "data=1,seq=64", "ring": "data=1,seq=64"}


def config_for(method: str, tokens_per_chip: int, chips: int):
  from configs import hybrid_340m
  config = hybrid_340m.get_config()
  mesh = dict(kv.split("=") for kv in MESHES[method].split(","))
  data, seq = int(mesh["data"]), int(mesh["seq"])
  assert data * seq == chips, (method, chips)
  config.mesh = MESHES[method]
  config.data.batch_size = data
  config.data.seq_len = tokens_per_chip * seq
  config.model.remat = True
  config.model.attn_seq_method = method
  return config


def write_md(path_jsonl: str, out: str, env: dict, command: str):
  rows = [json.loads(x) for x in open(path_jsonl)]
  gib = lambda x: f"{x / 2**30:.2f}"
  lines = ["# Hybrid-340M's reach on 64 v5p chips: Ulysses against all_gather (compiled, not run)",
           "", "**Question.** What is the longest context `configs/hybrid_340m.py` trains with "
           "on 64 v5p chips (95 GiB HBM each) when its attention blocks use Ulysses, and when "
           "they use the all-gather of K and V?", "",
           f"**Command.** `{command}` ({harness.env_line(env)}; libtpu compiles for the "
           "topology on a CPU host: memory is the compiler's, nothing ran).", "",
           "| method | mesh | tokens per chip | context | fits | memory per chip GiB "
           "(temporaries) | collectives GiB per chip per step | compile s |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    mem = r.get("memory", {})
    total = mem.get("total")
    col = r.get("collectives", {})
    moved = ", ".join(f"{k} {gib(c['bytes_per_chip'])}" for k, c in sorted(col.items())
                      if c["bytes_per_chip"] >= 2**20)
    mem_cell = (f"{gib(total)} ({gib(mem['temporaries'])})" if total is not None else
                f"needs {gib(mem['required_bytes_libtpu'])}"
                if mem.get("required_bytes_libtpu") else "over HBM")
    lines.append(f"| {r['method']} | {MESHES[r['method']]} | {r['tokens_per_chip']:,} | "
                 f"{r['seq_len']:,} | {'yes' if r['fits'] else 'no'} | {mem_cell} | "
                 f"{moved if total is not None else '-'} | {r['compile_s']:.0f} |")
  best = {}
  for r in rows:
    if r["fits"]:
      best[r["method"]] = max(best.get(r["method"], 0), r["seq_len"])
  lines += ["", "Longest context that compiled within HBM: "
            + "; ".join(f"{m}: {t:,} tokens" for m, t in best.items()) + "."]
  with open(out, "w") as fh:
    fh.write("\n".join(lines) + "\n")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--topology", default="v5p:4x4x4")
  ap.add_argument("--tokens_per_chip", default="32768,65536,131072,262144")
  ap.add_argument("--methods", default="ulysses,all_gather")
  ap.add_argument("--out", default=harness.RESULTS)
  args = ap.parse_args()
  from trainer import aot
  chips = len(aot.topology_devices(args.topology))
  jsonl = os.path.join(args.out, "hybrid_reach_aot.jsonl")
  for method in args.methods.split(","):
    for n in map(int, args.tokens_per_chip.split(",")):
      compiled, info = aot.compile_train_step(config_for(method, n, chips), args.topology)
      report = {"method": method, **aot.analyse(compiled, info)}
      print(aot.format_report(report), flush=True)
      with open(jsonl, "a") as fh:
        fh.write(json.dumps(report) + "\n")
      if not report["fits"]:
        break
  env = harness.environment(devices=False)
  harness.write_environment(args.out, "hybrid_reach_aot", devices=False)
  print(write_md(jsonl, os.path.join(args.out, "hybrid_reach_aot.md"), env,
                 "python -m benchmarks.hybrid_reach_aot " + " ".join(
                     f"--{k}={v}" for k, v in vars(args).items() if k != "out")))


if __name__ == "__main__":
  main()
