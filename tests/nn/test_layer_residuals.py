"""What a layer's backward keeps per token: the bf16 projections and the op's own
residuals, no float32 copies of the norms, gates and short convolutions (those are
recomputed under ``jax.checkpoint``: ``zeco_jax.nn.common.gated_output``,
``ShortConvolution``, ``zeco_jax._linalg.l2norm``). Shapes only (``jax.eval_shape`` of
``jax.vjp``): nothing runs."""
import jax
import jax.numpy as jnp
from flax import nnx

from zeco_jax.nn import GatedDeltaNet, KimiDeltaAttention

B, T, D = 1, 64, 64


def _float32_per_token(layer):
  graphdef, state = nnx.split(layer)
  f = lambda state, x: nnx.merge(graphdef, state)(x)
  x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16)
  vjp_fn = jax.eval_shape(lambda state, x: jax.vjp(f, state, x)[1], state, x)
  return [leaf.shape for leaf in jax.tree.leaves(vjp_fn)
          if leaf.dtype == jnp.float32 and leaf.ndim == 4 and leaf.shape[:2] == (B, T)]


def test_gated_deltanet_keeps_no_float32_per_token_and_channel():
  # [B, T, H, D] float32 arrays: before the recomputation, 7 (the output norm and gate)
  # and 2 (l2norm's float32 q and k); g and beta [B, T, H] are the op's float32 inputs.
  layer = GatedDeltaNet(D, 2, head_dim=32, expand_v=2.0, rngs=nnx.Rngs(0))
  assert _float32_per_token(layer) == []


def test_kda_keeps_only_its_float32_log_decay_per_token():
  # The op keeps its float32 log-decay g [B, T, H, K]; before the recomputation the gate
  # projection, the output norm and the sigmoid gate kept 6 more float32 copies.
  layer = KimiDeltaAttention(D, 2, head_dim=32, rngs=nnx.Rngs(0))
  assert _float32_per_token(layer) == [(B, T, 2, 32)]
