"""Mixed per-token log-decays in [-1e4, 0] inside one chunk, in chunk_gla's jnp path,
chunk_gla_reference (autodiff) and zeco_gla (jnp path) on 4 simulated devices with every
scan method.

The first reported input (q, k, v ~ N(0, 1), g = -0.05 with spikes of -1e4, -100 or -10
every 7th token) and random mixes (a fraction of tokens at -1e4, some in [-300, -10], the
rest log-uniform in [-5, -1e-3]), scalar ``[B, T, H]`` and per-dim ``[B, T, H, K]`` g,
against ``gla_float64`` (the float64 token loop in numpy and its hand-written vjp: no x64
mode needed), through ``helpers.check_decay_range``. Bars: forward (o, final state) <= 1e-5
and gradients of q, k, v, g, h0 <= 1e-4, relative norm, float32. With exponents formed as
differences of chunk cumsums the -1e4 inputs were ~2e-3 off on every output, the -100
ones ~2e-5. One jitted vjp per (op, shapes), reused across decay patterns, keeps the file
fast. The same check of the TPU kernels is in tests/kernels/test_gla_kernel_decay_range.py.
"""
import functools

import pytest

from helpers import DECAY_KINDS, check_decay_range, seq_mesh
from zeco_jax import chunk_gla, chunk_gla_reference, zeco_gla

JAX_OP = functools.partial(chunk_gla, backend="jax")


@pytest.mark.parametrize("kind", DECAY_KINDS)
@pytest.mark.parametrize("shape,per_dim", [("reported", False), ("reported", True), ("multi", True)],
                         ids=["reported-scalar", "reported-per_dim", "multi-per_dim"])
def test_jnp_path(shape, per_dim, kind):
  check_decay_range(JAX_OP, shape, kind, per_dim)


@pytest.mark.parametrize("kind", [-1e4, "mix"])
def test_jnp_path_without_states(kind):
  check_decay_range(JAX_OP, "multi", kind, False, with_state=False)


@pytest.mark.parametrize("kind,per_dim", [(-1e4, False), ("mix", True)])
def test_chunked_reference(kind, per_dim):
  """chunk_gla_reference, the exact chunked form the fast paths are specified by."""
  check_decay_range(chunk_gla_reference, "reported", kind, per_dim)


_ZECO = {}


def zeco_op(method):
  if method not in _ZECO:
    _ZECO[method] = functools.partial(zeco_gla, mesh=seq_mesh(4), method=method, chunk_size=32,
                                      backend="jax")
  return _ZECO[method]


@pytest.mark.parametrize("method", ["all_scan", "all_gather", "tree", "ring"])
def test_zeco_gla_four_devices(method):
  op = zeco_op(method)
  check_decay_range(op, "reported", "mix", True)
  check_decay_range(op, "reported", -1e4, True)
