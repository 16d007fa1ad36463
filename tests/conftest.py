"""Test setup: 8 simulated CPU devices, made before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def rel_err(a, b):
  """||a - b|| / ||b|| in float64 on the host: the tolerance measure every test states."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  denom = np.linalg.norm(b)
  assert denom > 0, "reference is all zeros: the comparison would prove nothing"
  return float(np.linalg.norm(a - b) / denom)


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated CPU devices, got {len(devs)}"
  return devs
