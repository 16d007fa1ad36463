"""The training step at scale, compiled for v5p topologies without a TPU.

    python -m benchmarks.scale_aot run [--sweep all|p|context]   # resumable, JSON lines
    python -m benchmarks.scale_aot run --sweep longest [--configs gla_1b3 ...]
    python -m benchmarks.scale_aot report     # -> results/scale_aot.md, .json, .png

A CPU host with libtpu (``pip install -e '.[train,tpu]'``); 1-27 min and up to 30 GB of host
memory per point. Each point is the trainer's whole train step (forward, backward, AdamW;
``backend="auto"``, so the Mosaic kernels) compiled by libtpu for a v5p topology through
``trainer.aot``, on a mesh data = 1 x seq = P (every chip on the sequence axis: zeco_gla with
the Mosaic kernels needs every mesh axis manual, see trainer.aot's docstring), batch 1
sequence of
``P x tokens_per_chip`` tokens. Per point: per-chip memory and whether it fits, bytes sent
per chip per step by collective kind, how many collective-permutes have compute scheduled
between start and done, and compile seconds. ``run`` appends one JSON line per point to
``benchmarks/results/scale_aot.jsonl`` as it goes and skips points already there, so an
interrupted sweep resumes; ``report`` adds the alpha-beta model (v5p ICI figures below)
and the paper's GPU figures and writes the table and plot.

Points (``sweep_points``; ``all`` interleaves them, most needed first):
* ``p``: the gla_340m shape with 2 of its 24 layers (compile time: a 24-layer step took 4
  min to compile on this 2-core host when it was idle; bytes per layer do not depend on
  depth), 4096 tokens per chip (context 32K at P = 8 to 8M at P = 2048), all_scan,
  all_gather and tree at P = 8 and 64 first, then all_scan and all_gather at 16, 32, 128,
  256, 512, 1024 and 2048 (P = 4096, v5p:16x16x16, ran out of this host's 24 GB), tree at
  16, 32, 128 and 256, then 4 and 1 (P = 1: v5p's smallest slice, 4 chips, as data = 4 with one
  4096-token sequence per chip).
* ``context``: gla_340m, gla_1b3 and gla_7b at full depth, P = 64 (v5p:4x4x4), a 1M-token
  sequence (16K tokens per chip), all_scan and all_gather: does the longest context of the
  range fit v5p's HBM (libtpu refuses to compile a program over HBM, so "fits" is the
  compiler's own answer)?
* ``two_level``: the gla_340m shape as ``p``, ``all_scan_2level`` at P = 64, 256, 1024 and
  2048 (its groups and blocks as zeco_gla picks them).
* ``longest`` (``--configs``): per config and method (all_scan, all_gather), at P = 64 and
  full depth, the longest context that fits, to 4096 tokens per chip (:func:`longest_search`).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import time

from benchmarks import _harness as harness

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
RESULTS = harness.RESULTS
JSONL = os.path.join(RESULTS, "scale_aot.jsonl")
# Compiled HLO of each point (not committed: tens of MB): $SCALE_AOT_HLO_DIR, "" for none.
HLO_DIR = os.environ.get("SCALE_AOT_HLO_DIR", "/tmp/scale_aot_hlo")

# v5p topologies by chip count (Google Cloud v5p docs' slice shapes).
# P = 1 (no sequence parallelism): the smallest v5p slice, 4 chips, as data = 4 (config_for).
TOPOLOGY = {1: "v5p:2x2x1", 4: "v5p:2x2x1", 8: "v5p:2x2x2", 16: "v5p:2x2x4", 32: "v5p:2x4x4",
            64: "v5p:4x4x4", 128: "v5p:4x4x8", 256: "v5p:4x8x8", 512: "v5p:8x8x8",
            1024: "v5p:8x8x16",
            2048: "v5p:8x16x16", 4096: "v5p:16x16x16"}
METHODS = ("all_scan", "all_gather", "tree", "all_scan_2level")
TWO_LEVEL_P = (64, 256, 1024, 2048)
# Alpha-beta figures for v5p ICI (docs/design.md §6 model). beta: Google Cloud's v5p page
# (cloud.google.com/tpu/docs/v5p) gives 1200 GB/s bidirectional ICI per chip over a 3D
# torus (6 links): 100 GB/s one way on the one link a neighbour send uses. alpha: no public
# per-hop figure; 1 us is an assumption (one hop is under a microsecond, plus the
# collective's start/done), stated as such in the results.
TPU_ALPHA_S = 1e-6
TPU_BETA_S_PER_BYTE = 1 / 100e9
# The paper's H100 figures (Chou et al., NeurIPS 2025): one scan,
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
  far = [_p_point(P, m) for P in (128, 256, 512, 1024, 2048) for m in ("all_scan", "all_gather")]
  ctx_scan = [_context_point(c, "all_scan") for c in ("gla_340m", "gla_1b3", "gla_7b")]
  ctx_gather = [_context_point(c, "all_gather") for c in ("gla_7b", "gla_1b3", "gla_340m")]
  if name == "p":
    return (ends + trees + middle + far + [_p_point(P, "tree") for P in (16, 32, 128, 256)]
            + [_p_point(4, m) for m in METHODS[:3]] + [_p_point(1, "all_scan")]
            + sweep_points("two_level"))
  if name == "context":
    return ctx_scan + ctx_gather
  if name == "two_level":
    return [_p_point(P, "all_scan_2level") for P in TWO_LEVEL_P]
  if name == "all":     # what a short run can afford, most needed first
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
  if p["seq"] == 1:    # one sequence per chip on v5p's smallest slice: data = 4, no seq axis work
    config.data.batch_size = 4
    config.mesh = "data=4,seq=1"
  if config.train.sharding_rules.embed == "data":   # FSDP (gla_7b): over seq when data = 1
    config.train.sharding_rules.embed = "seq"
  return config


def run_point(p: dict) -> dict:
  from trainer import aot
  t0 = time.time()
  try:
    compiled, info = aot.compile_train_step(config_for(p), TOPOLOGY[p["seq"]])
    text = compiled.as_text() if compiled is not None else None
    report = aot.analyse(compiled, info, text)
    del compiled
    if text is not None and HLO_DIR:       # kept to read again without compiling again
      os.makedirs(HLO_DIR, exist_ok=True)
      with gzip.open(os.path.join(HLO_DIR, key(p).replace("|", "_") + ".hlo.gz"), "wt") as fh:
        fh.write(text)
  except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
    report = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}
  return {"key": key(p), "point": p, "wall_s": time.time() - t0, **report}


def git_state() -> str:
  """The commit a point was compiled at (uncommitted paths named)."""
  return harness.commit()


def cmd_run(args) -> None:
  done = load()
  if "longest" in args.sweep:
    state = git_state()
    for config in args.configs:
      for method in args.methods:
        t = longest_search(config, method, done, state, brackets=args.brackets)
        print(f"longest {config} {method}: {t} tokens per chip", flush=True)
    return
  points = [p for s in args.sweep for p in sweep_points(s)]
  state = git_state()
  for p in points:
    _run_once(p, done, state)


# The longest-context search (``run --sweep longest``, :func:`longest_search`), per
# (config, method) at P = 64, from two points of tokens per chip.
LONGEST_P = 64
LONGEST_METHODS = ("all_scan", "all_gather")
LONGEST_BRACKETS = {"gla_340m": (16384, 65536), "gla_1b3": (16384, 65536),
                    "gla_7b": (4096, 16384)}
STEP = 4096


def _need(row):
  mem = row.get("memory") or {}
  return mem.get("total") or mem.get("required_bytes_libtpu")


def _run_once(p, done, state):
  """The row of point ``p``: from ``done``, else compiled, appended to JSONL and printed."""
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


def longest_search(config, method, done, state, hbm=95 * 2**30, brackets=None):
  """Compiles points of (config, method) at P = LONGEST_P until the longest context that
  fits is pinned to STEP tokens per chip. Memory against tokens per chip is close to a
  line but not one (XLA's scheduler spends spare HBM), so each next point is where the line
  through the two points nearest the crossing of ``hbm`` (the longest that fits and the
  shortest that does not, or the two longest that fit) meets it, in multiples of STEP,
  strictly between the two brackets; libtpu reports the bytes a program over HBM would need,
  so points that do not fit count too. Starts from the two points of ``brackets`` (tokens
  per chip; default LONGEST_BRACKETS[config]) and any points of an earlier run in ``done``.
  Returns the longest fitting tokens per chip (None: the shorter bracket does not fit)."""
  pt = lambda t: dict(config=config, layers=None, seq=LONGEST_P, tokens_per_chip=t,
                      method=method)
  tried = {r["point"]["tokens_per_chip"]: r for r in done.values()   # an earlier run's points
           if "error" not in r and r["point"] == pt(r["point"]["tokens_per_chip"])}
  for t in brackets or LONGEST_BRACKETS[config]:
    tried[t] = _run_once(pt(t), done, state)
  while True:
    fit = sorted(t for t, r in tried.items() if r.get("fits"))
    over = sorted(t for t, r in tried.items() if not r.get("fits"))
    if not fit:
      return None
    if over and over[0] - fit[-1] <= STEP:
      return fit[-1]
    a, b = (fit[-1], over[0]) if over else (fit[-2], fit[-1]) if len(fit) > 1 else (None, None)
    if a is None or not (_need(tried[a]) and _need(tried[b])):
      return fit[-1]                      # nothing to draw a line through: say what fits
    slope = (_need(tried[b]) - _need(tried[a])) / (b - a)
    guess = (fit[-1] + 8 * STEP if slope <= 0 else
             a + int((hbm - _need(tried[a])) / slope) // STEP * STEP)
    t = max(fit[-1] + STEP, guess)
    if over:
      t = min(t, over[0] - STEP)
    tried[t] = _run_once(pt(t), done, state)


NOTES = [
    "- **When**: the points were compiled on 2026-12-01 and 2026-12-02, at the commits named "
    "above (each row's in `scale_aot.json`).",
    "- **All-Scan bytes are flat in P**: 2.00 MiB per chip per step at every P from 4 to 2048 "
    "(2 layers x one 512 KiB state forward + one reverse; 4 more bytes: the previous rank's "
    "last segment id of the packed-document path), as the model says. At full depth gla_340m "
    "sends 24 MiB (24 layers x 1 MiB), gla_1b3 144 MiB = 24 layers x 3 x its 2 MiB state: with "
    "`remat` the backward recomputes the forward, All-Scan included (one more state per layer).",
    "- **all_gather grows with P**: its scan bytes go from 9 MiB (P = 4) and 21 MiB (P = 8) "
    "to 1024 MiB (P = 256) and 8220 MiB (P = 2048) at 2 layers, doubling with each doubling "
    "of P from 64 on. From P = 64 XLA lowers the gather as an all-reduce "
    "of a zero-padded buffer (no all-gather op is left), which `hlo_stats` counts as a ring "
    "all-reduce (2 (G - 1) / G of the buffer): x910 from P = 4 to 2048 for P - 1's x682 "
    "(x113 to 256 for x85). Per-chip memory at P = 2048: all_gather 7.20 GiB, All-Scan "
    "2.58. P = 1 sends nothing over seq (its all-reduce: the gradients over data = 4).",
    "- **No full-sequence collective is left**: the all_scan and tree steps all-reduce only "
    "the gradients (305 MiB at P = 8 to 348 MiB at P = 2048, 2 layers). The sweep before this "
    "one (code 0792133 + uncommitted changes) also all-reduced the whole sequence's hidden "
    "states every step (2.2 GiB per chip at P = 64, 8.2 GiB at P = 256); gone at 03fe6a0. "
    "The embedding backward's flattened ids (replaced in bb60d99) were on that path; those "
    "rows also ran uncommitted model code, so the cause is not pinned to one change.",
    "- **Memory: All-Scan and all_gather need about the same per chip** (within 1.5 GiB "
    "either way near HBM; All-Scan less at 1M tokens): gla_340m at 1M tokens 22.1 GiB per "
    "chip against 23.3, at 4M 69.6 against 71.6; gla_1b3 at 1M 23.1 against 23.5, at 4M 36.4 "
    "against 36.3, at 16896K 94.7 against 93.4; gla_7b at 7168K 91.9 against 93.4, at 7424K "
    "95.2 against 94.9. So All-Scan reaches further on gla_340m (6144K against 5888K), as "
    "far on gla_1b3 (16896K) and one 4096-tokens-per-chip step less on gla_7b (7168K "
    "against 7424K): the table above.",
    "- **remat and XLA's scheduler** (3f3a27b): with `jax.checkpoint` a block's recomputation "
    "and its weight-gradient dots depend on nothing the next block's backward needs, and the "
    "TPU latency-hiding scheduler moved them beside the All-Scan's permutes, keeping every "
    "block's MLP activations alive: gla_1b3 at 1M tokens needed 46.8 GiB per chip with "
    "all_scan against 30.4 with all_gather (no permutes to fill), the gap growing with depth "
    "(equal at 2 and 6 layers; 12 layers: 18.3 against 11.5 GiB of temporaries). "
    "`zeco_jax.nn.remat_call` ties each block's recomputation to its output cotangent and its "
    "weight gradients to its input's cotangent (two optimization barriers): 12 layers 10.4 "
    "GiB. The same commit moved gla_1b3 and gla_7b to the chunked loss "
    "(`train.loss_chunk_size=4096`; dense float32 logits are 2 GiB per 16K tokens per chip). "
    "Together: gla_1b3 at 1M tokens 46.8 -> 23.1 GiB (all_scan), 30.4 -> 23.5 (all_gather); "
    "gla_7b at 1M tokens from 325 GiB (libtpu's figure, either method) to 17.5 GiB with "
    "all_gather (all_scan at 1M not compiled).",
    "- **Overlap** (collective-permutes with compute between start and done): at 2 layers 12 "
    "of 13 at P = 4 (8 with a kernel), 32 of 33 at P = 8, 64 of 65 at P = 16, 136 of 137 at "
    "P = 32, then 58 of 281, 537, 1081 and 2105 at P = 64 to 512, 188 of 4217 at 1024, 316 "
    "of 8313 at 2048; at full depth 774 of 3361 (gla_340m, 16K tokens per chip). The "
    "unrolled chain has num_blocks + P - 2 sends per scan and each rank's own data rides on "
    "num_blocks of them; the local pass, split in head groups (4 for these H = 4 shapes), gives "
    "a kernel to 16 sends per 2 layers from P = 32 on. What stays exposed is the chain's "
    "latency, (num_blocks + P - 2) hops per scan: the model column's 0.46 ms per step at "
    "P = 64 (2 layers). zeco_gla alone at seq = 8: a kernel inside 7 of 8 forward and 16 of "
    "16 forward + backward sends (benchmarks/results/tpu_schedule.md).",
    "- **The data axis**: since 96425ab the Mosaic kernels compile on data x seq meshes (the "
    "trainer passes its batch axis to the GLA layers; tests/trainer/test_aot.py compiles "
    "v5p:2x2x1 as data = 2 x seq = 2). The sweep keeps data = 1 (P = 1: data = 4).",
    "- **FLOPs**: `cost_analysis` leaves out the Mosaic kernels (no cost estimate), so "
    "the JSON's `flops` is XLA's part only; `model_flops_6nd` is 6 N D.",
    "- **gla_7b**: All-Scan reaches 7168K tokens (114688 per chip, 91.93 GiB; 118784 needs "
    "95.23), all_gather one step further, 7424K (118784 per chip, 94.85 GiB; 122880 needs "
    "95.47; the two methods' memory beside each other: the Memory note). Memory is not a "
    "line in tokens here: All-Scan's 118784 needs 3.3 GiB more than its 114688. All-Scan at "
    "7B has 7521 collective-permutes per step (235 per layer, as gla_1b3's 5641 for 24), "
    "2302 (114688 tokens per chip) to 2686 with compute between start and done. Its compile "
    "holds more host memory than this 24 GB host has (a 4096-tokens-per-chip point was "
    "OOM-killed at 24.4 GB "
    "resident): these points were compiled with 62 GB of swap added, 19-27 min each, from "
    "brackets near all_gather's answer (`--methods all_scan --brackets 114688 122880`, "
    "then `118784 122880`) instead of LONGEST_BRACKETS' 4096 and 16384.",
    "- **The two-level All-Scan** (`all_scan_2level`, compiled on 2026-12-04 at b5759aa; "
    "its own table above): 3.86 MiB per chip per step at P = 64 to 3.98 at 2048, 1.93x to "
    "1.99x the All-Scan's 2.00, under the 2x a chip that sent two states in both scans would "
    "reach: a group's last rank sends its level-2 state and the spread (2 states), a member "
    "its level-1 state, its prefix transition (1/256 of a state) and n - 2 shares of n - 1; "
    "the reverse scan's groups are cut from the other end, so a chip's two roles differ. "
    "The compiled step has exactly the code's count of permutes (145 at P = 64 to 1077 at "
    "2048, against the All-Scan's 281 to 8313), and compiles in 33-44 s against 67-376 s. "
    "Hops per scan 18 to 97 (bar 2 (G + num_blocks + log2(P / G)): 26 to 109) against the "
    "All-Scan's 70 to 2078; the model's comm time per step 0.61x the All-Scan's at P = 64, "
    "0.36x at 256, 0.096x at 2048. Compute between start and done: 124 of 145 permutes "
    "(86%) at P = 64 and 216 of 305 (71%) at 256, against the All-Scan's 58 of 281 (21%) "
    "and 58 of 1081 (5%); 19% and 18% at 1024 and 2048, where the spread's 2 x 44 "
    "rotations per scan are more sends than the step has work to put beside them. Only 4 "
    "have a kernel inside: the local pass is split into head groups for `all_scan` only "
    "(`overlap_pieces`).",
    "- **Not done**: P = 4096 (v5p:16x16x16): the All-Scan point at 2 layers was OOM-killed "
    "on this 24 GB host (24.4 GB resident; P = 2048 compiled in 376 s: the unrolled chain is "
    "8313 permutes there); the longest-context search per P at full depth (2-27 min per point "
    "on this 2-core host, and 22-30 GB of host memory for one gla_1b3 or gla_7b all_scan "
    "point near HBM): full depth is compiled at P = 64 only; the GPU schedule of the sends "
    "(benchmarks/results/gpu_overlap.md).",
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
  from zeco_jax.sp import scan as scan_lib
  d = model_dims(p["config"], p["layers"])
  M, m_A = 4 * d["H"] * d["K"] * d["V"], 4 * d["H"] * d["K"]
  nb = scan_lib.default_num_blocks(p["seq"], M, d["V"], method=p["method"])
  G = _group_size(p)
  one = scan_lib.predicted_time(p["seq"], nb, M, alpha, beta, p["method"], m_A,
                                group_size=G)
  return 2 * d["layers"] * one


def _group_size(p: dict):
  """The two-level scan's group size as zeco_gla picks it (the default alpha and beta);
  None for the other methods."""
  from zeco_jax.sp import scan as scan_lib
  if not scan_lib.SCAN_METHODS[p["method"]].grouped:
    return None
  d = model_dims(p["config"], p["layers"])
  return scan_lib.default_group_size(p["seq"], 4 * d["H"] * d["K"] * d["V"])


def _gib(x):
  return "" if x is None else f"{x / 2**30:.2f}"


def _two_level_permutes(P: int, G: int, nb: int) -> int:
  """Collective-permutes of one two-level scan as the code issues them: level 1's chain and
  its transitions' chain, level 2's chain, and per size of the later groups the spread's
  one send to each member and the members' rotations."""
  from zeco_jax.sp import scan as scan_lib
  sizes = scan_lib.group_sizes(P, G)
  n, m = max(sizes), len(sizes)
  chain = lambda L: nb + L - 2 if L > 1 else 0
  spread = sum((k - 1) + (k - 2) for k in set(sizes[1:]) if k >= 2)
  return chain(n) + (n - 1 if m > 1 else 0) + chain(m) + spread


def _two_level_section(by: dict) -> list:
  """The two-level All-Scan against the All-Scan at each P both were compiled at."""
  import math
  from zeco_jax.sp import scan as scan_lib
  Ps = [P for P in TWO_LEVEL_P if (P, "all_scan_2level") in by and (P, "all_scan") in by]
  if not Ps:
    return []
  d = model_dims("gla_340m", 2)
  M = 4 * d["H"] * d["K"] * d["V"]
  out = ["", "## The two-level All-Scan (`all_scan_2level`) beside the All-Scan", "",
         "The same step with `seq_method=all_scan_2level`: All-Scans inside groups of G "
         "consecutive ranks and across the groups' last ranks, then each group's entering "
         "state spread over its members (docs/design.md §6). G and num_blocks as zeco_gla "
         "picks them (the alpha-beta model with its default figures, alpha = 10 us, 100 "
         "GB/s); the model columns use the v5p figures above. Bytes: the most any chip sends "
         "per step (2 layers, forward + reverse scans). Hops: sequential sends on one scan's "
         "critical path (the model's count: level 1, level 2, the two steps of the spread); "
         "the bar is 2 (G + num_blocks + log2(P / G)). Permutes: the compiled step's "
         "collective-permutes, against 4 scans x the code's count per scan + the one "
         "permute outside the scans (the previous rank's last segment id), as in the "
         "all_scan rows.", "",
         "| P | groups | num_blocks | permute MiB per chip | all_scan's | ratio | hops per "
         "scan | bar | all_scan's hops | permutes (code's count) | model comm ms | "
         "all_scan's | ratio | permutes with compute |", "|" + "---|" * 14]
  for P in Ps:
    row, base = by[(P, "all_scan_2level")], by[(P, "all_scan")]
    G = scan_lib.default_group_size(P, M)
    sizes = scan_lib.group_sizes(P, G)
    nb = scan_lib.default_num_blocks(P, M, d["V"], method="all_scan_2level")
    nb_a = scan_lib.default_num_blocks(P, M, d["V"])
    cost = scan_lib.two_level_cost(P, G, nb, M, M / d["V"], TPU_ALPHA_S, TPU_BETA_S_PER_BYTE)
    b2, b1 = _coll(row, "collective-permute"), _coll(base, "collective-permute")
    t2, t1 = predicted_comm_s(row["point"]), predicted_comm_s(base["point"])
    count = (row.get("collectives") or {}).get("collective-permute", {}).get("count", 0)
    ov = row.get("permute_overlap") or {}
    groups = (f"{len(sizes)} of {G}" if len(set(sizes)) == 1 else
              f"{len(sizes) - 1} of {G} + 1 of {sizes[-1]}")
    out.append(
        f"| {P} | {groups} | {nb} | {_mib(b2)} | {_mib(b1)} | {b2 / b1:.3f} | {cost.hops} | "
        f"{2 * (G + nb + math.log2(P / G)):.1f} | {nb_a + P - 2} | {count} "
        f"({4 * _two_level_permutes(P, G, nb) + 1}) | {t2 * 1e3:.3f} | {t1 * 1e3:.3f} | "
        f"{t2 / t1:.3f} | {ov.get('with_compute', '')} of {ov.get('pairs', '')} "
        f"({100 * ov.get('with_compute', 0) / max(ov.get('pairs', 1), 1):.0f}%) |")
  return out


def _mib(x):
  return "" if x is None else f"{x / 2**20:.2f}"


def _coll(row, kind):
  return (row.get("collectives") or {}).get(kind, {}).get("bytes_per_chip", 0.0)


SCAN_KINDS = ("collective-permute", "all-gather", "reduce-scatter", "all-to-all")
def scan_bytes(by: dict, P: int, method: str):
  """Bytes per chip of ``method``'s scans at ``P``: all_scan's permutes; for the others,
  all bytes minus the all_scan step's plus its permutes (the same step but for the scan;
  XLA may lower a gather as an all-reduce of a zero-padded buffer), None without both."""
  if method in ("all_scan", "tree", "all_scan_2level"):     # they scan with permutes only
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
  out = ["# The training step at scale, compiled for v5p without a TPU", "",
         "Question: what does the whole GLA train step send per chip and need in HBM per chip "
         "on v5p slices of 1 to 2048 chips, All-Scan against all_gather (LASP-2), tree and the "
         "two-level All-Scan, and what is the longest context that fits 64 chips? (Compiled "
         "by libtpu, not run: no TPU time is measured.)", "",
         f"`python -m benchmarks.scale_aot run --sweep p` (its two-level points alone: "
         f"`--sweep two_level`), `... run --sweep longest --configs "
         f"gla_340m gla_1b3 gla_7b`, then `... report` (jax "
         f"{jax.__version__}, libtpu 0.0.48.1, a 2-core CPU host shared with other jobs). "
         f"Code: {'; '.join(gits)}. Every row is the trainer's whole train step (forward, "
         "backward, AdamW, bf16 compute, `backend=\"auto\"`: the Mosaic TPU kernels) compiled "
         "by libtpu for the v5p topology of P chips, mesh data = 1 x seq = P, one sequence of "
         "P x tokens-per-chip tokens (`trainer.aot`). Bytes: sent per chip per step, read "
         "from the compiled HLO (`zeco_jax.runtime.hlo_stats`), the most of any chip. Memory: "
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
         "Compiled at 2 layers to fit the compile time (2 layers: 45-90 s each on this host "
         "up to P = 256, 376 s at P = 2048; "
         "the full model 2-8 min). The scan collectives are per layer (the full model sends "
         "12x them); the all-reduce is the gradients' (and from P = 64 all_gather's own "
         "gathers, which XLA lowers as all-reduces). P = 1 is 4 chips as data = 4, one "
         "4096-token sequence each (its all-reduce: the gradients over data).", "",
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
    have = [P for P in Ps if (P, m) in by and P > 1]    # P = 1 sends nothing
    if len(have) >= 2:
      lo, hi = have[0], have[-1]
      b_lo, b_hi = scan_bytes(by, lo, m), scan_bytes(by, hi, m)
      if b_lo is None or b_hi is None:
        continue
      what = ("collective-permute bytes per chip (the All-Scan, forward and reverse)"
              if m == "all_scan" else "collective-permute bytes per chip"
              if m in ("tree", "all_scan_2level") else
              "scan bytes per chip (all bytes minus the all_scan step's, plus its permutes)")
      summary.append(f"- {m}: {what}: {_mib(b_lo)} MiB at P = {lo}, {_mib(b_hi)} MiB at "
                     f"P = {hi}: x{b_hi / b_lo:.3f} (P - 1: x{(hi - 1) / (lo - 1):.2f}).")
  out += ["", *summary]
  out += _two_level_section(by)

  out += ["", "## Longest context that fits v5p HBM (full depth, P = 64)", "",
          f"`run --sweep longest`: per (config, method), the whole model on P = {LONGEST_P} "
          f"chips ({TOPOLOGY[LONGEST_P]}), one sequence; from two points of tokens per chip "
          f"({', '.join(f'{c}: {a} and {b}' for c, (a, b) in LONGEST_BRACKETS.items())}), "
          "each next point is where the line through the two points nearest the crossing of "
          "HBM meets it, until a point that fits sits 4096 tokens per chip below one that "
          "does not (libtpu's own answer: it refuses to compile a program over HBM, "
          "reporting what it would need). gla_7b shards its parameters and optimizer state over "
          "the seq axis (FSDP, `train.sharding_rules.embed=seq`: the data axis is 1); gla_340m "
          "and gla_1b3 replicate them, as their configs do. Per-chip memory depends on the "
          "tokens per chip, not on P, except for all_gather's gathered states (P per layer).",
          "", "| config | P | method | context | tokens per chip | memory GiB | fits | permute "
          "MiB | all-gather MiB | reduce-scatter MiB | all-reduce MiB | permutes with compute "
          "| compile s |", "|" + "---|" * 13]
  fit, over = {}, {}
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
    memory = (_gib(total) if total else
              f"> 95 (libtpu: {_gib(need)} needed)" if need else "> 95")
    out.append(
        f"| {q['config']} | {q['seq']} | {q['method']} | {ctx // 1024}K | "
        f"{q['tokens_per_chip']} | {memory} | "
        f"{'yes' if r.get('fits') else 'NO'} | {_mib(_coll(r, 'collective-permute'))} | "
        f"{_mib(_coll(r, 'all-gather'))} | {_mib(_coll(r, 'reduce-scatter'))} | "
        f"{_mib(_coll(r, 'all-reduce'))} | {ov.get('with_compute', '')} of "
        f"{ov.get('pairs', '')} | {r.get('compile_s', 0):.0f} |")
    k = (q["config"], q["seq"], q["method"])
    if r.get("fits"):
      fit[k] = max(fit.get(k, 0), ctx)
    else:
      over[k] = min(over.get(k, ctx), ctx)
  searched = sorted(set(fit) | set(over))

  def cell(k):
    f, o = fit.get(k), over.get(k)
    if f is None and o is None:
      return "not compiled"
    if f is None:
      return f"none compiled fits (smallest tried: {o // 1024}K)"
    if o is None or o < f:
      return f"{f // 1024}K fits (longer not compiled)"
    if o - f <= STEP * k[1]:
      return f"**{f // 1024}K** ({o // 1024}K does not fit)"
    return f"{f // 1024}K fits, {o // 1024}K does not (between: not compiled)"

  out += ["", "| config | P | all_scan: longest context that fits | all_gather: longest context "
          "that fits |", "|---|---|---|---|"]
  for config, P in sorted({(c, P) for c, P, _ in searched}):
    out.append(f"| {config} | {P} | {cell((config, P, 'all_scan'))} | "
               f"{cell((config, P, 'all_gather'))} |")

  from zeco_jax.sp import scan as scan_lib
  state = 1 << 20
  out += ["", "## Alpha-beta model (v5p ICI figures above) beside the paper's H100 figures",
          "", "One exclusive scan of the paper's 1 MiB state (8K tokens per GPU, d = 4096, "
          "H = 32), ms; the paper's measured All-Scan / all-gather on H100s "
          "(Chou et al., NeurIPS 2025).", "",
          "| P | model all_scan (v5p) | model all_gather (v5p) | model tree (v5p) | model "
          "all_scan_2level (v5p) | paper All-Scan (H100) | paper all-gather (H100) |",
          "|---|---|---|---|---|---|---|"]
  for P in (8, 16, 32, 64, 128, 256, 1024, 4096):
    nb = scan_lib.default_num_blocks(P, state, 128, TPU_ALPHA_S, TPU_BETA_S_PER_BYTE)
    t = {m: scan_lib.predicted_time(P, nb, state, TPU_ALPHA_S, TPU_BETA_S_PER_BYTE, m,
                                    state / 128) * 1e3 for m in METHODS[:3]}
    nb2 = scan_lib.default_num_blocks(P, state, 128, TPU_ALPHA_S, TPU_BETA_S_PER_BYTE,
                                      method="all_scan_2level")
    t["all_scan_2level"] = scan_lib.predicted_time(
        P, nb2, state, TPU_ALPHA_S, TPU_BETA_S_PER_BYTE, "all_scan_2level", state / 128) * 1e3
    pa = PAPER.get(P, ("", ""))
    out.append(f"| {P} | {t['all_scan']:.3f} | {t['all_gather']:.3f} | {t['tree']:.3f} | "
               f"{t['all_scan_2level']:.3f} | {pa[0]} | {pa[1]} |")
  out += ["", "## What it means (read from the compiled programs of this sweep)", "", *NOTES]
  text = "\n".join(out) + "\n"
  harness.write_environment(RESULTS, "scale_aot", devices=False,
                            extra={"point_commits": gits})
  with open(os.path.join(RESULTS, "scale_aot.md"), "w") as fh:
    fh.write(text)
  with open(os.path.join(RESULTS, "scale_aot.json"), "w") as fh:
    json.dump({"rows": rows, "alpha_s": TPU_ALPHA_S, "beta_s_per_byte": TPU_BETA_S_PER_BYTE,
               "longest_context": {"|".join(map(str, k)): {"fits": fit.get(k), "does_not_fit":
                                                       over.get(k)} for k in searched}},
              fh, indent=1)
  print(text)
  _plot(by, Ps, c_rows)


def _plot(by, Ps, c_rows) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for m, mk in zip(METHODS, "osd^"):
    have = [P for P in Ps if P > 1 and scan_bytes(by, P, m) is not None]
    ax1.plot(have, [scan_bytes(by, P, m) / 2**20 for P in have], marker=mk,
             label=f"{m}: its scans")
  have = [P for P in Ps if (P, "all_scan") in by]
  ax1.plot(have, [_coll(by[(P, "all_scan")], "all-reduce") / 2**20 for P in have], "k:",
           label="all_scan step all-reduce: the gradients")
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
  r.add_argument("--sweep", nargs="+", default=["all"],
                 choices=["p", "context", "all", "longest", "two_level"])
  r.add_argument("--configs", nargs="+", default=list(LONGEST_BRACKETS))
  r.add_argument("--methods", nargs="+", default=list(LONGEST_METHODS),
                 choices=LONGEST_METHODS, help="longest: the methods searched")
  r.add_argument("--brackets", nargs=2, type=int, default=None,
                 help="longest: the two tokens-per-chip points to start from (each a "
                      "multiple of STEP), instead of LONGEST_BRACKETS[config]")
  sub.add_parser("report")
  a = ap.parse_args()
  if a.cmd == "run":
    cmd_run(a)
  else:
    cmd_report(load())
