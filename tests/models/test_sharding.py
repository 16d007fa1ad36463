"""models/sharding.py: every parameter of the LM has logical axes and a rule that maps
them to mesh axes; the rules come from the config, and unknown logical axes are refused."""
import jax
import pytest
from flax import nnx

from helpers import tiny_model_config
from models import LM, sharding

SMALL = tiny_model_config()


def test_every_param_has_logical_axes_and_a_rule():
  model = LM(SMALL, rngs=nnx.Rngs(0))
  axes = sharding.logical_axes(model)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert jax.tree.structure(params) == jax.tree.structure(
      sharding.param_specs(axes), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert axes["embed"] == ("vocab", "embed")
  assert axes["block_0"]["attn"]["q_proj"] == ("embed", "heads")
  fsdp = sharding.rules_from_config({"embed": "data"})
  assert sharding.logical_to_spec(("vocab", "embed"), fsdp) == jax.sharding.PartitionSpec(
      None, "data")
  with pytest.raises(ValueError, match="unknown logical axes"):
    sharding.rules_from_config({"embedding": "data"})
