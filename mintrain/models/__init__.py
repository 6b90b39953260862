"""Model constructors by `config.model.name`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from mintrain.models.mlp import MLP, MLPConfig
from mintrain.models.transformer import Transformer, TransformerConfig
from mintrain.partitioning import AxisRules

MODELS = {
    'transformer': (Transformer, TransformerConfig),
    'mlp': (MLP, MLPConfig),
}


def model_config(model: Mapping[str, Any]) -> TransformerConfig | MLPConfig:
  """The dataclass config of `config.model` (its `name` picks the model)."""
  name = model['name']
  if name not in MODELS:
    raise ValueError(f'Unknown model.name={name!r}; choose one of {sorted(MODELS)}.')
  fields = {k: v for k, v in model.items() if k != 'name'}
  if 'hidden_dims' in fields:
    fields['hidden_dims'] = tuple(fields['hidden_dims'])
  return MODELS[name][1](**fields)


def make_model(model: Mapping[str, Any], rules: AxisRules, seed: int) -> nnx.Module:
  name = model['name']
  cls, _ = MODELS[name]
  return cls(model_config(model), rules=rules, rngs=nnx.Rngs(params=seed))
