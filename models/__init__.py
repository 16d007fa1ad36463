"""The language models of the trainer: one shared LM (:mod:`models.lm`) around each family's
token mixer, the families' registry, the data and the sharding rules.

:data:`FAMILIES` maps ``model.family`` to its :class:`Family`: the config class (a frozen
dataclass with its own fields and checks, :mod:`models.gla`, :mod:`models.gdn`,
:mod:`models.kda`) and the
function that builds its token mixer. :func:`model_from_config` turns a config's ``model``
section into the family's config and :class:`~models.lm.LM`.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable, Mapping

from models import sharding
from models.config import LMConfig
from models.gdn import GDNConfig, gdn_layer
from models.gla import GLAConfig, gla_layer
from models.kda import KDAConfig, kda_layer
from models.lm import LM, Block, SwiGLU, num_params


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its name (``model.family``), config class and token-mixer builder."""
  name: str
  config: type
  layer: Callable


FAMILIES: Mapping[str, Family] = types.MappingProxyType({f.name: f for f in (
    Family("gla", GLAConfig, gla_layer),
    Family("gdn", GDNConfig, gdn_layer),
    Family("kda", KDAConfig, kda_layer),
)})


def family_of(cfg) -> Family:
  """The :class:`Family` whose config class ``cfg`` is."""
  for family in FAMILIES.values():
    if type(cfg) is family.config:
      return family
  raise ValueError(f"{type(cfg).__name__} is not a model family's config; the families are "
                   f"{', '.join(FAMILIES)}")


def all_fields() -> dict:
  """Every family's config fields with their defaults: the config files' ``model`` section
  (a field two families share has one default)."""
  out = {}
  for family in FAMILIES.values():
    for field in dataclasses.fields(family.config):
      out.setdefault(field.name, field)
  return out


def model_from_config(model: dict):
  """``(config, LM)`` for a config's ``model`` section: ``family`` picks the config class
  (no family means GLA); a field of another family set away from its default is an error
  (it would be silently unused)."""
  fields = dict(model)
  name = fields.pop("family", "gla")
  if name not in FAMILIES:
    raise ValueError(f"model.family must be one of {tuple(FAMILIES)}, got {name!r}")
  cls = FAMILIES[name].config
  own = {f.name for f in dataclasses.fields(cls)}
  others = all_fields()
  for key, value in fields.items():
    if key not in own and key in others and value != others[key].default:
      raise ValueError(f"model.{key}={value!r} is not a setting of model.family={name!r} "
                       f"(its fields: {', '.join(sorted(own))}); leave it at its default "
                       f"{others[key].default!r}")
  return cls(**{k: v for k, v in fields.items() if k in own}), LM


__all__ = ["Block", "FAMILIES", "Family", "GDNConfig", "GLAConfig", "KDAConfig", "LM",
           "LMConfig", "SwiGLU",
           "all_fields", "family_of", "model_from_config", "num_params", "sharding"]
