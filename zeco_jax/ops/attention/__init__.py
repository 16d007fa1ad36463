"""Softmax attention over the same sequence mesh as the linear families (hybrid models):
``reference`` (the masked softmax in plain jnp and the float64 truth), ``blockwise`` (the
XLA form: key blocks folded into an online softmax), ``op`` (one device: ``attention`` and
its backends, XLA, cuDNN on GPU, splash on TPU) and ``parallel`` (``sp_attention`` /
``sp_attention_local`` and the method registry ``ATTENTION_METHODS``: Ulysses, all-gather
of K / V with a zigzag query layout, ring)."""
