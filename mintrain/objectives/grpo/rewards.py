"""Reward functions (`grpo.reward`): Python callables named 'package.module:function', called on the host as
TRL calls its reward functions, `function(prompts=[...], completions=[...], completion_ids=[[...]], **fields)`
with the records' other fields as lists, each returning one float per completion. Several add up, weighted."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mintrain.errors import ConfigError, RewardError


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str  # 'package.module:function', as configured.
  function: Callable[..., Sequence[float]]
  weight: float


def load(spec: str, weights: Sequence[float]) -> list[Reward]:
  """The comma-separated 'module:function' callables of `spec`, imported, with their weights (all 1.0 if
  none are given); a one-line ConfigError names one that cannot be imported."""
  names = [name.strip() for name in spec.split(',') if name.strip()]
  if not names:
    raise ConfigError("train.objective='grpo' needs grpo.reward, e.g. 'my_rewards:exact_answer' (a module on "
                      'the Python path and a function in it).')
  if weights and len(weights) != len(names):
    raise ConfigError(f'grpo.reward_weights has {len(weights)} weights for {len(names)} reward functions; '
                      'give one per function, or none.')
  rewards = []
  for name, weight in zip(names, weights or [1.0] * len(names), strict=True):
    module_name, _, attribute = name.partition(':')
    if not module_name or not attribute:
      raise ConfigError(f"grpo.reward: {name!r} is not 'package.module:function'.")
    try:
      module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is theirs to fix.
      raise ConfigError(f'grpo.reward: module {module_name!r} cannot be imported ({type(e).__name__}: '
                        f'{_one_line(e)}); put it on the Python path (PYTHONPATH).') from None
    function = getattr(module, attribute, None)
    if not callable(function):
      raise ConfigError(f'grpo.reward: module {module_name!r} has no function {attribute!r}.')
    rewards.append(Reward(name, function, float(weight)))
  return rewards


def score(rewards: Sequence[Reward], prompts: list[Any], completions: list[Any],
          completion_ids: list[list[int]], fields: dict[str, list[Any]],
          where: list[str]) -> tuple[np.ndarray, dict[str, float]]:
  """(weighted sum of the rewards of each completion (float32), each function's mean). A RewardError names
  the function and the record (`where`) it failed on, or the count it returned."""
  total_B = np.zeros(len(completions), np.float64)
  means = {}
  for reward in rewards:
    values = _call(reward, prompts, completions, completion_ids, fields, where)
    total_B += reward.weight * values
    means[reward.name] = float(np.mean(values))
  return total_B.astype(np.float32), means


def _call(reward: Reward, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
          fields: dict[str, list[Any]], where: list[str]) -> np.ndarray:
  try:
    values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                             **fields)
  except Exception as e:  # noqa: BLE001 - find the record it fails on, to name it.
    for i in range(len(completions)):
      try:
        reward.function(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                        completion_ids=completion_ids[i:i + 1], **{k: v[i:i + 1] for k, v in fields.items()})
      except Exception as one:  # noqa: BLE001
        raise RewardError(f'grpo.reward {reward.name} failed on the record at {where[i]} with completion '
                          f'{completions[i]!r}: {type(one).__name__}: {_one_line(one)}') from None
    raise RewardError(f'grpo.reward {reward.name} failed on a batch of {len(completions)} completions: '
                      f'{type(e).__name__}: {_one_line(e)}') from None
  try:
    values = [float(v) for v in values]
  except (TypeError, ValueError):
    raise RewardError(f'grpo.reward {reward.name} returned {type(values).__name__}, not a list of numbers '
                      '(one per completion).') from None
  if len(values) != len(completions):
    raise RewardError(f'grpo.reward {reward.name} returned {len(values)} values for {len(completions)} '
                      'completions; it must return one per completion.')
  bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
  if bad is not None:
    raise RewardError(f'grpo.reward {reward.name} returned {values[bad]} for the record at {where[bad]}; '
                      'rewards must be finite.')
  return np.asarray(values, np.float64)


def _one_line(e: BaseException) -> str:
  return ' '.join(str(e).split()) or type(e).__name__
