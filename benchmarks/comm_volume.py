"""Bytes each rank sends, per method, read from compiled HLO; beside the alpha-beta model.

    python -m benchmarks.comm_volume [--max-devices 32] [--out benchmarks/results]

Any machine (simulated CPU devices, a few CPU-minutes). Compiles jit(grad(zeco_gla)) and
jit(grad(zeco_gated_delta_rule)) (forward + backward) and the forwards alone for
P = 2 .. max-devices (and jit(grad(zeco_kda))), and one softmax attention layer (``sp_attention``, every method of
ATTENTION_METHODS, P = 2 .. 8, hybrid_340m's attention shape), counts the collective bytes
per rank in the HLO
(zeco_jax.runtime.hlo_stats), and prints them in units of one state M, for every method of
zeco_jax.sp.scan.SCAN_METHODS. Then prints the alpha-beta model's prediction (docs/design.md
§6) of one exclusive scan of the paper's 1 MiB state for P up to 256, next to the paper's
measured All-Scan / all-gather times (H100, 8K tokens per GPU, d = 4096, H = 32). Writes
comm_volume.md, comm_volume.png and comm_volume.env.json to --out.
"""
from __future__ import annotations

import argparse
import os

from benchmarks import _harness as harness


# Softmax attention (hybrid models): hybrid_340m's attention block, bf16.
ATTN_SHAPE = dict(B=1, T=16384, H=8, Hkv=2, D=128)


def attention_bytes(P: int, method: str, shape=ATTN_SHAPE):
  """(forward, forward + backward) bytes the busiest rank sends in one attention layer,
  from the compiled HLO of ``sp_attention`` on ``P`` simulated devices."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  from zeco_jax.ops.attention.parallel import sp_attention
  from zeco_jax.runtime.hlo_stats import collective_bytes
  B, T, H, Hkv, D = (shape[n] for n in ("B", "T", "H", "Hkv", "D"))
  mesh = Mesh(np.array(jax.devices()[:P]), ("seq",))
  # float32: XLA:CPU widens bf16 collectives to float32, which would double the bytes (a
  # TPU compile keeps them bf16: hybrid_340m's all-to-all on v5p is the bf16 model's).
  sds = lambda h: jax.ShapeDtypeStruct((B, T, h, D), jnp.float32)
  args = (sds(H), sds(Hkv), sds(Hkv), jax.ShapeDtypeStruct((B, T), jnp.int32))
  op = lambda q, k, v, ids: sp_attention(q, k, v, mesh=mesh, method=method, segment_ids=ids)
  loss = lambda q, k, v, ids: jnp.sum(op(q, k, v, ids).astype(jnp.float32))
  out = []
  for fn in (op, jax.grad(loss, (0, 1, 2))):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    out.append(float(sum(np.asarray(x)[:P] for x in collective_bytes(hlo, P).values()).max()))
  return tuple(out)


def executed_folds(P: int, method: str, T: int = 256, H: int = 2, D: int = 8):
  """Key blocks each rank folds in a causal ``sp_attention`` forward (the blocks that
  ``lax.cond`` does not skip), counted at run time on ``P`` simulated devices: a list of P
  counts. Every fold costs the same FLOPs (a [c, c] block of scores and outputs)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import Mesh

  from zeco_jax.ops.attention import blockwise, parallel
  counts = np.zeros(P, np.int64)

  def record(rank, run):
    counts[int(rank)] += int(run)

  def counted(stats, qg, k, v, q_doc, q_pos, k_doc, k_pos, **kw):
    run = blockwise.block_visible(q_pos[0, 0], q_pos[0, -1], k_pos[0, 0], k_pos[0, -1],
                                  causal=kw["causal"], window=kw["window"])
    jax.debug.callback(record, lax.axis_index("seq"), run, ordered=False)
    return blockwise.fold_if_visible(stats, qg, k, v, q_doc, q_pos, k_doc, k_pos, **kw)

  mesh = Mesh(np.array(jax.devices()[:P]), ("seq",))
  x = jnp.ones((1, T, H, D), jnp.float32)
  original = parallel.fold_if_visible
  parallel.fold_if_visible = counted
  try:
    jax.block_until_ready(parallel.sp_attention(x, x, x, mesh=mesh, method=method))
    jax.effects_barrier()
  finally:
    parallel.fold_if_visible = original
  return [int(c) for c in counts]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--max-devices", type=int, default=32)
  ap.add_argument("--out", default=harness.RESULTS)
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.max_devices}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import zeco_jax
  from zeco_jax.sp import scan as scan_lib
  from zeco_jax.runtime.hlo_stats import collective_bytes

  B, H, K, V, C = 1, 2, 16, 32, 16
  M = B * H * K * V * 4
  methods = scan_lib.method_names()
  Ps = [p for p in (2, 4, 8, 16, 32, 64) if p <= args.max_devices]
  measured = {}
  for P in Ps:
    mesh = Mesh(np.array(jax.devices()[:P]), ("seq",))
    T = C * P
    shapes = [jax.ShapeDtypeStruct((B, T, H, d), jnp.float32) for d in (K, K, V, K)]
    for method in methods:
      op = lambda q, k, v, g: zeco_jax.zeco_gla(q, k, v, g, mesh=mesh, method=method,
                                                num_blocks=4, chunk_size=C)[0]
      fwd = jax.jit(op).lower(*shapes).compile().as_text()
      both = jax.jit(jax.grad(lambda *a: jnp.sum(op(*a)), (0, 1, 2, 3))).lower(*shapes)
      both = both.compile().as_text()
      f = sum(collective_bytes(fwd, P).values()).max() / M
      fb = sum(collective_bytes(both, P).values()).max() / M
      measured[(P, method)] = (f, fb)
      # The delta-rule families (docs/design.md §9, §13): the same state, a K x K
      # transition; Gated DeltaNet's decay per head, KDA's per key channel.
      for family, op_fn, g_dims in (("gdn", zeco_jax.zeco_gated_delta_rule, ()),
                                    ("kda", zeco_jax.zeco_kda, (K,))):
        delta_shapes = shapes[:3] + [jax.ShapeDtypeStruct((B, T, H, *g_dims), jnp.float32),
                                     jax.ShapeDtypeStruct((B, T, H), jnp.float32)]
        delta = lambda q, k, v, g, beta, op_fn=op_fn: op_fn(
            q, k, v, g, beta, mesh=mesh, method=method, num_blocks=4, chunk_size=C)[0]
        fwd = jax.jit(delta).lower(*delta_shapes).compile().as_text()
        both = jax.jit(jax.grad(lambda *a, delta=delta: jnp.sum(delta(*a)), (0, 1, 2, 3, 4)))
        both = both.lower(*delta_shapes).compile().as_text()
        measured[(P, f"{family} {method}")] = (
            sum(collective_bytes(fwd, P).values()).max() / M,
            sum(collective_bytes(both, P).values()).max() / M)

  # Softmax attention (hybrid models), P = 2 .. 8, and the fold counts of the causal work.
  from zeco_jax.ops.attention.parallel import ATTENTION_METHODS
  attn_Ps = [p for p in (2, 4, 8) if p <= args.max_devices]
  attn = {(P, m): attention_bytes(P, m) for P in attn_Ps for m in ATTENTION_METHODS}
  folds = {m: executed_folds(max(attn_Ps), m) for m in ("all_gather", "ring")}

  env = harness.environment()
  lines = ["# Communication volume per rank, from compiled HLO", "",
           "Question: how many bytes does each rank send per method and device count, forward "
           "and forward + backward, and what does the alpha-beta model predict?", "",
           "Command: `python -m benchmarks.comm_volume --max-devices "
           f"{args.max_devices}` ({harness.env_line(env)}; simulated CPU devices: bytes are "
           "read from the compiled program, so they hold on any backend).", "",
           "Max bytes sent by any rank, in states M (M = B*H*K*V*4 bytes; the decay adds K/V "
           "of a state for tree and all_gather):", "",
           "| P | " + " | ".join(f"{m} fwd | {m} fwd+bwd" for m in methods) + " |",
           "|---|" + "---|" * (2 * len(methods))]
  for P in Ps:
    cells = [f"{measured[(P, m)][0]:.2f} | {measured[(P, m)][1]:.2f}" for m in methods]
    lines.append(f"| {P} | " + " | ".join(cells) + " |")
  lines += ["", "Gated DeltaNet (`zeco_gated_delta_rule`, docs/design.md §9), same state; its "
            f"transition is a K x K matrix (K^2/(K V) = {K / V:.2f} of a state), which "
            "all_gather and tree send, and all_scan_2level along each group (its prefix "
            "transitions):", "",
            "| P | " + " | ".join(f"{m} fwd | {m} fwd+bwd" for m in methods) + " |",
            "|---|" + "---|" * (2 * len(methods))]
  for P in Ps:
    cells = [f"{measured[(P, 'gdn ' + m)][0]:.2f} | {measured[(P, 'gdn ' + m)][1]:.2f}"
             for m in methods]
    lines.append(f"| {P} | " + " | ".join(cells) + " |")
  lines += ["", "Kimi Delta Attention (`zeco_kda`, docs/design.md §13), same state; its "
            "transition is a K x K matrix too (its decay per key channel changes what the "
            "local pass computes, not what is sent):", "",
            "| P | " + " | ".join(f"{m} fwd | {m} fwd+bwd" for m in methods) + " |",
            "|---|" + "---|" * (2 * len(methods))]
  for P in Ps:
    cells = [f"{measured[(P, 'kda ' + m)][0]:.2f} | {measured[(P, 'kda ' + m)][1]:.2f}"
             for m in methods]
    lines.append(f"| {P} | " + " | ".join(cells) + " |")

  sh = ATTN_SHAPE
  gla_M = 1 * 4 * 128 * 256 * 4      # gla_340m's GLA layer: B1, 4 heads, K 128, V 256, float32
  MiB = 2 ** 20
  lines += ["", "Softmax attention over the same seq axis (`sp_attention`, hybrid models; "
            "docs/design.md §12), one layer at hybrid_340m's attention shape (B "
            f"{sh['B']}, T {sh['T']}, {sh['H']} query heads, {sh['Hkv']} key / value heads of "
            f"{sh['D']}, float32, with segment_ids), MiB the busiest rank sends, forward and "
            "forward + backward, the forward's model (`ATTENTION_METHODS[m].bytes_per_rank`) "
            "in brackets; bf16 moves half (XLA:CPU widens bf16 collectives to float32, so they "
            "are measured in float32; on v5p, hybrid_340m's bf16 all-to-all is the bf16 "
            "model's: configs/hybrid_340m.py); beside it, the All-Scan of one of the same "
            "model's GLA layers (a "
            f"{gla_M / MiB:.2f} MiB state, two scans forward + backward, flat in P):", "",
            "| P | " + " | ".join(f"{m} fwd (model) | {m} fwd+bwd" for m in ATTENTION_METHODS)
            + " | GLA layer all_scan fwd+bwd |",
            "|---|" + "---|" * (2 * len(ATTENTION_METHODS) + 1)]
  for P in attn_Ps:
    cells = []
    for m, spec in ATTENTION_METHODS.items():
      f, fb = attn[(P, m)]
      want = spec.bytes_per_rank(P, sh["B"], sh["T"], sh["H"], sh["Hkv"], sh["D"], 4)
      cells.append(f"{f / MiB:.2f} ({want / MiB:.2f}) | {fb / MiB:.2f}")
    lines.append(f"| {P} | " + " | ".join(cells) + f" | {2 * gla_M / MiB:.2f} |")
  hiP = max(attn_Ps)
  lines += ["", f"Causal work per rank at P = {hiP} (key blocks folded, counted at run time; "
            "every block the same FLOPs; `benchmarks.comm_volume.executed_folds`): "
            f"all_gather (zigzag) {folds['all_gather']}, ring (contiguous) {folds['ring']}; "
            "Ulysses: every rank all T on H / P heads."]

  state = 1 << 20   # the paper's state: d=4096, H=32, head dim 128, bf16 = 1 MiB per layer
  alpha, beta = scan_lib.DEFAULT_ALPHA_S, scan_lib.DEFAULT_BETA_S_PER_BYTE
  paper = {8: (0.226, 0.375), 256: (2.165, 8.514)}
  model_Ps = [2, 4, 8, 16, 32, 64, 128, 256]
  lines += ["", f"Alpha-beta model of one scan of a 1 MiB state (alpha = {alpha * 1e6:.0f} us, "
            f"1/beta = {1 / beta / 1e9:.0f} GB/s; docs/design.md §6), ms, with the paper's "
            "measured H100 times (All-Scan / all-gather):", "",
            "| P | all_scan nb* | " + " | ".join(methods) + " | paper All-Scan | "
            "paper all-gather |", "|---|---|" + "---|" * (len(methods) + 2)]
  model = {}
  for P in model_Ps:
    nb = scan_lib.default_num_blocks(P, state, 128)
    row = {m: scan_lib.predicted_time(P, nb, state, alpha, beta, m) * 1e3 for m in methods}
    model[P] = row
    pa = paper.get(P, ("", ""))
    lines.append(f"| {P} | {nb} | " + " | ".join(f"{row[m]:.3f}" for m in methods)
                 + f" | {pa[0]} | {pa[1]} |")
  hi = Ps[-1]
  worst = lambda m: max(measured[(P, m)][1] for P in Ps if P > 2)
  lines += ["", "What it means:", "",
            f"- All-Scan sends at most "
            f"{max(worst(f + 'all_scan') for f in ('', 'gdn ', 'kda ')):.2f} states per rank "
            "forward + "
            f"backward at every P from 4 to {hi} (one in the forward scan, one in the reverse "
            "scan), for GLA, Gated DeltaNet and KDA alike: its bytes do not grow with P.",
            f"- all_gather (LASP-2) sends {measured[(hi, 'all_gather')][1]:.2f} states per rank "
            f"at P = {hi} (2 (P - 1), plus the decays), Gated DeltaNet's "
            f"{measured[(hi, 'gdn all_gather')][1]:.2f} (its K x K transitions too); tree "
            f"{measured[(hi, 'tree')][1]:.2f} (about 2 log2 P); ring is All-Scan's bytes "
            "without the overlap.",
            "- all_scan_2level (groups of G ranks by the model: "
            + ", ".join(f"G = {scan_lib.default_group_size(P, M)} at P = {P}" for P in Ps)
            + "; G = 1 is the All-Scan itself) sends at most "
            f"{max(measured[(P, 'all_scan_2level')][0] for P in Ps):.2f} states per rank "
            f"forward and {worst('all_scan_2level'):.2f} forward + backward (a middle group's "
            "last rank sends two states in its scan; the reverse scan's groups are cut from "
            "the other end, so that rank is mostly a member there), flat in P; Gated "
            "DeltaNet's "
            f"{max(measured[(P, 'gdn all_scan_2level')][1] for P in Ps):.2f} (a K x K "
            "prefix transition per member). Its point is latency (about 2 sqrt(P) hops "
            "instead of P): benchmarks/results/scale_aot.md compiles it for up to 2048 chips.",
            "- The model's times are a prediction from bytes and hops, not a measurement; the "
            "paper's H100 columns are its published figures.",
            f"- A softmax layer moves far more than a linear one: at P = {hiP} Ulysses sends "
            f"(float32) {attn[(hiP, 'ulysses')][1] / MiB:.1f} MiB per rank forward + backward "
            "(falling as 1/P, until the key heads are repeated up to P), all_gather "
            f"{attn[(hiP, 'all_gather')][1] / MiB:.1f} and ring {attn[(hiP, 'ring')][1] / MiB:.1f} "
            f"(growing as (P - 1) / P of K and V), against {2 * gla_M / MiB:.2f} MiB for a GLA "
            "layer's All-Scan. The zigzag all_gather gives every rank the same "
            f"{folds['all_gather'][0]} blocks "
            f"({max(folds['all_gather']) / min(folds['all_gather']):.2f}x max / min); the ring's "
            f"contiguous split {max(folds['ring']) / min(folds['ring']):.0f}x."]
  text = "\n".join(lines) + "\n"
  print(text)
  harness.write_environment(args.out, "comm_volume")
  with open(os.path.join(args.out, "comm_volume.md"), "w") as fh:
    fh.write(text)

  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for m, mk in zip(methods, "osd^"):
    ax1.plot(Ps, [measured[(P, m)][1] for P in Ps], marker=mk, label=f"{m} (HLO, fwd+bwd)")
    ax1.plot(Ps, [measured[(P, "gdn " + m)][1] for P in Ps], marker=mk, ls="--",
             label=f"GDN {m} (HLO, fwd+bwd)")
  ax1.plot(model_Ps, [2 * scan_lib.bytes_sent_per_rank(P, 1, "all_gather") for P in model_Ps],
           "k:", label="model all_gather 2(P-1)")
  ax1.plot(model_Ps, [2.0] * len(model_Ps), "k--", label="model All-Scan 2")
  ax1.set(xscale="log", yscale="log", xlabel="devices P", ylabel="states sent per rank",
          title="Bytes per rank (forward + backward)")
  ax1.legend(fontsize=7)
  for m, mk in zip(methods, "osd^"):
    ax2.plot(model_Ps, [model[P][m] for P in model_Ps], marker=mk, label=f"model {m}")
  ax2.scatter(list(paper), [v[0] for v in paper.values()], c="k", marker="*", s=90,
              label="paper All-Scan (H100)", zorder=5)
  ax2.scatter(list(paper), [v[1] for v in paper.values()], c="r", marker="x", s=60,
              label="paper all-gather (H100)", zorder=5)
  ax2.set(xscale="log", yscale="log", xlabel="devices P", ylabel="ms per scan (1 MiB state)",
          title="Alpha-beta model vs paper")
  ax2.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "comm_volume.png"), dpi=110)
  print("wrote", os.path.join(args.out, "comm_volume.png"))


if __name__ == "__main__":
  main()
