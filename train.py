#!/usr/bin/env python
"""Train the GLA language model with ZeCO sequence parallelism: ``python train.py``.

With no arguments: the tiny MQAR config (``configs/tiny_mqar.py``) on a ``data x seq``
mesh; on a CPU-only host 8 simulated devices are made (data=2, seq=4). On GPU/TPU hosts
the same command uses the real devices.

    python train.py                                   # tiny MQAR default
    python train.py --config gla_340m --mesh data=1,seq=8 --set data.path=corpus/
    python train.py --set model.num_layers=4 --set train.lr=3e-4 --workdir runs/x

What it does: builds the mesh (``data``, ``seq``); places each batch with B over ``data``
and T over ``seq``; one ``jax.jit`` train step with explicit in/out shardings (AdamW,
warmup + cosine decay, gradient clipping, optional bf16 compute with float32 params);
orbax ``CheckpointManager`` (every N steps, keep k, async, atomic) and automatic resume
from the latest complete checkpoint; the data of step s is a function of (seed, s), so a
resumed run continues exactly. Progress bar (loss, tokens/s, ETA), metrics as JSONL and a
loss plot (PNG) in the workdir.

Several processes (one per host or per GPU): ``--coordinator HOST:PORT --num-processes N
--process-id I``, or the ``JAX_*`` environment variables, or SLURM / TPU-pod detection
(``zeco_jax.distributed``); each process builds only its own rows and tokens of every batch,
only process 0 logs, and orbax writes the checkpoint from all of them. Locally:
``python -m zeco_jax.launch --processes 2 --devices-per-process 4 -- train.py ...``.

What it does not do: pipeline or tensor parallelism.
"""
from __future__ import annotations

import os
import sys

# Simulated CPU devices must be requested before jax starts; on GPU/TPU hosts this flag
# only affects the (unused) host platform.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import configs  # noqa: E402
from models import GLALM, GLAConfig, sharding  # noqa: E402
from models.data import Dataset  # noqa: E402
from zeco_jax import distributed  # noqa: E402

OPTIMIZER_KEYS = ("steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "b1", "b2",
                  "grad_clip", "compute_dtype", "seed", "sharding_rules")


def make_mesh(shape: dict) -> jax.sharding.Mesh:
  """A ``(data, seq)`` mesh with Auto axes (jit + GSPMD outside the seq shard_map)."""
  axis_types = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh((shape["data"], shape["seq"]), ("data", "seq"), axis_types=axis_types)


def masked_loss(logits, batch):
  """Mean next-token NLL and accuracy over ``mask`` (float32)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  mask = batch["mask"]
  count = jnp.maximum(jnp.sum(mask), 1.0)
  correct = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
  return jnp.sum(nll * mask) / count, {"accuracy": jnp.sum(correct * mask) / count,
                                        "nll_sum": jnp.sum(nll * mask),
                                        "correct": jnp.sum(correct * mask), "count": count,
                                        "correct_at": correct}


class Experiment:
  """Everything compiled for one (model, optimizer, mesh, batch shape): built once, reused."""

  def __init__(self, cfg: dict, mesh: jax.sharding.Mesh):
    self.cfg, self.mesh = cfg, mesh
    self.model_cfg = GLAConfig(**cfg["model"])
    train = cfg["train"]
    self.rules = sharding.rules_from_config(train["sharding_rules"])
    abstract = nnx.eval_shape(lambda: GLALM(self.model_cfg, rngs=nnx.Rngs(0)))
    self.graphdef, _ = nnx.split(abstract)
    self.axes = sharding.logical_axes(abstract)
    self.param_shardings = sharding.param_shardings(self.axes, mesh, self.rules)
    self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.batch_sharding = sharding.batch_sharding(mesh, self.rules)
    self.compute_dtype = jnp.dtype(train["compute_dtype"])

    self.schedule = optax.warmup_cosine_decay_schedule(
        0.0, train["lr"], train["warmup_steps"], train["steps"],
        end_value=train["lr"] * train["min_lr_ratio"])
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no norms/biases
    self.tx = optax.chain(
        optax.clip_by_global_norm(train["grad_clip"]),
        optax.adamw(self.schedule, b1=train["b1"], b2=train["b2"],
                    weight_decay=train["weight_decay"], mask=decay_mask))

    seed, model_cfg = train["seed"], self.model_cfg

    def init_params():
      return nnx.to_pure_dict(nnx.state(GLALM(model_cfg, rngs=nnx.Rngs(seed)), nnx.Param))

    abstract_params = jax.eval_shape(init_params)
    abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract_opt,
        self.param_shardings, transform_non_params=lambda _: self.replicated)
    self.state_shardings = {"params": self.param_shardings, "opt_state": opt_shardings,
                            "step": self.replicated}
    batch_shardings = {k: self.batch_sharding for k in ("inputs", "targets", "mask")}

    self._init_params = init_params
    self._init_opt = jax.jit(self.tx.init, out_shardings=opt_shardings)
    self.abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        {"params": abstract_params, "opt_state": abstract_opt,
         "step": jax.ShapeDtypeStruct((), jnp.int32)}, self.state_shardings)

    def loss_fn(params, batch):
      if self.compute_dtype != jnp.float32:
        params = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
      logits = nnx.merge(self.graphdef, params)(batch["inputs"], mesh=mesh)
      return masked_loss(logits, batch)

    def loss_and_grad(params, batch):
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
      aux.pop("correct_at")
      return loss, aux, grads

    def train_step(state, batch):
      loss, aux, grads = loss_and_grad(state["params"], batch)
      updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      metrics = {"loss": loss, "accuracy": aux["accuracy"],
                 "grad_norm": optax.global_norm(grads), "lr": self.schedule(state["step"])}
      return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def eval_step(params, batch):
      aux = loss_fn(params, batch)[1]
      correct = aux.pop("correct_at")           # [B, T]: argmax == target
      aux["cross_correct"] = jnp.sum(correct * batch["cross"])
      aux["cross_count"] = jnp.sum(batch["cross"])
      return aux

    self.loss_and_grad = jax.jit(loss_and_grad,
                                 in_shardings=(self.param_shardings, batch_shardings),
                                 out_shardings=(self.replicated, self.replicated,
                                                self.param_shardings))
    self.train_step = jax.jit(train_step, in_shardings=(self.state_shardings, batch_shardings),
                              out_shardings=(self.state_shardings, self.replicated),
                              donate_argnums=0)
    self.eval_step = jax.jit(eval_step, in_shardings=(
        self.param_shardings, {**batch_shardings, "cross": self.batch_sharding}),
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
            "step": place(np.zeros((), np.int32), self.replicated)}

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


_EXPERIMENTS: dict = {}


def get_experiment(cfg: dict, mesh_shape: dict) -> Experiment:
  """Cached by everything that changes the compiled programs (tests reuse compilations)."""
  key = json.dumps([cfg["model"], {k: cfg["train"][k] for k in OPTIMIZER_KEYS}, mesh_shape,
                    jax.devices()[0].platform], sort_keys=True, default=str)
  if key not in _EXPERIMENTS:
    _EXPERIMENTS[key] = Experiment(cfg, make_mesh(mesh_shape))
  return _EXPERIMENTS[key]


def checkpoint_manager(workdir: str, train: dict):
  if not train["checkpoint_every"]:
    return None
  options = ocp.CheckpointManagerOptions(
      save_interval_steps=train["checkpoint_every"], max_to_keep=train["keep_checkpoints"],
      enable_async_checkpointing=train["async_checkpointing"], create=True)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                               options=options)


class Progress:
  """tqdm bar with loss, tokens/s and ETA; plain lines when tqdm is missing or not wanted."""

  def __init__(self, total, initial, enabled, bar=True):
    self.bar, self.enabled, self.total = None, enabled, total
    self.t0, self.initial = time.time(), initial
    if enabled and bar:
      try:
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
      except ImportError:
        pass

  def update(self, step, n, info: dict):
    if self.bar is not None:
      self.bar.update(n)
      self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v)
                            for k, v in info.items()}, refresh=False)
    elif self.enabled:
      done = step - self.initial
      eta = (time.time() - self.t0) / max(done, 1) * (self.total - step)
      print(f"step {step}/{self.total} " + " ".join(
          f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
            + f" eta={eta:.0f}s", flush=True)

  def write(self, text):
    if self.bar is not None:
      self.bar.write(text)
    else:
      print(text, flush=True)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def evaluate(exp: Experiment, dataset: Dataset, params, num_batches: int) -> dict:
  totals = None
  for i in range(num_batches):
    shape = (dataset.cfg["batch_size"], dataset.cfg["seq_len"])
    batch = dataset.eval_batch(i, num_shards=exp.mesh.shape["seq"],
                               rows=exp.local_index(shape)[0])
    out = exp.eval_step(params, exp.put_batch(batch, shape))
    out = {k: float(v) for k, v in jax.device_get(out).items()}
    totals = out if totals is None else {k: totals[k] + out[k] for k in out}
  result = {"eval_loss": totals["nll_sum"] / totals["count"],
            "eval_accuracy": totals["correct"] / totals["count"],
            "eval_queries": int(totals["count"])}
  if totals["cross_count"]:
    result["eval_cross_shard_accuracy"] = totals["cross_correct"] / totals["cross_count"]
    result["eval_cross_shard_queries"] = int(totals["cross_count"])
  return result


def plot_metrics(metrics_path: str, png_path: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  train, evals = {}, {}
  with open(metrics_path) as f:
    for line in f:
      row = json.loads(line)
      if "loss" in row:
        train[row["step"]] = row        # a resumed run's rows replace the lost ones
      if "eval_accuracy" in row:
        evals[row["step"]] = row
  if not train:
    return
  steps = sorted(train)
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, [train[s]["loss"] for s in steps], lw=1, label="train loss")
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_yscale("log")
  if evals:
    ax2 = ax.twinx()
    es = sorted(evals)
    ax2.plot(es, [evals[s]["eval_accuracy"] for s in es], "o-", color="C1", label="eval acc")
    ax2.set_ylabel("eval accuracy")
    ax2.set_ylim(0, 1.02)
  ax.set_title(os.path.basename(os.path.dirname(os.path.abspath(png_path))))
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)
  plt.close(fig)


def run(cfg: dict, *, progress: bool = True, verbose: bool = True, bar: bool = True) -> dict:
  """Trains (or resumes) per ``cfg``; returns a summary with per-step losses."""
  devices = jax.devices()
  mesh_shape = configs.validate(cfg, len(devices))
  train, data_cfg = cfg["train"], cfg["data"]
  workdir = train["workdir"] or os.path.join("runs", cfg.get("name", "run"))
  os.makedirs(workdir, exist_ok=True)
  main_process = distributed.is_main_process()   # the one process that logs and plots
  verbose, progress = verbose and main_process, progress and main_process
  say = print if verbose else (lambda *a, **k: None)
  exp = get_experiment(cfg, mesh_shape)
  dataset = Dataset(data_cfg)
  mngr = checkpoint_manager(workdir, train)

  latest = mngr.latest_step() if mngr is not None else None
  if latest is not None:
    state = mngr.restore(latest, args=ocp.args.StandardRestore(exp.abstract_state))
    say(f"resumed from {workdir}/checkpoints step {latest}", flush=True)
  else:
    state = exp.init_state()
  start = int(jax.device_get(state["step"]))
  stop = min(train["steps"], train["stop_after"] or train["steps"])
  tokens_per_step = data_cfg["batch_size"] * data_cfg["seq_len"]
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  say(f"{cfg.get('name')}: {n_params / 1e6:.2f}M params, mesh data={mesh_shape['data']} "
      f"seq={mesh_shape['seq']} on {len(devices)} {devices[0].platform} devices, "
      f"batch {data_cfg['batch_size']} x {data_cfg['seq_len']} tokens, steps {start}->{stop}",
      flush=True)

  metrics_path = os.path.join(workdir, "metrics.jsonl")
  metrics_file = open(metrics_path if main_process else os.devnull, "a")
  bar = Progress(stop, start, progress, bar)
  losses, pending = {}, []
  t_start = time.time()
  t_window, window_steps, compile_s, steady = time.time(), 0, None, []
  summary = {"start_step": start}

  def log_eval(step):
    ev = evaluate(exp, dataset, state["params"], train["eval_batches"])
    metrics_file.write(json.dumps({"step": step, **ev}) + "\n")
    metrics_file.flush()
    if verbose:
      bar.write(f"step {step}: eval loss {ev['eval_loss']:.4f} accuracy {ev['eval_accuracy']:.4f}"
              + (f" (cross-shard queries: {ev['eval_cross_shard_accuracy']:.4f} of "
                 f"{ev['eval_cross_shard_queries']})" if "eval_cross_shard_accuracy" in ev else ""))
    return ev

  global_shape = (data_cfg["batch_size"], data_cfg["seq_len"])
  my_rows = exp.local_index(global_shape)[0]      # this process builds only these rows
  next_batch = dataset.batch(start, my_rows) if start < stop else None
  for step in range(start, stop):
    batch = exp.put_batch(next_batch, global_shape)
    state, metrics = exp.train_step(state, batch)
    if step + 1 < stop:
      next_batch = dataset.batch(step + 1, my_rows)   # host work overlaps the async step
    pending.append((step + 1, metrics))
    done = step + 1
    if compile_s is None:
      jax.block_until_ready(metrics)
      compile_s = time.time() - t_window
      if verbose:
        bar.write(f"first step (compile included): {compile_s:.1f}s")
      t_window = time.time()
    else:
      window_steps += 1
    if done % train["log_every"] == 0 or done == stop:
      rows = jax.device_get([m for _, m in pending])
      now = time.time()
      tok_s = tokens_per_step * window_steps / max(now - t_window, 1e-9) if window_steps else 0.0
      if window_steps:
        steady.append((window_steps, now - t_window))
      for (s, _), row in zip(pending, rows):
        row = {k: float(v) for k, v in row.items()}
        losses[s] = row["loss"]
        metrics_file.write(json.dumps({"step": s, **row, "tokens_per_s": tok_s,
                                       "elapsed_s": now - t_start}) + "\n")
      metrics_file.flush()
      info = {"loss": float(rows[-1]["loss"]), "tok/s": f"{tok_s:,.0f}"}
      if data_cfg["kind"] == "mqar":
        info["acc"] = float(rows[-1]["accuracy"])
      bar.update(done, len(pending), info)
      pending, t_window, window_steps = [], time.time(), 0
    if mngr is not None and (done % train["checkpoint_every"] == 0 or done == stop):
      mngr.save(done, args=ocp.args.StandardSave(state), force=done == stop)
      # Printed once the async write is in flight (the SIGKILL test waits for this line).
      if verbose:
        bar.write(f"checkpoint: step {done} save started")
    if train["eval_every"] and done % train["eval_every"] == 0 and done != stop:
      summary.setdefault("evals", {})[done] = log_eval(done)
  bar.close()
  if mngr is not None:
    mngr.wait_until_finished()
    mngr.close()
  final_step = int(jax.device_get(state["step"]))
  if train["eval_batches"] and (final_step == train["steps"] or train["stop_after"] is None):
    summary["final_eval"] = log_eval(final_step)
  metrics_file.close()
  if main_process:
    plot_metrics(metrics_path, os.path.join(workdir, "loss.png"))
  steps_timed = sum(n for n, _ in steady)
  summary.update({
      "step": final_step, "losses": losses, "wall_s": time.time() - t_start,
      "compile_s": compile_s, "workdir": workdir,
      "tokens_per_s": (tokens_per_step * steps_timed / sum(t for _, t in steady)
                       if steps_timed else None),
      # Parameters spread over several processes are gathered to every host first.
      "params": (jax.device_get(state["params"]) if jax.process_count() == 1 else
                 multihost_utils.process_allgather(state["params"], tiled=True))})
  if "final_eval" in summary:
    ev = summary["final_eval"]
    cross = (f", on the {ev['eval_cross_shard_queries']} queries whose pair is on an earlier "
             f"seq shard {ev['eval_cross_shard_accuracy']:.4f}"
             if "eval_cross_shard_accuracy" in ev else "")
    say(f"final step {final_step}: eval loss {ev['eval_loss']:.4f}, accuracy "
        f"{ev['eval_accuracy']:.4f} over {ev['eval_queries']} scored positions in "
        f"{train['eval_batches']} x {data_cfg['batch_size']} held-out sequences{cross}; "
        f"wall {summary['wall_s']:.0f}s", flush=True)
  return summary


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="tiny_mqar", help="config name in configs/ or a path")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                 help="override a config field (repeatable), e.g. --set model.num_layers=4")
  p.add_argument("--mesh", default=None, help="e.g. data=2,seq=4 (default: the config's)")
  p.add_argument("--workdir", default=None, help="checkpoints, metrics.jsonl, loss.png")
  p.add_argument("--text", default=None, help="train on the bytes of this file or folder")
  p.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
  distributed.add_cli_args(p)
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  try:   # first: before anything starts the jax backend
    distributed.from_cli(args)
  except ValueError as e:
    sys.exit(f"multi-process settings: {e}")
  extra = [f"data.path={args.text!r}", "data.kind='text'"] if args.text else []
  try:
    cfg = configs.load(args.config, extra + args.set)
  except ValueError as e:
    sys.exit(f"config error: {e}")
  if args.text and cfg["model"]["vocab_size"] < 256:
    cfg["model"]["vocab_size"] = 256             # byte-level

  if args.mesh:
    cfg["mesh"] = configs.parse_mesh(args.mesh)
  if args.workdir:
    cfg["train"]["workdir"] = args.workdir
  try:
    configs.validate(cfg, len(jax.devices()))
  except ValueError as e:
    sys.exit(f"config error: {e}")
  run(cfg, bar=not args.no_progress)


if __name__ == "__main__":
  main()
