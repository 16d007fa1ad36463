"""The wheel: only the library (zeco_jax, pallas_kernels), and from it alone a user's NNX model
runs the GLA layer of ``zeco_jax.nn`` forward and backward.

The wheel is built from a copy of the source tree (so no ``build/`` or ``*.egg-info`` is
left in the checkout), installed with ``pip install --target`` into a temporary folder, and
imported by a subprocess started in another temporary folder whose ``sys.path`` is that
folder plus this interpreter's site-packages: ``-I -S`` keeps out the repository, the
environment's PYTHONPATH and the ``.pth`` files (among them the editable install's finder,
which would map ``zeco_jax`` back to the checkout).
"""
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from helpers import ROOT

USER_PROGRAM = r'''
import sys
target, site_dirs = sys.argv[1], sys.argv[2:]
sys.path[:] = [target] + sys.path + site_dirs      # no repository, no .pth files

import jax
import jax.numpy as jnp
from flax import nnx
import zeco_jax
from zeco_jax.nn import GatedLinearAttention, RMSNorm

assert zeco_jax.__file__.startswith(target), zeco_jax.__file__
for name in ("models", "configs"):
  try:
    __import__(name)
  except ModuleNotFoundError:
    pass
  else:
    raise AssertionError(f"{name} is importable: {sys.modules[name].__file__}")


class UserModel(nnx.Module):
  """Someone else's model: an embedding, one pre-norm GLA mixer, a readout."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(50, 32, rngs=rngs)
    self.norm = RMSNorm(32)
    self.mixer = GatedLinearAttention(32, 2, use_short_conv=True, chunk_size=16, rngs=rngs)
    self.head = nnx.Linear(32, 5, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.mixer(self.norm(x))
    return self.head(x.mean(axis=1))


model = UserModel(nnx.Rngs(0))
tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 50)
labels = jnp.array([1, 3])


@nnx.jit
def loss_and_grad(model, tokens, labels):
  def loss_fn(model):
    logits = model(tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
  return nnx.value_and_grad(loss_fn)(model)


loss, grads = loss_and_grad(model, tokens, labels)
grad_mixer = grads.mixer.q_proj[...]
assert jnp.isfinite(loss) and grad_mixer.shape == (32, 16), (loss, grad_mixer.shape)
assert float(jnp.abs(grad_mixer).sum()) > 0
print("ok", zeco_jax.__file__, float(loss))
'''


def _ignore(folder, names):
  """What a fresh clone would not have: VCS and tool folders, build outputs, caches, runs."""
  skip = {"__pycache__", "build", "dist", "runs", "checkpoints"}
  return [n for n in names if n.startswith(".") or n in skip or n.endswith(".egg-info")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  base = tmp_path_factory.mktemp("packaging")
  src = base / "src"
  shutil.copytree(ROOT, src, ignore=_ignore)
  cmd = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(base / "dist")]
  proc = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  (path,) = (base / "dist").glob("zeco_jax-*.whl")
  return path


def test_wheel_holds_only_the_library(wheel):
  with zipfile.ZipFile(wheel) as zf:
    top = {name.split("/")[0] for name in zf.namelist()}
  dist_info = {t for t in top if t.endswith(".dist-info")}
  assert top - dist_info == {"zeco_jax", "pallas_kernels"}, sorted(top)
  names = set(zf.namelist())
  for module in ("zeco_jax/nn/__init__.py", "zeco_jax/sp/scan.py", "zeco_jax/ops/gla/op.py",
                 "zeco_jax/ops/gated_delta/op.py", "zeco_jax/runtime/target.py",
                 "pallas_kernels/__init__.py", "pallas_kernels/gla/gpu.py"):
    assert module in names, module


def test_user_model_runs_the_gla_layer_from_the_wheel(wheel, tmp_path):
  target = tmp_path / "site"
  proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                         "--target", str(target), str(wheel)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  site_dirs = list(dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"]]))
  program = tmp_path / "user_model.py"
  program.write_text(USER_PROGRAM)
  run_dir = tmp_path / "elsewhere"
  run_dir.mkdir()
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-I", "-S", str(program), str(target), *site_dirs],
                        cwd=run_dir, env=env, capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  assert proc.stdout.startswith("ok " + str(target)), proc.stdout
