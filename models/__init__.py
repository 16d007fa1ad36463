"""Flax NNX layers and the GLA language model, with logical-axis sharding rules."""
from models.gla import GLABlock, GLAConfig, GLALM, GLAMixer, RMSNorm, SwiGLU, gla_op, num_params
from models import sharding

__all__ = ["GLABlock", "GLAConfig", "GLALM", "GLAMixer", "RMSNorm", "SwiGLU", "gla_op",
           "num_params", "sharding"]
