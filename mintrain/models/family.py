"""What a model family gives the rest of mintrain, so that nothing outside `mintrain/models/` asks which
model it runs (torchtitan's model bundle, kept to a dataclass of functions).

Every function takes the family's own typed config (`config`, a dataclass of `fields.option`s) first.
Weight decay is not here: each parameter says whether it takes it (`layers.param(..., decay=...)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from mintrain.partitioning import AxisRules

# How many ways activations split along a logical axis on the run's mesh (`AxisRules.ways`).
Ways = Callable[[str], int]


def _same(cfg: Any, platform: str, ways: Ways) -> Any:
  return cfg


def _no_notes(cfg: Any) -> list[str]:
  return []


def _no_extra_metrics(cfg: Any, loss: float) -> dict[str, float]:
  return {}


def _no_check(cfg: Any, seq_len: int) -> None:
  pass


def _float32(cfg: Any) -> str:
  return 'float32'


@dataclasses.dataclass(frozen=True)
class Family:
  config: type  # Frozen dataclass of the `model` section's options.
  # The module, with `loss(inputs, targets, *, dropout_key)`: the loss, or (loss, statistics) where the
  # statistics are metrics and their `aux_loss` (e.g. an MoE router's losses) joins the objective.
  make: Callable[[Any, AxisRules, nnx.Rngs], nnx.Module]
  param_count: Callable[[Any], int]
  train_flops_per_row: Callable[[Any, int, bool], float]  # (cfg, seq_len, causal_half): forward + backward.
  tokens_per_row: Callable[[Any, int], int]  # (cfg, seq_len): what throughput counts per batch row.
  activation_bytes: Callable[[Any, int, int, Ways], int]  # (cfg, rows, seq_len, ways) kept for backward.
  # (cfg, seed, step, rows, seq_len): rows of a synthetic batch, a pure function of (seed, step, row).
  synthetic_rows: Callable[[Any, int, int, np.ndarray, int], dict[str, np.ndarray]]
  # (cfg, platform, ways): options left to 'auto' set for 'cpu', 'gpu' or 'tpu', and whatever depends on
  # how the run's mesh splits the logical axes (e.g. key/value heads too few to split are replicated).
  for_mesh: Callable[[Any, str, Ways], Any] = _same
  notes: Callable[[Any], list[str]] = _no_notes  # What `for_mesh` changed that a user should read.
  eval_metrics: Callable[[Any, float], dict[str, float]] = _no_extra_metrics  # Beyond loss and perplexity.
  check: Callable[[Any, int], None] = _no_check  # (cfg, seq_len): raises ConfigError across sections.
  compute_dtype: Callable[[Any], str] = _float32  # Of its matmuls: which peak FLOP/s MFU divides by.
  # Its Hugging Face conversion (a module like `models.hf_llama`: MODEL_TYPES, model_options, config_json,
  # weight_names, their_shape, read, write), or None.
  hf: Any = None
