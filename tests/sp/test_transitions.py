"""The transitions the scan composes (zeco_jax.sp.transitions): for every kind (identity,
per-head and per-dim decay, a dense K x K matrix), compose, transpose and cotangent agree
with the maps, and a block of V columns is mapped on its own."""
import jax
import jax.numpy as jnp
import numpy as np

from zeco_jax.sp.transitions import DenseTransition, DiagonalDecay, Identity, ScalarDecay

B, H, K, V = 2, 2, 4, 8


def test_transition_algebra():
  # What the collective relies on: compose, transpose and cotangent agree with the maps.
  r = np.random.default_rng(1)
  X, E = (jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32) for _ in range(2))
  kinds = [Identity(), ScalarDecay(jnp.asarray(r.uniform(0.3, 1, (B, H)), jnp.float32)),
           DiagonalDecay(jnp.asarray(r.uniform(0.3, 1, (B, H, K)), jnp.float32)),
           DenseTransition(jnp.asarray(r.standard_normal((B, H, K, K)), jnp.float32))]
  for A in kinds:
    A2 = jax.tree.map(lambda x: x * 0.5 + 0.1, A)
    np.testing.assert_allclose(A2.compose(A).apply(X), A2.apply(A.apply(X)), rtol=1e-5,
                               atol=1e-5)
    # <E, A X> = <A^T E, X>, and the cotangent is the gradient of <E, A X> in A's arrays.
    np.testing.assert_allclose(jnp.sum(E * A.apply(X)), jnp.sum(A.transpose().apply(E) * X),
                               rtol=1e-5)
    want = jax.grad(lambda A: jnp.sum(E * A.apply(X)))(A)
    for got_leaf, want_leaf in zip(jax.tree.leaves(A.cotangent(X, E)), jax.tree.leaves(want)):
      np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-5)
    # A block of V columns is mapped on its own (what lets the All-Scan split along V).
    np.testing.assert_allclose(A.apply(X[..., :3]), A.apply(X)[..., :3], rtol=1e-6,
                               atol=1e-6)
