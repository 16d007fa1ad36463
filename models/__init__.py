"""The GLA language model (on :mod:`zeco_jax.nn`'s layers), its data and sharding rules."""
from models.gla import GLABlock, GLAConfig, GLALM, SwiGLU, gla_layer, num_params
from models import sharding

__all__ = ["GLABlock", "GLAConfig", "GLALM", "SwiGLU", "gla_layer", "num_params", "sharding"]
