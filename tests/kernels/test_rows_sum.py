"""pallas_kernels._scan.rows_sum: sums along a tile's rows, forward or reverse, inclusive or
exclusive, against float64 sums of exactly the elements each output names; its Triton
lowering rule registered, and lowering for an H200 on this CPU host.

Tolerance: relative to the float64 sum of the absolute values each output adds up
(<= 1e-6, float32 rounding of up to 64 terms). The tile has a -1e4 element beside small
ones, so an exclusive sum formed as an inclusive one less the element loses the small
ones' digits: that form misses the bound by 9x going forward and 32x going back.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import abstract_mesh

pytest.importorskip("pallas_kernels")
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402
from pallas_kernels._scan import rows_sum, triton_rule_registered  # noqa: E402

MODES = [(False, False), (True, False), (False, True), (True, True)]
IDS = ["inclusive", "reverse", "exclusive", "reverse_exclusive"]


def _kernel(reverse, exclusive):
  def kernel(x_ref, o_ref):
    o_ref[...] = rows_sum(x_ref[...], reverse=reverse, exclusive=exclusive)
  return kernel


def _truth(x, reverse, exclusive):
  """(sums, sums of absolute values) in float64 over the rows each output names."""
  x = np.asarray(x, np.float64)
  n = x.shape[0]
  names = lambda i: [m for m in range(n) if (m >= i if reverse else m <= i)
                     and not (exclusive and m == i)]
  return (np.stack([x[names(i)].sum(0) for i in range(n)]),
          np.stack([np.abs(x[names(i)]).sum(0) for i in range(n)]))


@pytest.mark.parametrize("reverse,exclusive", MODES, ids=IDS)
def test_rows_sum_sums_exactly_the_named_rows(reverse, exclusive):
  x = -jax.random.uniform(jax.random.PRNGKey(0), (64, 16), minval=0.0, maxval=5.0)
  x = x.at[37, :].set(-1e4)
  want, scale = _truth(x, reverse, exclusive)
  interpreted = pl.pallas_call(_kernel(reverse, exclusive), interpret=True,
                               out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  jitted = jax.jit(lambda x: rows_sum(x, reverse=reverse, exclusive=exclusive))(x)
  for got in (interpreted, jitted):
    err = np.abs(np.asarray(got, np.float64) - want) / np.maximum(scale, 1e-30)
    assert err.max() <= 1e-6, err.max()
  # the empty sums are zero: the first row going forward, the last going back
  edge = np.asarray(interpreted)[-1 if reverse else 0]
  assert np.all(edge == 0.0) if exclusive else np.all(edge != 0.0)


def test_rows_sum_rejects_what_it_cannot_sum():
  with pytest.raises(ValueError, match=r"`x` must be a 2-D tile, got shape \(4, 4, 4\)"):
    rows_sum(jnp.zeros((4, 4, 4)))
  with pytest.raises(ValueError, match="`x` must be a floating-point tile, got int32"):
    rows_sum(jnp.zeros((4, 4), jnp.int32))


@pytest.mark.parametrize("reverse,exclusive", MODES, ids=IDS)
def test_rows_sum_lowers_to_one_triton_scan(reverse, exclusive, capsys):
  """The Triton rule is registered (a JAX upgrade that moves the private lowering table
  fails here) and lowers to one ``tt.scan`` in the asked direction, with one operand, or
  two for an exclusive sum (Triton IR for an abstract H200, printed by ``debug=True``)."""
  assert triton_rule_registered()
  mesh = abstract_mesh("gpu", "NVIDIA H200", 132)
  sd = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  call = pl.pallas_call(_kernel(reverse, exclusive), out_shape=sd, debug=True,
                        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))
  with jax.sharding.use_abstract_mesh(mesh):
    jax.jit(call).trace(sd).lower(lowering_platforms=("cuda",))
  ir = capsys.readouterr().out.split("The Triton module")[-1]
  scans = [line for line in ir.splitlines() if '"tt.scan"' in line or "tt.scan(" in line]
  assert len(scans) == 1, scans
  assert ("reverse = true" in ir) == reverse
  assert ir.count("tt.scan.return") == 1
  returned = ir.split("tt.scan.return")[1].split(":")[0]       # " %46, %47 "
  assert returned.count("%") == (2 if exclusive else 1), returned
