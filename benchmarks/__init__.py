"""Measurements of zeco-jax: one harness (:mod:`benchmarks._harness`), one script per question.

Run from the repository root as ``python -m benchmarks.NAME [flags]`` (the package is not
installed; it imports ``zeco_jax``, ``pallas_kernels``, ``models``, ``configs`` and
``trainer`` from the checkout). Every script writes an environment record
(``NAME.env.json``: versions, device, commit, date, command) beside its output; raw output
goes to ``--out`` / ``$OUT`` (default ``runs/benchmarks/NAME``, ignored by git), and the
curated summary of each question lives in ``benchmarks/results/<topic>.md`` (index:
``benchmarks/results/README.md``; history: ``docs/results.md``).

Kernels and ops (one GPU unless said):

* ``kernels``: ``chunk_gla`` forward and forward + backward, the Pallas kernels beside the
  jnp chunk path and FLA's ``chunk_gla``; peak memory; GPU correctness checks; each kernel
  alone (``--stages``). An H200; torch + FLA for FLA's figures; ``--smoke`` runs anywhere.
  -> results/kernels_h200.md
* ``segments_cost``: ``segment_ids`` (packed documents): GPU checks of the compiled kernels
  against the jnp path and a float64 per-document loop, and what the documents cost.
  ``--smoke`` anywhere. -> results/segments_cost.md
* ``decay_range``: accuracy under log-decays down to -1e4 in one chunk against the float64
  loop: our jnp path (any CPU), our Pallas kernels and FLA's ``chunk_gla`` /
  ``chunk_simple_gla`` (a GPU with FLA). -> results/decay_range.md
* ``delta_h200``: the delta-rule families, our ``chunk_gated_delta_rule`` (``--family gdn``)
  or ``chunk_kda`` (``--family kda``) against FLA's: time and agreement (torch + FLA;
  ``--no-fla`` without). -> results/gdn_h200.md, results/kda_h200.md
* ``ptx_stats``: what the delta-rule kernels compile to for sm_90 (registers, spills,
  barriers), on a CPU-only host: lowers for an abstract H200, then compiles with pip
  ``triton`` (a second process). No timing. -> results/ptx_sm90.md

Training step (one GPU):

* ``train_gla340m``: the GLA-340M step, tokens/s, ms/step, peak memory, MFU and losses, ours
  beside FLA's ``GLAForCausalLM`` (torch + FLA for its runs). -> results/train_gla340m_h200.md
* ``fla_gla340m``: FLA's model on the token stream ``train_gla340m`` writes (its child).
* ``profile_step``: a ``jax.profiler`` trace summarised by kernel and category
  (``train_gla340m --profile``; also a command on a trace folder, any machine).
  -> results/profile_gla340m_h200.md

Generation (one GPU):

* ``generate``: GLA-340M prefill time and decode tokens/s at several batch sizes, ours
  (``models.generation.generate``) beside FLA's model with Hugging Face ``generate``
  (torch + FLA for its side). -> results/generate_h200.md

Communication and overlap:

* ``comm_volume``: bytes per rank of every scan method, read from the compiled HLO, beside
  the alpha-beta model. Any CPU (simulated devices). -> results/comm_volume.md
* ``gpu_overlap``: ``local``, what splitting the local pass in head groups costs (one GPU);
  ``schedule``, where XLA's GPU scheduler puts the All-Scan's sends (several GPUs, or
  ``--mock`` on one). -> results/gpu_overlap.md
* ``multi_gpu``: All-Scan against its peers on real GPUs: the collective alone, ``zeco_gla``
  forward + backward, the compiled schedule. 2+ GPUs; not run yet.

TPU, compiled without a TPU (a CPU host with libtpu: ``pip install -e '.[train,tpu]'``):

* ``tpu_aot_kernels``: the Mosaic kernels compiled for v5e, v5p, v6e: compile, custom calls,
  HBM. -> results/tpu_aot_kernels.md
* ``tpu_schedule``: where libtpu's scheduler puts the All-Scan's sends around the kernels at
  seq = 8. -> results/tpu_schedule.md
* ``scale_aot``: the whole train step for v5p slices of 1 to 2048 chips: bytes and memory
  per chip, overlap, the longest context that fits (hours; up to 30 GB of host memory per
  point). -> results/scale_aot.md

Training runs whose curves are in ``benchmarks/results`` (tiny MQAR, Gated DeltaNet MQAR,
cross-document MQAR, real text) come from ``python train.py``; their commands are in the
result files.
"""
