"""Running on real machines: which platform a computation is compiled for (``target``),
several processes (``distributed``: initialisation, the process-local pieces of a global
batch; ``launch``: a local launcher, ``python -m zeco_jax.runtime.launch``) and what a
compiled program communicates (``hlo_stats``). No op maths here."""
