"""The trainer behind ``train.py``: a package of the repository (not of the installed
library; ``models``, ``configs`` and this run from a checkout).

* :mod:`trainer.steps`: the programs as module-level functions (loss, gradient, optimizer
  step, evaluation step) over a hashable :class:`~trainer.steps.StepSpec`;
* :mod:`trainer.experiment`: :class:`Experiment`, everything compiled for one run (shardings,
  optimizer, the jitted steps) and :func:`make_mesh`;
* :mod:`trainer.loop`: :func:`train_and_evaluate` (start-up, restore or init, the step loop,
  the summary) and its errors;
* :mod:`trainer.checkpointing`, :mod:`trainer.metrics`, :mod:`trainer.aot` (the whole step
  compiled for a TPU topology ahead of time, ``train.py --compile_only``).
"""
from trainer.experiment import Experiment, make_mesh, optimizer
from trainer.loop import DataError, Diverged, RunError, evaluate, train_and_evaluate
from trainer.steps import (COUNTERS, StepSpec, chunked_masked_loss, eval_step, loss_and_grad,
                           loss_fn, masked_loss, masked_mean, train_step)

__all__ = ["COUNTERS", "DataError", "Diverged", "Experiment", "RunError", "StepSpec",
           "chunked_masked_loss", "eval_step", "evaluate", "loss_and_grad", "loss_fn",
           "make_mesh", "masked_loss", "masked_mean", "optimizer", "train_and_evaluate",
           "train_step"]
