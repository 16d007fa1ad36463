"""Metrics of a training run: the writer (JSONL + TensorBoard), the progress display, the plot.

:class:`MetricWriter` appends one JSON object per row to ``WORKDIR/metrics.jsonl`` (the
record the tests, the plot and ``benchmarks/results`` read) and, when tensorboardX is
installed (the ``train`` extra), the same scalars as TensorBoard events under
``WORKDIR/tensorboard`` (``tensorboard --logdir runs``). :class:`Progress` is a tqdm bar
(loss, tokens/s, ETA), plain log lines, or nothing. :func:`plot_metrics` draws
``loss.png`` from ``metrics.jsonl``. Only the process that writes (process 0 of a
multi-process run) should enable them; the others get no-op instances.
"""
from __future__ import annotations

import json
import os
import time

PROGRESS_MODES = ("bar", "lines", "off")


class MetricWriter:
  """``write(step, scalars)`` to ``metrics.jsonl`` and, if available, TensorBoard events."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a") if enabled else None
    self._tb = None
    if enabled:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:      # optional: the JSONL file is the record
        SummaryWriter = None
      if SummaryWriter is not None:
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, scalars: dict) -> None:
    if self._file is None:
      return
    self._file.write(json.dumps({"step": step, **scalars}) + "\n")
    if self._tb is not None:
      for name, value in scalars.items():
        self._tb.add_scalar(name, value, step)

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


def plot_metrics(metrics_path: str, png_path: str) -> None:
  """Train loss (log scale) and eval accuracy against step; nothing without matplotlib."""
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
