"""Test setup: 8 simulated CPU devices and unoptimized CPU code generation, set before jax
is imported anywhere; the fixtures every folder uses (the device list, a persistent
compilation cache per module).

pytest imports this file first and puts its folder, tests/, on ``sys.path``: the test
modules of every subfolder import ``helpers`` and ``shape_sweep`` from there."""
import os

# --xla_backend_optimization_level=0: XLA:CPU's LLVM code generation unoptimized. The tests'
# programs are small and compiled once each, so compiling is most of their time: the Gated
# DeltaNet shape tests took 43 s instead of 77 s on a 2-core machine like CI's. The HLO
# (its fusions, the YNN miscompile of docs/xla_cpu_ynn.md included) is the same; only the
# machine code is less optimized.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

from helpers import persistent_compilation_cache  # noqa: E402


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated CPU devices, got {len(devs)}"
  return devs


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """A persistent compilation cache in a temporary folder for one test module (and the
  subprocesses it starts, through ``helpers.persistent_cache_env``), the settings restored
  afterwards: a program compiled once in the module (the same HLO: the same training
  program in a new Experiment, the same Pallas kernel traced again) is loaded instead of
  compiled again. It changes no program, only skips compiling it twice."""
  with persistent_compilation_cache(tmp_path_factory.mktemp("compile_cache")) as path:
    yield path
