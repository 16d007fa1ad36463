"""The training step at scale, compiled for v5p topologies without a TPU (issue 12 item 4).

    python benchmarks/scale_aot.py run [--sweep all|p|context]   # resumable, JSON lines
    python benchmarks/scale_aot.py report     # -> results/scale_aot.md, .json, .png

Each point is the trainer's whole train step (forward, backward, AdamW; ``backend="auto"``,
so the Mosaic kernels) compiled by libtpu for a v5p topology through :mod:`compile_only`,
on a mesh data = 1 x seq = P (every chip on the sequence axis: zeco_gla with the Mosaic
kernels needs every mesh axis manual, see compile_only's docstring), batch 1 sequence of
``P x tokens_per_chip`` tokens. Per point: per-chip memory and whether it fits, bytes sent
per chip per step by collective kind, how many collective-permutes have compute scheduled
between start and done, and compile seconds. ``run`` appends one JSON line per point to
``benchmarks/results/scale_aot.jsonl`` as it goes and skips points already there, so an
interrupted sweep resumes; ``report`` adds the alpha-beta model (v5p ICI figures below)
and the paper's GPU figures and writes the table and plot.

Points (``sweep_points``; ``all`` interleaves them, most needed first):
* ``p``: the gla_340m shape with 2 of its 24 layers (compile time: a 24-layer step took 4
  min to compile on this 2-core host when it was idle; bytes per layer do not depend on
  depth), 4096 tokens per chip (context 32K at P = 8 to 1M at P = 256), all_scan,
  all_gather and tree at P = 8 and 64 first, then 16, 32, 128, 256.
* ``context``: gla_340m, gla_1b3 and gla_7b at full depth, P = 64 (v5p:4x4x4), a 1M-token
  sequence (16K tokens per chip), all_scan and all_gather: does the longest context of the
  range fit v5p's HBM (libtpu refuses to compile a program over HBM, so "fits" is the
  compiler's own answer)?
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
JSONL = os.path.join(RESULTS, "scale_aot.jsonl")
# Compiled HLO of each point (not committed: tens of MB): $SCALE_AOT_HLO_DIR, "" for none.
HLO_DIR = os.environ.get("SCALE_AOT_HLO_DIR", "/tmp/scale_aot_hlo")

# v5p topologies by chip count (Google Cloud v5p docs' slice shapes).
TOPOLOGY = {4: "v5p:2x2x1", 8: "v5p:2x2x2", 16: "v5p:2x2x4", 32: "v5p:2x4x4", 64: "v5p:4x4x4",
            128: "v5p:4x4x8", 256: "v5p:4x8x8", 512: "v5p:8x8x8", 1024: "v5p:8x8x16",
            2048: "v5p:8x16x16", 4096: "v5p:16x16x16"}
METHODS = ("all_scan", "all_gather", "tree")
# Alpha-beta figures for v5p ICI (docs/design.md §6 model). beta: Google Cloud's v5p page
# (cloud.google.com/tpu/docs/v5p) gives 1200 GB/s bidirectional ICI per chip over a 3D
# torus (6 links): 100 GB/s one way on the one link a neighbour send uses. alpha: no public
# per-hop figure; 1 us is an assumption (one hop is under a microsecond, plus the
# collective's start/done), stated as such in the results.
TPU_ALPHA_S = 1e-6
TPU_BETA_S_PER_BYTE = 1 / 100e9
# The paper's H100 figures (Chou et al. 2025, via /work/shared/zeco_spec.md §6): one scan,
# 8K tokens per GPU, d = 4096, H = 32: All-Scan / all-gather ms.
PAPER = {8: (0.226, 0.375), 256: (2.165, 8.514)}


def _p_point(P, method):
  return dict(config="gla_340m", layers=2, seq=P, tokens_per_chip=4096, method=method)


def _context_point(config, method, P=64, context=1 << 20):
  return dict(config=config, layers=None, seq=P, tokens_per_chip=context // P, method=method)


def sweep_points(name: str) -> list:
  """The points of a sweep, in the order they run (see the module docstring)."""
  ends = [_p_point(P, m) for P in (8, 64) for m in ("all_scan", "all_gather")]
  trees = [_p_point(P, "tree") for P in (8, 64)]
  middle = [_p_point(P, m) for P in (16, 32) for m in ("all_scan", "all_gather")]
  far = [_p_point(P, m) for P in (128, 256) for m in ("all_scan", "all_gather")]
  ctx_scan = [_context_point(c, "all_scan") for c in ("gla_340m", "gla_1b3", "gla_7b")]
  ctx_gather = [_context_point(c, "all_gather") for c in ("gla_7b", "gla_1b3", "gla_340m")]
  if name == "p":
    return ends + trees + middle + far + [_p_point(P, "tree") for P in (16, 32, 128, 256)]
  if name == "context":
    return ctx_scan + ctx_gather
  if name == "all":     # what a short session can afford, most needed first
    return ends + ctx_scan + trees + ctx_gather + middle + far
  raise ValueError(f"unknown sweep {name!r}")


def key(p: dict) -> str:
  return (f"{p['config']}|L{p['layers'] or 'all'}|P{p['seq']}|t{p['tokens_per_chip']}|"
          f"{p['method']}")


def load(path=JSONL) -> dict:
  done = {}
  if os.path.exists(path):
    with open(path) as fh:
      for line in fh:
        if line.strip():
          row = json.loads(line)
          if "error" not in row:       # a point that failed is tried again
            done[row["key"]] = row
  return done


def config_for(p: dict):
  """The config of a point: the config file, with the point's overrides."""
  import importlib
  config = importlib.import_module(f"configs.{p['config']}").get_config()
  if p["layers"]:
    config.model.num_layers = p["layers"]
  config.model.seq_method = p["method"]
  config.data.batch_size = 1
  config.data.seq_len = p["seq"] * p["tokens_per_chip"]
  config.mesh = f"data=1,seq={p['seq']}"
  if config.train.sharding_rules.embed == "data":   # FSDP (gla_7b): over seq when data = 1
    config.train.sharding_rules.embed = "seq"
  return config


def run_point(p: dict) -> dict:
  import compile_only
  t0 = time.time()
  try:
    compiled, info = compile_only.compile_train_step(config_for(p), TOPOLOGY[p["seq"]])
    text = compiled.as_text() if compiled is not None else None
    report = compile_only.analyse(compiled, info, text)
    del compiled
    if text is not None and HLO_DIR:       # kept to read again without compiling again
      os.makedirs(HLO_DIR, exist_ok=True)
      with gzip.open(os.path.join(HLO_DIR, key(p).replace("|", "_") + ".hlo.gz"), "wt") as fh:
        fh.write(text)
  except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
    report = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}
  return {"key": key(p), "point": p, "wall_s": time.time() - t0, **report}


def git_state() -> str:
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "zeco_jax", "pallas_kernels",
                            "models", "trainer.py", "compile_only.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split("\n")
    dirty = [d[3:] for d in dirty if d.strip() and not d.startswith("??")]
    return head + (f" + uncommitted {', '.join(dirty)}" if dirty else "")
  except OSError:
    return "unknown"


def cmd_run(args) -> None:
  done = load()
  if "longest" in args.sweep:
    state = git_state()
    for config in args.configs:
      for method in ("all_scan", "all_gather"):
        t = longest_search(config, method, done, state)
        print(f"longest {config} {method}: {t} tokens per chip", flush=True)
    return
  points = [p for s in args.sweep for p in sweep_points(s)]
  state = git_state()
  for p in points:
    if key(p) in done:
      continue
    row = run_point(p)
    row["git"] = state
    with open(JSONL, "a") as fh:
      fh.write(json.dumps(row) + "\n")
    done[row["key"]] = row
    mem = (row.get("memory") or {}).get("total") or 0
    print(f"{row['key']}: wall {row['wall_s']:.0f}s fits={row.get('fits')} "
          f"mem={mem / 2**30:.2f}GiB {row.get('error', '')[:200]}", flush=True)


# The longest-context search (``run --sweep longest``), per (config, method) at P = 64:
# tokens per chip of a point that fits and of one that does not (libtpu reports what it
# would need), then the longest multiple of 4096 the straight line between them puts under
# HBM, then 4096 down from there until one fits (4096 up while one fits).
LONGEST_P = 64
LONGEST_BRACKETS = {"gla_340m": (16384, 65536), "gla_1b3": (16384, 65536),
                    "gla_7b": (4096, 16384)}
STEP = 4096


def _need(row):
  mem = row.get("memory") or {}
  return mem.get("total") or mem.get("required_bytes_libtpu")


def _run_once(p, done, state):
  if key(p) in done:
    return done[key(p)]
  row = run_point(p)
  row["git"] = state
  with open(JSONL, "a") as fh:
    fh.write(json.dumps(row) + "\n")
  done[row["key"]] = row
  mem = _need(row) or 0
  print(f"{row['key']}: wall {row['wall_s']:.0f}s fits={row.get('fits')} "
        f"mem={mem / 2**30:.2f}GiB {row.get('error', '')[:200]}", flush=True)
  return row


def longest_search(config, method, done, state, hbm=95 * 2**30):
  """Compiles points of (config, method) at P = LONGEST_P until the longest context that
  fits is pinned to STEP tokens per chip: the two points of LONGEST_BRACKETS give the
  line of memory against tokens per chip (libtpu's required bytes where over HBM), its
  crossing of ``hbm`` the first guess, then one STEP at a time until a fitting point sits
  next to one that does not. Returns the last fitting tokens per chip (None: lo does not
  fit, the report says so)."""
  pt = lambda t: dict(config=config, layers=None, seq=LONGEST_P, tokens_per_chip=t,
                      method=method)
  lo, hi = LONGEST_BRACKETS[config]
  r_lo, r_hi = _run_once(pt(lo), done, state), _run_once(pt(hi), done, state)
  if not r_lo.get("fits") or not (_need(r_lo) and _need(r_hi)):
    return None
  slope = (_need(r_hi) - _need(r_lo)) / (hi - lo)
  t = max(lo, lo + int((hbm - _need(r_lo)) / slope) // STEP * STEP)
  fits = t == lo or _run_once(pt(t), done, state).get("fits")
  if fits:
    while _run_once(pt(t + STEP), done, state).get("fits"):
      t += STEP
    return t
  while not fits and t - STEP > lo:
    t -= STEP
    fits = _run_once(pt(t), done, state).get("fits")
  return t if fits else lo


NOTES = [
    "- **All-Scan bytes are flat in P**: 2 MiB per chip per step at every P from 8 to 256 "
    "(2 layers x one 512 KiB state forward + one reverse; 4 more bytes: the previous rank's "
    "last segment id of the packed-document path), exactly as the model says. gla_1b3 at "
    "full depth sends 144 MiB = 3 x 24 layers x 2 MiB: with `remat` the backward recomputes "
    "the forward, All-Scan included (one more state per layer).",
    "- **all_gather grows with P**: its scan bytes go from 21 MiB (P = 8) to 253 MiB "
    "(P = 64) and 1024 MiB (P = 256) at 2 layers. From P = 64 XLA lowers the gather as an "
    "all-reduce of a zero-padded buffer (no all-gather op is left), which `hlo_stats` counts "
    "as a ring all-reduce (2 (G - 1) / G of the buffer): x48.6 from P = 8 to 256 for P - 1's "
    "x36.4.",
    "- **A non-scan collective grows with P and dominates the all-reduce column**: every "
    "step all-reduces two bf16 `[P, tokens per chip, hidden]` buffers and an int32 / float32 "
    "`[P, tokens per chip]` each built by a dynamic-update-slice into zeros: the whole "
    "sequence's hidden states (and tokens / segment ids) gathered onto every chip through an "
    "all-reduce (at P = 16 and 32 XLA emits it as an all-gather instead: the all-gather "
    "column of the all_scan rows). At P = 64 and 4K tokens per chip that is 2 x 512 MiB (the "
    "2.2 GiB of the all_scan row against 0.3 GiB at P = 8; 8.2 GiB at P = 256); at 16K tokens "
    "per chip 2 x 2 GiB. It comes from "
    "GSPMD outside zeco_gla (the embedding / head / packed-document path: not identified in "
    "this session), it is in all three methods, and it is the likely reason gla_7b at 1M "
    "tokens does not fit (libtpu: 325 GiB of temporaries).",
    "- **All-Scan costs memory at P = 64 here**: gla_1b3 at 1M tokens needs 47.8 GiB per "
    "chip with all_scan (32.8 GiB of temporaries) and 30.4 GiB with all_gather (14.8 GiB), while "
    "all_gather sends 22.8 GiB per chip per step against all_scan's 5.1 GiB (its gathers "
    "lowered as all-reduces). Not explained in this session: the unrolled chain has num_blocks "
    "+ P - 2 sends per scan and the TPU scheduler may keep many blocks in flight; the lead's "
    "uncommitted overlap work (head-group pieces) was in the tree. Both fit v5p's 95 GiB.",
    "- The full-sequence gather is missing from the tree steps at P = 128 and 256 (1.9 GiB "
    "per chip against all_scan's 4.0 and 7.1 GiB, all-reduce 0.34 GiB): whether GSPMD emits it "
    "depends on the program around zeco_gla, not on P alone.",
    "- **Overlap**: at P = 8 (2 layers) 26 of the 33 All-Scan permutes have compute between "
    "start and done (16 of them a Mosaic kernel), 64 of 65 at P = 16, 136 of 137 at P = 32; "
    "from P = 64 only 29 (of 281, 537, 1081 at P = 64, 128, 256), and at full "
    "depth 317 of 3361 (gla_340m) and 1051 of 5641 (gla_1b3): the chain has num_blocks + P - "
    "2 sends per scan and the local pass offers only a few kernels to hide them behind. The "
    "lead's overlap work in zeco_jax/parallel.py and scan.py was uncommitted while this ran "
    "(the Code line above).",
    "- **The data axis is 1 in every point**: with data > 1 the Mosaic kernels do not "
    "compile inside zeco_gla (its shard_map is manual over seq only; 'Mosaic kernels cannot be "
    "automatically partitioned'), so there is no data-parallel gradient reduction here; "
    "gradients are all-reduced over the seq axis (parameters are replicated over it). P = 1 "
    "(no sequence parallelism) is not compiled for the same reason at 4 chips, and v5p "
    "names start at 2x2x1.",
    "- **FLOPs**: `cost_analysis` leaves out the Mosaic kernels (no cost estimate), so "
    "the JSON's `flops` is XLA's part only; `model_flops_6nd` is 6 N D.",
    "- **Not done** (compile time on a 2-core host shared with five other jobs, 1.5-10 min "
    "per point): P = 512 to 4096 chips; full depth at P other than 64; contexts below 1M for gla_7b (its longest fitting "
    "context is not known); a search for the longest context above 1M per chip count.",
]


def model_dims(config_name: str, layers=None) -> dict:
  import importlib
  m = importlib.import_module(f"configs.{config_name}").get_config().model
  H = m.num_heads
  return {"H": H, "K": int(m.hidden_size * m.expand_k) // H,
          "V": int(m.hidden_size * m.expand_v) // H, "layers": layers or m.num_layers}


def predicted_comm_s(p: dict, alpha=TPU_ALPHA_S, beta=TPU_BETA_S_PER_BYTE) -> float:
  """Alpha-beta time of the step's scans: one forward and one reverse per layer, the
  state of one sequence per chip (B = 1), blocks as zeco_gla picks them."""
  from zeco_jax import scan as scan_lib
  d = model_dims(p["config"], p["layers"])
  M, m_A = 4 * d["H"] * d["K"] * d["V"], 4 * d["H"] * d["K"]
  nb = scan_lib.default_num_blocks(p["seq"], M, d["V"], method=p["method"])
  one = scan_lib.predicted_time(p["seq"], nb, M, alpha, beta, p["method"], m_A)
  return 2 * d["layers"] * one


def _gib(x):
  return "" if x is None else f"{x / 2**30:.2f}"


def _mib(x):
  return "" if x is None else f"{x / 2**20:.2f}"


def _coll(row, kind):
  return (row.get("collectives") or {}).get(kind, {}).get("bytes_per_chip", 0.0)


SCAN_KINDS = ("collective-permute", "all-gather", "reduce-scatter", "all-to-all")
def scan_bytes(by: dict, P: int, method: str):
  """Bytes per chip of ``method``'s scans at ``P``: all_scan's permutes; for the others,
  all bytes minus the all_scan step's plus its permutes (the same step but for the scan;
  XLA may lower a gather as an all-reduce of a zero-padded buffer), None without both."""
  if method in ("all_scan", "tree"):     # both scan with permutes only
    return _coll(by[(P, method)], "collective-permute") if (P, method) in by else None
  if (P, method) not in by or (P, "all_scan") not in by:
    return None
  return (_total(by[(P, method)]) - _total(by[(P, "all_scan")])
          + _coll(by[(P, "all_scan")], "collective-permute"))


def _total(row):
  return sum(c["bytes_per_chip"] for c in (row.get("collectives") or {}).values())


def cmd_report(done: dict) -> None:
  import jax
  rows = list(done.values())
  p_rows = sorted((r for r in rows if r["point"]["layers"] == 2),
                  key=lambda r: (r["point"]["seq"], METHODS.index(r["point"]["method"])))
  c_rows = sorted((r for r in rows if r["point"]["layers"] is None),
                  key=lambda r: (r["point"]["config"], r["point"]["seq"], r["point"]["method"],
                                 -r["point"]["tokens_per_chip"]))
  gits = sorted({r.get("git", "?") for r in rows})
  out = ["# The training step at scale, compiled for v5p without a TPU (issue 12 item 4)", "",
         f"`python benchmarks/scale_aot.py run --sweep all` (stopped where the notes say) then `... report` (jax "
         f"{jax.__version__}, libtpu 0.0.48.1, a 2-core CPU host shared with other jobs). "
         f"Code: {'; '.join(gits)}. Every row is the trainer's whole train step (forward, "
         "backward, AdamW, bf16 compute, `backend=\"auto\"`: the Mosaic TPU kernels) compiled "
         "by libtpu for the v5p topology of P chips, mesh data = 1 x seq = P, one sequence of "
         "P x tokens-per-chip tokens (`compile_only.py`). Bytes: sent per chip per step, read "
         "from the compiled HLO (`zeco_jax.hlo_stats`), the most of any chip. Memory: "
         "`memory_analysis()` per chip (arguments + outputs - aliased + temporaries + code) "
         "against v5p's 95 GiB; libtpu refuses to compile a program over HBM (\"does not "
         "fit\"). Overlap: collective-permutes with compute (a fusion, kernel, dot, loop) "
         "scheduled between their start and done in the compiled TPU schedule. Model: the "
         f"alpha-beta time (docs/design.md §6) of the step's scans (one forward, one reverse "
         f"per layer) with v5p ICI figures: 1/beta = 100 GB/s (Google Cloud's v5p page: "
         f"1200 GB/s bidirectional ICI per chip over the 6 links of a 3D torus, one link one "
         f"way), alpha = {TPU_ALPHA_S * 1e6:.0f} us (an assumption: no public per-hop figure).",
         "", "## Bytes per chip per step vs P (gla_340m shape, 2 of its 24 layers, 4096 "
         "tokens per chip)", "",
         "Compiled at 2 layers to fit the compile time (a 24-layer step took 4 min to "
         "compile on this host idle; 2 layers took 1.5-10 min under this session's load). "
         "The scan collectives are per layer (the full model sends 12x them); the all-reduce "
         "is the gradients' and a full-sequence gather (Notes).", "",
         "| P | topology | context | method | permutes | permute MiB | all-gather MiB | "
         "reduce-scatter MiB | all-reduce MiB | all MiB | memory GiB | fits | permutes "
         "with compute (with a kernel) | model comm ms | compile s |", "|" + "---|" * 15]
  for r in p_rows:
    q = r["point"]
    if "error" in r:
      out.append(f"| {q['seq']} | {TOPOLOGY[q['seq']]} | | {q['method']} | error: "
                 f"{r['error'][:150]} |" + " |" * 10)
      continue
    c = r.get("collectives") or {}
    scan = _total(r)
    ov = r.get("permute_overlap") or {}
    out.append(
        f"| {q['seq']} | {r['topology']} | {q['seq'] * q['tokens_per_chip'] // 1024}K | "
        f"{q['method']} | {c.get('collective-permute', {}).get('count', 0)} | "
        f"{_mib(_coll(r, 'collective-permute'))} | {_mib(_coll(r, 'all-gather'))} | "
        f"{_mib(_coll(r, 'reduce-scatter'))} | {_mib(_coll(r, 'all-reduce'))} | "
        f"{_mib(scan)} | {_gib((r.get('memory') or {}).get('total'))} | "
        f"{'yes' if r.get('fits') else 'NO'} | {ov.get('with_compute', '')} of "
        f"{ov.get('pairs', '')} ({ov.get('with_kernel', '')}) | "
        f"{predicted_comm_s(q) * 1e3:.3f} | "
        f"{r.get('compile_s', 0):.0f} |")
  by = {(r["point"]["seq"], r["point"]["method"]): r for r in p_rows if "error" not in r}
  Ps = sorted({P for P, _ in by})
  summary = []
  for m in METHODS:
    have = [P for P in Ps if (P, m) in by]
    if len(have) >= 2:
      lo, hi = have[0], have[-1]
      b_lo, b_hi = scan_bytes(by, lo, m), scan_bytes(by, hi, m)
      if b_lo is None or b_hi is None:
        continue
      what = ("collective-permute bytes per chip (the All-Scan, forward and reverse)"
              if m == "all_scan" else "collective-permute bytes per chip" if m == "tree" else
              "scan bytes per chip (all bytes minus the all_scan step's, plus its permutes)")
      summary.append(f"- {m}: {what}: {_mib(b_lo)} MiB at P = {lo}, {_mib(b_hi)} MiB at "
                     f"P = {hi}: x{b_hi / b_lo:.3f} (P - 1: x{(hi - 1) / (lo - 1):.2f}).")
  out += ["", *summary]

  out += ["", "## Longest context that fits v5p HBM (full depth)", "",
          "The top of the range: one 1M-token sequence over P = 64 chips (16K tokens per "
          "chip), every layer. gla_7b shards its parameters and optimizer state over the seq "
          "axis (FSDP, `train.sharding_rules.embed=seq`: the data axis is 1); gla_340m and "
          "gla_1b3 replicate them, as their configs do. Per-chip memory depends on the tokens "
          "per chip, not on P, except for all_gather's gathered states (P per layer).", "",
          "| config | P | method | context | tokens per chip | memory GiB | fits | permute "
          "MiB | all-gather MiB | reduce-scatter MiB | all-reduce MiB | permutes with compute "
          "| compile s |", "|" + "---|" * 13]
  longest = {}
  for r in c_rows:
    q = r["point"]
    ctx = q["seq"] * q["tokens_per_chip"]
    if "error" in r:
      out.append(f"| {q['config']} | {q['seq']} | {q['method']} | {ctx // 1024}K | "
                 f"{q['tokens_per_chip']} | error: {r['error'][:150]} |" + " |" * 7)
      continue
    mem = r.get("memory") or {}
    total = mem.get("total")
    need = mem.get("required_bytes_libtpu")
    ov = r.get("permute_overlap") or {}
    out.append(
        f"| {q['config']} | {q['seq']} | {q['method']} | {ctx // 1024}K | "
        f"{q['tokens_per_chip']} | {_gib(total) if total else ('> 95 (libtpu: ' + _gib(need) + ' needed)' if need else '> 95')} | "
        f"{'yes' if r.get('fits') else 'NO'} | {_mib(_coll(r, 'collective-permute'))} | "
        f"{_mib(_coll(r, 'all-gather'))} | {_mib(_coll(r, 'reduce-scatter'))} | "
        f"{_mib(_coll(r, 'all-reduce'))} | {ov.get('with_compute', '')} of "
        f"{ov.get('pairs', '')} | {r.get('compile_s', 0):.0f} |")
    k = (q["config"], q["seq"], q["method"])
    if r.get("fits"):
      longest[k] = max(longest.get(k, 0), ctx)
    else:
      longest.setdefault(k, 0)
  out += ["", "| config | P | all_scan longest context | all_gather longest context |",
          "|---|---|---|---|"]
  for config, P in sorted({(c, P) for c, P, _ in longest}):
    cell = lambda m: (f">= {longest[(config, P, m)] // 1024}K (the range's top)"
                      if longest.get((config, P, m)) else
                      ("< 1M (shorter contexts not compiled)" if (config, P, m) in longest
                       else "not compiled"))
    out.append(f"| {config} | {P} | {cell('all_scan')} | {cell('all_gather')} |")

  from zeco_jax import scan as scan_lib
  state = 1 << 20
  out += ["", "## Alpha-beta model (v5p ICI figures above) beside the paper's H100 figures",
          "", "One exclusive scan of the paper's 1 MiB state (8K tokens per GPU, d = 4096, "
          "H = 32), ms; the paper's measured All-Scan / all-gather on H100s "
          "(/work/shared/zeco_spec.md §6).", "",
          "| P | model all_scan (v5p) | model all_gather (v5p) | model tree (v5p) | paper "
          "All-Scan (H100) | paper all-gather (H100) |", "|---|---|---|---|---|---|"]
  for P in (8, 16, 32, 64, 128, 256, 1024, 4096):
    nb = scan_lib.default_num_blocks(P, state, 128, TPU_ALPHA_S, TPU_BETA_S_PER_BYTE)
    t = {m: scan_lib.predicted_time(P, nb, state, TPU_ALPHA_S, TPU_BETA_S_PER_BYTE, m,
                                    state / 128) * 1e3 for m in METHODS}
    pa = PAPER.get(P, ("", ""))
    out.append(f"| {P} | {t['all_scan']:.3f} | {t['all_gather']:.3f} | {t['tree']:.3f} | "
               f"{pa[0]} | {pa[1]} |")
  out += ["", "## Notes (read from the compiled programs of this sweep)", "", *NOTES]
  text = "\n".join(out) + "\n"
  with open(os.path.join(RESULTS, "scale_aot.md"), "w") as fh:
    fh.write(text)
  with open(os.path.join(RESULTS, "scale_aot.json"), "w") as fh:
    json.dump({"rows": rows, "alpha_s": TPU_ALPHA_S, "beta_s_per_byte": TPU_BETA_S_PER_BYTE,
               "longest_context": {"|".join(map(str, k)): v for k, v in longest.items()}},
              fh, indent=1)
  print(text)
  _plot(by, Ps, c_rows)


def _plot(by, Ps, c_rows) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for m, mk in zip(METHODS, "osd"):
    have = [P for P in Ps if scan_bytes(by, P, m) is not None]
    ax1.plot(have, [scan_bytes(by, P, m) / 2**20 for P in have], marker=mk,
             label=f"{m}: its scans")
  have = [P for P in Ps if (P, "all_scan") in by]
  ax1.plot(have, [_coll(by[(P, "all_scan")], "all-reduce") / 2**20 for P in have], "k:",
           label="all-reduce: gradients + full-sequence gather")
  ax1.set(xscale="log", yscale="log", xlabel="chips on the seq axis P",
          ylabel="MiB sent per chip per step",
          title="gla_340m shape, 2 layers, 4K tokens/chip (v5p)")
  ax1.legend(fontsize=7)
  for (config, P, m), mk in zip(sorted({(r["point"]["config"], r["point"]["seq"],
                                         r["point"]["method"]) for r in c_rows}), "os^v<>ph*Xd"):
    pts = [r for r in c_rows if (r["point"]["config"], r["point"]["seq"], r["point"]["method"])
           == (config, P, m) and "error" not in r]
    xs = [r["point"]["seq"] * r["point"]["tokens_per_chip"] / 1024 for r in pts]
    ys = [((r.get("memory") or {}).get("total") or (r.get("memory") or {}).get(
        "required_bytes_libtpu") or 0) / 2**30 for r in pts]
    if pts:
      ax2.plot(xs, ys, marker=mk, label=f"{config} P={P} {m}")
  ax2.axhline(95, color="r", ls="--", label="v5p HBM 95 GiB")
  ax2.set(xscale="log", xlabel="context (K tokens)", ylabel="GiB per chip",
          title="Per-chip memory, full depth")
  ax2.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(RESULTS, "scale_aot.png"), dpi=110)


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  sub = ap.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--sweep", nargs="+", default=["all"], choices=["p", "context", "all", "longest"])
  r.add_argument("--configs", nargs="+", default=list(LONGEST_BRACKETS))
  sub.add_parser("report")
  a = ap.parse_args()
  if a.cmd == "run":
    cmd_run(a)
  else:
    cmd_report(load())
