"""Multi-process runs on one machine: ``python -m zeco_jax.runtime.launch``, CPU devices, gloo.

* 2 processes x 4 CPU devices, mesh ``seq=8`` spanning both: zeco_gla outputs and
  gradients equal the single-process 8-device result (all_scan and all_gather);
* a process dying mid-run makes the launcher exit non-zero promptly with its error, found by
  the time its exception was raised (stamped in the process);
* the launcher stops hung peers (and their children), honours its timeout and SIGTERM;
* ``zeco_jax.runtime.distributed`` resolves and validates its settings.

Every subprocess has a hard timeout; the whole file takes about a minute on 2 cores.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import multihost_worker
from helpers import ROOT, rel_err
from zeco_jax.runtime import distributed, launch
from zeco_jax.sp.scan import SCAN_METHODS

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "multihost_worker.py")


def run_launcher(args, program, timeout, pythonpath=()):
  """``python -m zeco_jax.runtime.launch ARGS -- PROGRAM``; returns (CompletedProcess, seconds)."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, HERE, *pythonpath]))
  t0 = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "zeco_jax.runtime.launch", *args, "--", *program],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  return proc, time.monotonic() - t0


def alive(pid):
  """Running (a zombie waiting for a reaper that is not ours does not count)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except OSError:
    return False


# --- zeco_gla across two processes ----------------------------------------------------------

@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
  out = tmp_path_factory.mktemp("multihost") / "gla.npz"
  proc, _ = run_launcher(["--processes", "2", "--devices-per-process", "4", "--timeout", "240"],
                         [WORKER, "gla", str(out)], timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for p in (0, 1):
    assert f"[p{p}] process {p} of 2" in proc.stdout
    assert "4 local / 8 global devices" in proc.stdout
  return dict(np.load(out))


@pytest.mark.parametrize("method", multihost_worker.METHODS)
def test_zeco_gla_two_processes_equals_one(two_process_results, method, devices):
  assert method in SCAN_METHODS
  reference = multihost_worker.gla_results(Mesh(np.array(devices), ("seq",)), method)
  assert set(reference) == {"loss", "o", "final", "dq", "dk", "dv", "dg", "dh0"}
  for name, want in reference.items():
    got = two_process_results[f"{method}/{name}"]
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32, name
    assert rel_err(got, want) <= 1e-5, (name, rel_err(got, want))


# --- failures ------------------------------------------------------------------------------

def test_process_dying_mid_run_stops_the_launcher_promptly():
  proc, seconds = run_launcher(["--processes", "2", "--devices-per-process", "4",
                                "--timeout", "120", "--grace", "2"],
                               [WORKER, "die"], timeout=180)
  report = proc.stderr
  assert proc.returncode == 1, report
  assert seconds < 90, f"launcher took {seconds:.0f} s"
  assert "[p1] step 1 done" in proc.stdout            # it died mid-run, after real steps
  assert "process 1 (pid" in report and "failed first: exited with status 1" in report
  summary = report[report.index("failed first"):]
  assert "RuntimeError: multihost_worker: process 1 fails on purpose at step 1" in summary
  for line in proc.stdout.splitlines():
    if "pid" in line and line.startswith("[p"):
      assert not alive(int(line.split("pid ")[1].split(":")[0])), line


def _script(tmp_path, body):
  path = tmp_path / "script.py"
  path.write_text(textwrap.dedent(body))
  return str(path)


def test_launcher_kills_hung_peers_and_their_children(tmp_path):
  """Process 1 exits 3; process 0 (and a child it started) would sleep for minutes."""
  script = _script(tmp_path, """
      import os, subprocess, sys, time
      pid = int(os.environ["JAX_PROCESS_ID"])
      assert os.environ["JAX_NUM_PROCESSES"] == "3"
      assert os.environ["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
      assert "--xla_force_host_platform_device_count=2" in os.environ["XLA_FLAGS"]
      if pid == 1:
          time.sleep(0.5)
          sys.exit("process 1: bad input on purpose")
      child = subprocess.Popen(["sleep", "300"])
      print("child", child.pid, flush=True)
      time.sleep(300)
  """)
  proc, seconds = run_launcher(["--processes", "3", "--devices-per-process", "2",
                                "--timeout", "60", "--grace", "1"], [script], timeout=90)
  assert proc.returncode == 1, proc.stderr
  assert seconds < 30
  assert "[p1] process 1: bad input on purpose" in proc.stderr
  assert "process 1 (pid" in proc.stderr and "failed first" in proc.stderr
  children = [int(line.split()[-1]) for line in proc.stdout.splitlines() if " child " in line]
  assert len(children) == 2
  time.sleep(0.2)
  assert not any(alive(c) for c in children), "a grandchild outlived the launcher"


def test_launcher_timeout_and_sigterm(tmp_path):
  script = _script(tmp_path, """
      import time
      print("started", flush=True)
      time.sleep(300)
  """)
  proc, seconds = run_launcher(["--processes", "2", "--devices-per-process", "1",
                                "--timeout", "2", "--grace", "1"], [script], timeout=60)
  assert proc.returncode == launch.TIMEOUT_STATUS and seconds < 20
  assert "timeout after 2 s" in proc.stderr and proc.stdout.count("started") == 2

  env = dict(os.environ, PYTHONPATH=ROOT)
  runner = subprocess.Popen([sys.executable, "-m", "zeco_jax.runtime.launch", "--processes", "2",
                             "--devices-per-process", "1", "--grace", "1", "--", script],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
  try:
    for _ in range(2):      # both children are up once each printed its line
      assert "started" in runner.stdout.readline()
    runner.send_signal(signal.SIGTERM)
    _, err = runner.communicate(timeout=30)
  finally:
    if runner.poll() is None:
      runner.kill()
  assert runner.returncode == 128 + signal.SIGTERM, err
  assert "received SIGTERM" in err


def test_launcher_success_and_module_programs(tmp_path):
  (tmp_path / "hello_mod.py").write_text(
      "import os\nprint('hello from', os.environ['JAX_PROCESS_ID'])\n")
  proc, _ = run_launcher(["--processes", "2", "--devices-per-process", "1", "--timeout", "30"],
                         ["-m", "hello_mod"], timeout=60, pythonpath=[str(tmp_path)])
  assert proc.returncode == 0, proc.stderr
  assert "[p0] hello from 0" in proc.stdout and "[p1] hello from 1" in proc.stdout


def test_child_runs_the_program_as_python_and_stamps_its_exception(tmp_path):
  """``_launch_child``: a script runs as ``__main__`` with its argv and its folder on
  sys.path; an uncaught exception writes its monotonic time to stderr first."""
  (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
  (tmp_path / "prog.py").write_text(textwrap.dedent("""\
      import sys, helper_mod
      print(__name__, sys.argv[1:], helper_mod.VALUE, flush=True)
      raise RuntimeError("on purpose")
  """))
  before = time.monotonic()
  proc = subprocess.run([sys.executable, "-u", launch._CHILD, str(tmp_path / "prog.py"), "a",
                         "b"], capture_output=True, text=True, timeout=60, cwd=ROOT)
  assert proc.returncode == 1 and proc.stdout == "__main__ ['a', 'b'] 7\n", proc
  first, rest = proc.stderr.split("\n", 1)
  assert first.startswith(launch.MARK), proc.stderr
  assert before <= float(first[len(launch.MARK):]) <= time.monotonic()
  assert rest.startswith("Traceback") and "RuntimeError: on purpose" in rest


def test_failures_are_ordered_by_the_processes_own_stamps():
  """Process 1 raised first (its stamp), though its lines reach the launcher after process
  0's traceback (a reader thread late on a loaded machine): it is the one that failed first,
  and the stamp line is not forwarded."""
  import io
  runner = launch.Launcher(["true"], 2, 1, stdout=io.StringIO(), stderr=io.StringIO())
  runner._forward(0, io.BytesIO(b"Traceback (most recent call last)\nRuntimeError: peer\n"),
                  runner.err)
  stamp = time.monotonic() - 5.0
  runner._forward(1, io.BytesIO(f"{launch.MARK}{stamp:.6f}\nTraceback (most "
                                f"recent call last)\nRuntimeError: on purpose\n".encode()),
                  runner.err)
  assert runner._died_at(1) < runner._died_at(0)
  assert launch.MARK not in runner.err.getvalue()
  assert list(runner.tails[1])[-1] == "RuntimeError: on purpose"


# --- settings ------------------------------------------------------------------------------

ENV_KEYS = (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
            distributed.ENV_PROCESS_ID, distributed.ENV_LOCAL_DEVICE_COUNT)


@pytest.fixture
def clean_env(monkeypatch):
  for key in ENV_KEYS:
    monkeypatch.delenv(key, raising=False)
  return monkeypatch


def test_initialize_single_process_is_a_no_op(clean_env, devices):
  info = distributed.initialize(auto_detect=False)
  assert (info.process_id, info.num_processes, info.source) == (0, 1, "single")
  info = distributed.initialize(num_processes=1, local_device_count=len(devices))
  assert info.num_processes == 1 and not jax.distributed.is_initialized()
  with pytest.raises(RuntimeError, match="already started with 8 CPU devices"):
    distributed.initialize(num_processes=1, local_device_count=4)
  assert distributed.is_main_process()


@pytest.mark.parametrize("kwargs,env,match", [
    (dict(num_processes=2), {}, "partial multi-process settings.*--coordinator"),
    (dict(coordinator_address="127.0.0.1:1234"), {}, "--num-processes.*--process-id"),
    (dict(num_processes=2, process_id=2, coordinator_address="h:1"), {}, "out of range"),
    (dict(num_processes=1, process_id=1), {}, "out of range"),
    (dict(process_id=1), {}, "partial multi-process settings"),
    (dict(coordinator_address="no-port", num_processes=2, process_id=0), {}, "HOST:PORT"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES.*not an integer"),
    ({}, {"JAX_PROCESS_ID": "1"}, "partial multi-process settings"),
    (dict(num_processes=0), {}, "num_processes must be >= 1"),
    (dict(local_device_count=0), {}, "local_device_count must be >= 1"),
])
def test_initialize_rejects_partial_or_inconsistent_settings(clean_env, kwargs, env, match):
  for key, value in env.items():
    clean_env.setenv(key, value)
  with pytest.raises(ValueError, match=match):
    distributed.initialize(auto_detect=False, **kwargs)


def test_initialize_multi_process_after_backend_start_is_refused(clean_env, devices):
  with pytest.raises(RuntimeError, match="call initialize first"):
    distributed.initialize("127.0.0.1:1234", 2, 0, auto_detect=False)


def test_cli_flags_round_trip(clean_env, devices):
  import argparse
  parser = distributed.add_cli_args(argparse.ArgumentParser())
  args = parser.parse_args(["--coordinator", "10.0.0.1:1234", "--num-processes", "4",
                            "--process-id", "3"])
  assert (args.coordinator, args.num_processes, args.process_id) == ("10.0.0.1:1234", 4, 3)
  assert distributed.from_cli(parser.parse_args([]), auto_detect=False).num_processes == 1


def test_global_batch_and_local_index_in_one_process(devices):
  from jax.sharding import PartitionSpec as P
  mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "seq"))
  x = np.arange(4 * 16, dtype=np.int32).reshape(4, 16)
  idx = distributed.process_local_index(x.shape, mesh, P("data", "seq"))
  assert idx == (slice(0, 4), slice(0, 16))
  batch = distributed.global_batch({"inputs": x[idx], "mask": x[idx] > 3}, mesh,
                                   P("data", "seq"))
  assert batch["inputs"].sharding.spec == P("data", "seq")
  np.testing.assert_array_equal(np.asarray(batch["inputs"]), x)
  np.testing.assert_array_equal(np.asarray(batch["mask"]), x > 3)
