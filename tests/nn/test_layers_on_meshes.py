"""The layers as a user drops them into a model: on a data=2 x seq=4 mesh of Explicit axes
(``jax.make_mesh``'s default, under ``jax.set_mesh``) and of Auto axes (``mesh=`` passed),
with K = V = 64 per head, 64 tokens (one chunk) per shard, the short convolution on and
documents that start and end near the shard boundaries, the All-Scan and the two-level
scan: forward and gradients equal to the same layer on one device (relative norms 1e-5 /
1e-4, float32). The one-device result is computed once per layer and parameters (a
two-level layer has its All-Scan twin's parameters and, on one device, its function).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import rel_err
from zeco_jax.nn import GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention

pytestmark = pytest.mark.usefixtures("compile_cache")

B, T, D = 2, 256, 128
# Row 0: documents starting 2 tokens after a shard boundary, 1 token before one, and
# padding at the end; row 1: one document over every shard.
IDS = np.array([[0] * 66 + [1] * 61 + [2] * 100 + [-1] * 29, [7] * T], np.int32)


def _layers():
  return {"gla": GatedLinearAttention(D, 2, expand_k=0.5, use_short_conv=True,
                                      rngs=nnx.Rngs(0)),
          "gla_k64": GatedLinearAttention(D, 2, expand_k=1.0, rngs=nnx.Rngs(0)),
          "gdn": GatedDeltaNet(D, 2, head_dim=64, expand_v=1.0, rngs=nnx.Rngs(0)),
          # The two-level scan in groups of 2 of the 4 seq shards (a group's last rank
          # spreads the state entering it to the other).
          "gla_2level": GatedLinearAttention(D, 2, expand_k=0.5, use_short_conv=True,
                                             seq_method="all_scan_2level", group_size=2,
                                             rngs=nnx.Rngs(0)),
          "gdn_2level": GatedDeltaNet(D, 2, head_dim=64, expand_v=1.0,
                                      seq_method="all_scan_2level", group_size=2,
                                      rngs=nnx.Rngs(0)),
          "kda": KimiDeltaAttention(D, 2, head_dim=64, expand_v=1.0, rngs=nnx.Rngs(0))}


# On one device the two-level layers are their All-Scan twins (the same parameters).
_ONE_DEVICE_TWIN = {"gla_2level": "gla", "gdn_2level": "gdn"}


@functools.lru_cache(maxsize=None)
def _one_device(name):
  """The layer's forward and gradients on one device (no mesh), for the inputs below."""
  layer = _layers()[name]
  return _loss_and_grads(layer, _x(), jnp.asarray(IDS))


def _x():
  return jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)


def _loss_and_grads(layer, x, ids, mesh=None):
  graphdef, params = nnx.split(layer)

  def loss(params, x):
    y = nnx.merge(graphdef, params)(x, mesh=mesh, segment_ids=ids)
    return jnp.sum(jnp.sin(y)), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
  return y, grads


@pytest.mark.parametrize("name,axes", [
    (name, axes) for name in ("gla", "gdn") for axes in ("explicit", "auto")]
    + [("gla_k64", "explicit"), ("gla_2level", "auto"), ("gdn_2level", "explicit"),
       ("kda", "explicit")])
def test_layer_on_a_mesh_equals_one_device(name, axes, devices):
  layers = _layers()
  layer = layers[name]
  x = _x()
  ids = jnp.asarray(IDS)
  twin = _ONE_DEVICE_TWIN.get(name, name)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                   nnx.state(layer), nnx.state(layers[twin])))
  y_one, grads_one = _one_device(twin)
  if axes == "explicit":
    mesh = jax.make_mesh((2, 4), ("data", "seq"))
    with jax.set_mesh(mesh):
      x_m = jax.device_put(x, NamedSharding(mesh, P("data", "seq")))
      ids_m = jax.device_put(ids, NamedSharding(mesh, P("data", "seq")))
      forward = nnx.jit(lambda layer, x, ids: layer(x, segment_ids=ids))(layer, x_m, ids_m)
      y, grads = _loss_and_grads(layer, x_m, ids_m)
  else:
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "seq"))
    forward = nnx.jit(lambda layer, x, ids: layer(x, mesh=mesh, segment_ids=ids))(layer, x, ids)
    y, grads = _loss_and_grads(layer, x, ids, mesh)
  assert rel_err(forward, y_one) <= 1e-5
  assert rel_err(y, y_one) <= 1e-5
  for g, g_one in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_one)):
    assert rel_err(g, g_one) <= 1e-4
