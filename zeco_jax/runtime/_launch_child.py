"""What :mod:`zeco_jax.runtime.launch` runs in each process for a Python program:

    python -u .../zeco_jax/runtime/_launch_child.py -m MODULE ARGS
    python -u .../zeco_jax/runtime/_launch_child.py SCRIPT.py ARGS

(by path, so it needs nothing importable; it imports only the standard library) runs the
program as ``python -m MODULE ARGS`` / ``python SCRIPT.py ARGS`` would (as ``__main__``,
with its ``sys.argv``, the working folder or the script's folder first on ``sys.path``),
with one addition: an uncaught exception first writes ``[launch] exception at <t>`` to stderr, t the
``time.monotonic()`` of the moment it reached the top (the clock is system-wide, so the
launcher can compare processes). The launcher orders failures by it: a process's own
exception comes before the teardown that makes its peers fail, however late the launcher
reads either's lines on a loaded machine.
"""
from __future__ import annotations

import os
import runpy
import sys
import time

MARK = "[launch] exception at "


def _hook(previous):
  def hook(kind, value, tb):
    try:
      sys.stderr.write(f"{MARK}{time.monotonic():.6f}\n")
      sys.stderr.flush()
    finally:
      previous(kind, value, tb)
  return hook


def main(argv: list[str]) -> None:
  if not argv or (argv[0] == "-m" and len(argv) < 2):
    raise SystemExit("zeco_jax.runtime._launch_child: usage: -m MODULE ARGS | SCRIPT.py ARGS")
  sys.excepthook = _hook(sys.excepthook)
  if argv[0] == "-m":
    sys.argv = [argv[1], *argv[2:]]         # run_module puts the module's path in argv[0]
    sys.path[0] = os.getcwd()
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
  else:
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
  main(sys.argv[1:])
