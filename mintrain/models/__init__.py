"""Model families by `config.model.name`; each is one module that owns everything about itself.

A new family is a folder here whose `__init__` has a `FAMILY` (`family.Family`), and one line in
`FAMILIES`; a test or a user script may also register one at run time (`FAMILIES['name'] = ...`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from etils import epath

from mintrain.errors import ConfigError
from mintrain.models import mlp, transformer
from mintrain.models.family import Family

FAMILIES: dict[str, Family] = {
    'transformer': transformer.FAMILY,
    'mlp': mlp.FAMILY,
}


def hf_model_options(path: str | os.PathLike) -> dict[str, Any]:
  """The `model` section (with `name`) for the Hugging Face directory at `path`, from its config.json."""
  file = epath.Path(path) / 'config.json'
  try:
    hf = json.loads(file.read_text())
  except FileNotFoundError:
    raise ConfigError(f'{path} is not a Hugging Face model directory: it has no config.json.') from None
  except ValueError as e:
    raise ConfigError(f'{file} is not valid JSON: {e}.') from None
  if not isinstance(hf, dict):
    raise ConfigError(f'{file} holds a JSON {type(hf).__name__}, not an object of model settings: use the '
                      'config.json saved with these weights.')
  return FAMILIES[family_for_hf(hf.get('model_type'))].hf.model_options(hf)


def family_for_hf(model_type: str | None) -> str:
  """The name of the family that reads Hugging Face checkpoints of `model_type`."""
  for name, candidate in FAMILIES.items():
    if candidate.hf is not None and model_type in candidate.hf.MODEL_TYPES:
      return name
  known = sorted(t for f in FAMILIES.values() if f.hf is not None for t in f.hf.MODEL_TYPES)
  raise ConfigError(f'config.json model_type={model_type!r} is not supported; mintrain reads '
                    f'{", ".join(known)}; convert the checkpoint to one of these, or give a model family '
                    'that reads it a Hugging Face conversion (`Family.hf`).')


def family(name: str) -> Family:
  if name not in FAMILIES:
    raise ConfigError(f'model.name={name!r}; choose one of {sorted(FAMILIES)}.')
  return FAMILIES[name]
