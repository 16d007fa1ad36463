"""Local multi-process launcher: N JAX processes on 127.0.0.1 with simulated CPU devices.

    python -m zeco_jax.runtime.launch --processes 2 --devices-per-process 4 [--timeout S] \\
        -- train.py --config.mesh=data=1,seq=8
    python -m zeco_jax.runtime.launch --processes 2 --devices-per-process 4 -- -m my.module ARGS

Each process gets ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>``, ``JAX_NUM_PROCESSES``,
``JAX_PROCESS_ID``, ``ZECO_LOCAL_DEVICE_COUNT``, ``JAX_PLATFORMS=cpu`` and an ``XLA_FLAGS``
device count, which :func:`zeco_jax.runtime.distributed.initialize` reads (the program must call
it, or ``jax.distributed.initialize`` itself, before touching the backend). Cross-process
collectives then run over gloo, exactly as they would across hosts.

Output: every line of a process's stdout / stderr is forwarded to the launcher's stdout /
stderr with a ``[p<id>] `` prefix. Failure: when a process exits non-zero (or is killed),
the others are stopped (SIGTERM to each process group, SIGKILL after ``--grace`` seconds),
the process that failed first (by the time its uncaught exception was raised, stamped in the
process: a Python program runs under :mod:`zeco_jax.runtime._launch_child`) and its last
lines are reported, and the launcher exits with its
status (128 + signal for a signal). ``--timeout``: the same, with status 124. SIGINT /
SIGTERM / SIGHUP to the launcher stop every process first. Each process runs in its own
process group, so nothing it started outlives the launcher.

What it is not: a cluster launcher. On several hosts, start one process per host (or per
GPU) with SLURM, mpirun or the TPU runtime; see docs/multihost.md.
"""
from __future__ import annotations

import argparse
import collections
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from zeco_jax.runtime._launch_child import MARK

TIMEOUT_STATUS = 124
_TAIL_LINES = 25
# Runs a Python program as python would, stamping an uncaught exception's time on stderr.
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launch_child.py")


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free a moment ago (the coordinator binds it soon after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def python_command(script: Sequence[str]) -> list[str]:
  """``-m module ARGS`` or ``path.py ARGS`` -> a command run by this Python; else as given."""
  script = list(script)
  if not script:
    raise ValueError("zeco_jax.runtime.launch: no program given; usage: ... -- SCRIPT.py ARGS "
                     "or -- -m MODULE ARGS")
  if script[0] == "-m":
    if len(script) < 2:
      raise ValueError("zeco_jax.runtime.launch: `-m` needs a module name")
    return [sys.executable, "-u", _CHILD, *script]
  if script[0].endswith(".py"):
    if not os.path.isfile(script[0]):
      raise ValueError(f"zeco_jax.runtime.launch: script {script[0]!r} does not exist")
    return [sys.executable, "-u", _CHILD, *script]
  return script


def process_env(base: dict, process_id: int, processes: int, devices: int,
                coordinator: str) -> dict:
  """The environment of process ``process_id``: what ``distributed.initialize`` reads."""
  env = dict(base)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
  env.update({
      "JAX_COORDINATOR_ADDRESS": coordinator,
      "JAX_NUM_PROCESSES": str(processes),
      "JAX_PROCESS_ID": str(process_id),
      "ZECO_LOCAL_DEVICE_COUNT": str(devices),
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": f"{flags.strip()} --xla_force_host_platform_device_count={devices}".strip(),
      "PYTHONUNBUFFERED": "1",
  })
  return env


def exit_status(returncode: int) -> int:
  """Popen's returncode as a shell exit status (a signal N becomes 128 + N)."""
  return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
  if returncode < 0:
    try:
      return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
      return f"killed by signal {-returncode}"
  return f"exited with status {returncode}"


class _Stop(Exception):
  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


class Launcher:
  """Starts, watches and stops the processes; :meth:`run` returns the exit status."""

  def __init__(self, command: Sequence[str], processes: int, devices_per_process: int, *,
               timeout: Optional[float] = None, grace: float = 5.0, settle: float = 1.0,
               env: Optional[dict] = None, host: str = "127.0.0.1",
               port: Optional[int] = None, stdout=None, stderr=None):
    if processes < 1:
      raise ValueError(f"zeco_jax.runtime.launch: --processes must be >= 1, got {processes}")
    if devices_per_process < 1:
      raise ValueError(f"zeco_jax.runtime.launch: --devices-per-process must be >= 1, got "
                       f"{devices_per_process}")
    self.command = python_command(command)
    self.processes, self.devices = processes, devices_per_process
    self.timeout, self.grace, self.settle = timeout, grace, settle
    self.base_env = dict(os.environ if env is None else env)
    self.coordinator = f"{host}:{port or free_port(host)}"
    self.out = stdout or sys.stdout
    self.err = stderr or sys.stderr
    self.lock = threading.Lock()
    self.tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(processes)]
    self.procs: list[subprocess.Popen] = []
    self.readers: list[threading.Thread] = []
    self.exits: queue.Queue = queue.Queue()
    self.exit_times = [float("inf")] * processes
    self.eof_times: list[list[float]] = [[] for _ in range(processes)]
    self.traceback_times = [float("inf")] * processes
    self.stopping = False

  def say(self, text: str) -> None:
    with self.lock:
      self.err.write(f"[launch] {text}\n")
      self.err.flush()

  def _forward(self, i: int, pipe, sink) -> None:
    prefix = f"[p{i}] "
    for raw in iter(pipe.readline, b""):
      line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
      if line.startswith(MARK):      # stamped by the process itself: not shown
        try:
          self.traceback_times[i] = min(self.traceback_times[i],
                                        float(line[len(MARK):]))
          continue
        except ValueError:
          pass
      if line.startswith("Traceback (most recent call last)"):
        self.traceback_times[i] = min(self.traceback_times[i], time.monotonic())
      self.tails[i].append(line)
      with self.lock:
        sink.write(prefix + line + "\n")
        sink.flush()
    self.eof_times[i].append(time.monotonic())
    pipe.close()

  def _wait(self, i: int, proc: subprocess.Popen) -> None:
    returncode = proc.wait()
    self.exit_times[i] = time.monotonic()
    self.exits.put((i, returncode))

  def _died_at(self, i: int) -> float:
    """When process i started to die: when its uncaught exception reached the top (stamped
    by the process itself, :mod:`zeco_jax.runtime._launch_child`), else when its first
    Python traceback reached the launcher, else the moment its pipes closed (while the
    kernel tears it down, before it is reaped), else when it was reaped. A process that
    raises does so before its teardown closes the sockets its peers then fail on, so the
    exception orders causes better than exit times, which a loaded machine can reverse;
    the stamp is taken in the process, since the launcher's reader threads can be late to
    a line on a loaded machine."""
    eofs = self.eof_times[i]
    died = min(self.exit_times[i], max(eofs)) if len(eofs) == 2 else self.exit_times[i]
    return min(died, self.traceback_times[i])

  def start(self) -> None:
    for i in range(self.processes):
      env = process_env(self.base_env, i, self.processes, self.devices, self.coordinator)
      proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)   # own process group: killpg reaches all
      self.procs.append(proc)
      for pipe, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
        t = threading.Thread(target=self._forward, args=(i, pipe, sink), daemon=True)
        t.start()
        self.readers.append(t)
      threading.Thread(target=self._wait, args=(i, proc), daemon=True).start()

  def _signal_groups(self, sig) -> None:
    for proc in self.procs:
      try:
        os.killpg(proc.pid, sig)   # the group's id is the child's pid (start_new_session)
      except (ProcessLookupError, PermissionError):
        pass

  def stop_all(self) -> None:
    """SIGTERM every process group, SIGKILL whatever is left after the grace period."""
    if any(p.poll() is None for p in self.procs):
      self._signal_groups(signal.SIGTERM)
      deadline = time.monotonic() + self.grace
      while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
        time.sleep(0.05)
    # Also reaches grandchildren left in a group whose leader already exited.
    self._signal_groups(signal.SIGKILL)
    for p in self.procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.say(f"pid {p.pid} did not exit after SIGKILL")

  def _drain(self) -> None:
    for t in self.readers:
      t.join(timeout=2.0)

  def _report(self, failures: list, t0: float) -> int:
    """Says which process failed first (and which others did); returns its exit status."""
    failures = sorted(failures, key=lambda f: self._died_at(f[0]))
    (i, returncode), others = failures[0], failures[1:]
    n_left = sum(p.poll() is None for p in self.procs)
    also = "".join(f"; then process {j} {describe(rc)}" for j, rc in others)
    stopping = f"; stopping the {n_left} still running" if n_left else ""
    tail = "\n".join(f"  [p{i}] {line}" for line in self.tails[i])
    self.say(f"process {i} (pid {self.procs[i].pid}) failed first: {describe(returncode)} "
             f"after {self._died_at(i) - t0:.1f} s{also}{stopping}. Its last output:\n"
             f"{tail or '  (none)'}")
    return exit_status(returncode)

  def run(self) -> int:
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {}

    def on_signal(signum, frame):
      if not self.stopping:        # a second signal must not cut the clean-up short
        raise _Stop(signum)

    if threading.current_thread() is threading.main_thread():
      for s in handled:
        previous[s] = signal.signal(s, on_signal)
    t0 = time.monotonic()
    status, remaining = 0, self.processes
    try:
      self.start()
      self.say(f"{self.processes} processes x {self.devices} CPU devices, coordinator "
               f"{self.coordinator}: {' '.join(self.command)}")
      while remaining:
        wait = 0.2
        if self.timeout is not None:
          left = self.timeout - (time.monotonic() - t0)
          if left <= 0:
            running = [i for i, p in enumerate(self.procs) if p.poll() is None]
            self.say(f"timeout after {self.timeout:g} s; processes {running} still running; "
                     f"stopping all")
            status = TIMEOUT_STATUS
            break
          wait = min(wait, left)
        try:
          i, returncode = self.exits.get(timeout=wait)
        except queue.Empty:
          continue
        remaining -= 1
        if returncode != 0:
          # Peers of a dead process often fail a moment later (connection reset): collect
          # the failures of a short window, then blame the one that died first.
          failures, settle = [(i, returncode)], time.monotonic() + self.settle
          while remaining and time.monotonic() < settle:
            try:
              j, rc = self.exits.get(timeout=max(settle - time.monotonic(), 0.01))
            except queue.Empty:
              break
            remaining -= 1
            if rc != 0:
              failures.append((j, rc))
          for j, _ in failures:
            self._drain_one(j)
          status = self._report(failures, t0)
          break
    except _Stop as stop:
      self.say(f"received {signal.Signals(stop.signum).name}; stopping all processes")
      status = 128 + stop.signum
    finally:
      self.stopping = True
      try:
        self.stop_all()
        self._drain()
      finally:
        for s, handler in previous.items():
          signal.signal(s, handler)
    return status

  def _drain_one(self, i: int) -> None:
    for t in self.readers[2 * i:2 * i + 2]:
      t.join(timeout=2.0)


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      prog="python -m zeco_jax.runtime.launch", description=__doc__.split("\n\n")[0],
      usage="python -m zeco_jax.runtime.launch --processes N --devices-per-process D [--timeout S] "
            "-- SCRIPT.py ARGS... | -- -m MODULE ARGS...")
  p.add_argument("--processes", type=int, required=True, help="number of processes")
  p.add_argument("--devices-per-process", type=int, required=True,
                 help="simulated CPU devices in each process")
  p.add_argument("--timeout", type=float, default=None,
                 help="stop everything after this many seconds (exit status 124)")
  p.add_argument("--grace", type=float, default=5.0,
                 help="seconds between SIGTERM and SIGKILL when stopping (default 5)")
  p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" not in argv:
    p.error("put the program after `--`, e.g. -- train.py ARGS or -- -m MODULE ARGS")
  split = argv.index("--")
  args = p.parse_args(argv[:split])
  args.command = argv[split + 1:]
  if not args.command:
    p.error("no program after `--`")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    launcher = Launcher(args.command, args.processes, args.devices_per_process,
                        timeout=args.timeout, grace=args.grace, port=args.port)
  except ValueError as e:
    print(e, file=sys.stderr)
    return 2
  return launcher.run()


if __name__ == "__main__":
  sys.exit(main())
