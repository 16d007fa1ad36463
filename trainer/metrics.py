"""Metrics of a training run: the writer (JSONL + TensorBoard), the progress display, the plot.

:class:`MetricWriter` appends one JSON object per row to ``WORKDIR/metrics.jsonl`` (the
record the tests, the plot and ``benchmarks/results`` read) and, when tensorboardX is
installed (the ``train`` extra), the same scalars as TensorBoard events under
``WORKDIR/tensorboard`` (``tensorboard --logdir runs``). :class:`Progress` is a tqdm bar
(loss, tokens/s, ETA), plain log lines, or nothing. :func:`plot_metrics` draws
``loss.png`` from ``metrics.jsonl``. Only the process that writes (process 0 of a
multi-process run) should enable them; the others get no-op instances.

Neither loses a run: the writer reopens ``metrics.jsonl`` when it was deleted or replaced
under it (the rows after that are kept), and the plot only warns when it cannot be drawn.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

PROGRESS_MODES = ("bar", "lines", "off")


class MetricWriter:
  """``write(step, scalars)`` to ``metrics.jsonl`` and, if available, TensorBoard events."""

  def __init__(self, workdir: str, enabled: bool = True, keep_through=None):
    """``keep_through``: a step; rows of ``metrics.jsonl`` past it are dropped first (a run
    resumed from that step's checkpoint logs the later steps again). None keeps every row."""
    self.path = os.path.join(workdir, "metrics.jsonl")
    if enabled and keep_through is not None:
      drop_rows_after(self.path, keep_through)
    self._file = open(self.path, "a") if enabled else None
    self._reopened = 0           # times the file was found deleted or replaced
    self._tb = None
    if enabled:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:      # optional: the JSONL file is the record
        SummaryWriter = None
      if SummaryWriter is not None:
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def _check_file(self) -> None:
    """Reopens (recreates) ``metrics.jsonl`` if it is no longer the file we hold open."""
    try:
      same = os.path.samestat(os.stat(self.path), os.fstat(self._file.fileno()))
    except OSError:              # deleted, or its folder is gone
      same = False
    if not same:
      self._file.close()
      os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
      self._file = open(self.path, "a")
      self._reopened += 1
      print(f"metrics: {self.path} was deleted or replaced; writing a new one",
            file=sys.stderr, flush=True)

  def write(self, step: int, scalars: dict) -> None:
    if self._file is None:
      return
    self._check_file()
    self._file.write(json.dumps({"step": step, **scalars}) + "\n")
    if self._tb is not None:
      for name, value in scalars.items():
        if math.isfinite(value):     # a skipped step's NaN is in the JSONL (tensorboardX
          self._tb.add_scalar(name, value, step)   # warns on each one)

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def drop_rows_after(path: str, step: int) -> int:
  """Rewrites ``path`` (atomically) without the rows whose ``"step"`` is past ``step``, and
  without lines a kill cut short; returns how many were dropped (0: file left alone)."""
  try:
    with open(path) as f:
      lines = f.readlines()
  except FileNotFoundError:
    return 0
  kept = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:            # a line cut short by a kill
      continue
    if row.get("step", 0) <= step:
      kept.append(line if line.endswith("\n") else line + "\n")
  dropped = len(lines) - len(kept)
  if dropped:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, path)
  return dropped


def _fmt(value) -> str:
  return f"{value:.4g}" if isinstance(value, float) else str(value)


class Progress:
  """``mode``: "bar" (tqdm, plain lines if tqdm is missing), "lines" or "off" (silent)."""

  def __init__(self, total: int, initial: int, mode: str = "bar"):
    if mode not in PROGRESS_MODES:
      raise ValueError(f"progress must be one of {PROGRESS_MODES}, got {mode!r}")
    self.mode, self.total, self.initial, self.t0 = mode, total, initial, time.time()
    self.bar = None
    if mode == "bar":
      try:
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
      except ImportError:
        self.mode = "lines"

  def update(self, step: int, n: int, info: dict) -> None:
    if self.bar is not None:
      self.bar.update(n)
      self.bar.set_postfix({k: _fmt(v) for k, v in info.items()}, refresh=False)
    elif self.mode == "lines":
      eta = (time.time() - self.t0) / max(step - self.initial, 1) * (self.total - step)
      print(f"step {step}/{self.total} " + " ".join(f"{k}={_fmt(v)}" for k, v in info.items())
            + f" eta={eta:.0f}s", flush=True)

  def write(self, text: str) -> None:
    """A message (not a step line): above the bar, or a line; nothing when "off"."""
    if self.bar is not None:
      self.bar.write(text)
    elif self.mode == "lines":
      print(text, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def plot_metrics(metrics_path: str, png_path: str) -> bool:
  """Train loss (log scale) and eval accuracy against step; never raises.

  Returns whether ``png_path`` was written: not without matplotlib, rows or a readable
  ``metrics_path`` (a warning on stderr says why).
  """
  try:
    return _plot(metrics_path, png_path)
  except Exception as e:   # noqa: BLE001 (a plot must not fail a finished run)
    print(f"metrics: no plot {png_path} ({type(e).__name__}: {e})", file=sys.stderr,
          flush=True)
    return False


def _plot(metrics_path: str, png_path: str) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  train, evals = {}, {}
  with open(metrics_path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:          # a line cut short by a kill
        continue
      if "loss" in row:
        train[row["step"]] = row        # a resumed run's rows replace the lost ones
      if "eval_accuracy" in row:
        evals[row["step"]] = row
  if not train:
    return False
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
  return True
