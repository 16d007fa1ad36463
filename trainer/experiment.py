"""Everything compiled for one (model, optimizer, mesh, batch shape): :class:`Experiment`.

It derives the parameter and optimizer-state shardings from the logical-axis rule table
(``models/sharding.py``), builds the optimizer (AdamW, warmup + cosine decay, gradient
clipping) and jits the module-level programs of :mod:`trainer.steps` with explicit in/out
shardings: ``train_step``, ``eval_step`` and ``loss_and_grad``. Batches have B over
``data`` and T over ``seq``. Built once per run, reused for every step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from models import data as datamod
from models import model_from_config, sharding
from trainer import steps
from trainer.steps import COUNTERS
from zeco_jax.runtime import distributed


def make_mesh(shape: dict, devices=None) -> jax.sharding.Mesh:
  """A ``(data, seq)`` mesh with Auto axes (jit + GSPMD outside the seq shard_map).

  Where the shape is no product of whole physical axes of a TPU slice (data = seq = 8 on
  v5p's 4x4x4), a physical axis is split between the two (``allow_split_physical_axes``)
  instead of failing."""
  axis_types = (jax.sharding.AxisType.Auto,) * 2
  kwargs = {} if devices is None else {"devices": devices}
  dims = (shape["data"], shape["seq"])
  try:
    return jax.make_mesh(dims, ("data", "seq"), axis_types=axis_types, **kwargs)
  except NotImplementedError:
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(dims, devices=devices if devices is not None
                                         else jax.devices(), allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, ("data", "seq"), axis_types=axis_types)


def optimizer(train: ml_collections.ConfigDict):
  """``(tx, schedule)``: AdamW over matrices only (no decay of norms and biases), after
  global-norm clipping, with a warmup + cosine learning-rate schedule."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, train.lr, train.warmup_steps, train.steps, end_value=train.lr * train.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  tx = optax.chain(
      optax.clip_by_global_norm(train.grad_clip),
      optax.adamw(schedule, b1=train.b1, b2=train.b2, weight_decay=train.weight_decay,
                  mask=decay_mask))
  return tx, schedule


class Experiment:
  """Everything compiled for one (model, optimizer, mesh, batch shape): built once, reused.

  Attributes: ``model_cfg`` (the family's config), ``spec`` (:class:`trainer.steps.StepSpec`),
  ``tx`` / ``schedule``, ``param_shardings`` / ``state_shardings`` / ``batch_sharding``,
  ``abstract_state`` (ShapeDtypeStructs with shardings), ``batch_keys`` / ``eval_keys``,
  and the jitted ``train_step``, ``eval_step``, ``loss_and_grad``.
  """

  def __init__(self, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh):
    self.config, self.mesh = config, mesh
    self.model_cfg, self.model_cls = model_from_config(config.model.to_dict())
    train = config.train
    self.rules = sharding.rules_from_config(train.sharding_rules.to_dict())
    self.batch_sharding = sharding.batch_sharding(mesh, self.rules)
    batch_axes = self.batch_sharding.spec[0] if len(self.batch_sharding.spec) else None
    if batch_axes is not None and getattr(self.model_cfg, "batch_axes", None) is None:
      # B is split over `batch_axes`: the kernels run per shard of it (the compiler cannot
      # partition a kernel), so the layers must know (zeco_jax.nn.gla_op).
      self.model_cfg = dataclasses.replace(self.model_cfg, batch_axes=batch_axes)
    abstract = nnx.eval_shape(lambda: self.model_cls(self.model_cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    self.axes = sharding.logical_axes(abstract)
    self.param_shardings = sharding.param_shardings(self.axes, mesh, self.rules)
    self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.spec = steps.StepSpec(graphdef, jnp.dtype(train.compute_dtype), train.loss_chunk_size,
                               mesh, tuple(self.batch_sharding.spec))
    self.tx, self.schedule = optimizer(train)
    self._init_params = functools.partial(_init_params, self.model_cls, self.model_cfg,
                                          train.seed)
    self._build_state_shardings()
    # segment_ids (packed documents, int32 [B, T]) ride with the tokens: B over data, T
    # over seq; the model gets them when the data has them (models/data.py batch_keys).
    self.batch_keys = datamod.batch_keys(config.data)
    self.eval_keys = datamod.eval_keys(config.data)
    self._jit_steps()

  def _build_state_shardings(self) -> None:
    abstract_params = jax.eval_shape(self._init_params)
    abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract_opt, self.param_shardings,
        transform_non_params=lambda _: self.replicated)
    self.state_shardings = {"params": self.param_shardings, "opt_state": opt_shardings,
                            "step": self.replicated,
                            **{name: self.replicated for name in COUNTERS}}
    self._init_opt = jax.jit(self.tx.init, out_shardings=opt_shardings)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    self.abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        {"params": abstract_params, "opt_state": abstract_opt, "step": scalar,
         **{name: scalar for name in COUNTERS}},
        self.state_shardings)

  def _jit_steps(self) -> None:
    batch = {k: self.batch_sharding for k in self.batch_keys}
    self.loss_and_grad = jax.jit(
        functools.partial(steps.loss_and_grad, spec=self.spec),
        in_shardings=(self.param_shardings, batch),
        out_shardings=(self.replicated, self.replicated, self.param_shardings))
    self.train_step = jax.jit(
        functools.partial(steps.train_step, spec=self.spec, tx=self.tx, schedule=self.schedule),
        in_shardings=(self.state_shardings, batch),
        out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
    self.eval_step = jax.jit(
        functools.partial(steps.eval_step, spec=self.spec),
        in_shardings=(self.param_shardings, {k: self.batch_sharding for k in self.eval_keys}),
        out_shardings=self.replicated)

  def init_state(self) -> dict:
    """Fresh train state, placed with ``state_shardings``.

    The parameters are built eagerly on the host CPU (op by op, deterministic, the same
    values on every process) and then placed shard by shard: one jit of the whole model's
    initialisers took 26 s to compile on CPU for gla_340m and longer than the run's budget
    on the H200. The optimizer state (zeros) is one small jit with the right shardings.
    """
    try:
      where = jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:          # JAX_PLATFORMS without cpu: eager on the default device
      where = contextlib.nullcontext()
    with where:
      host = jax.tree.map(np.asarray, self._init_params())
    place = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
    params = jax.tree.map(place, host, self.param_shardings)
    return {"params": params, "opt_state": self._init_opt(params),
            "step": place(np.zeros((), np.int32), self.replicated),
            **{name: place(np.zeros((), np.int32), self.replicated) for name in COUNTERS}}

  def local_index(self, global_shape) -> tuple:
    """(rows, tokens): the part of a ``[B, T]`` global batch this process's devices hold."""
    return distributed.process_local_index(global_shape, self.mesh, self.batch_sharding)

  def put_batch(self, local_rows: dict, global_shape=None) -> dict:
    """This process's rows (full length) -> global arrays with B over ``data``, T over ``seq``.

    ``global_shape`` ``(B, T)`` defaults to the rows' own shape (one process: the whole batch).
    """
    if global_shape is None:
      global_shape = next(iter(local_rows.values())).shape
    tokens = self.local_index(global_shape)[1]
    return distributed.global_batch({k: v[:, tokens] for k, v in local_rows.items()},
                                    self.mesh, self.batch_sharding,
                                    global_shape={k: tuple(global_shape) for k in local_rows})


def _init_params(model_cls, model_cfg, seed):
  return nnx.to_pure_dict(nnx.state(model_cls(model_cfg, rngs=nnx.Rngs(seed)), nnx.Param))
