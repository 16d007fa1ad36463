"""Test setup: 8 simulated CPU devices, made before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

from helpers import rel_err  # noqa: E402,F401  (also importable from conftest)


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated CPU devices, got {len(devs)}"
  return devs
