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


def _no_vocab(cfg: Any) -> int | None:
  return None


def _ignore_tokenizer(cfg: Any, num_ids: Callable[[], int]) -> Any:
  return cfg


@dataclasses.dataclass(frozen=True)
class Family:
  config: type  # Frozen dataclass of the `model` section's options.
  # The module, with `loss(batch, *, dropout_key) -> (mean loss, count of what it averages over,
  # statistics)`: the batch is a dict of arrays ('inputs', 'targets' and whatever else the data gives, such
  # as packed rows' 'segment_ids'); a family reads the keys it knows. The statistics ({} if none) are scalar
  # metrics; their `aux_loss` (e.g. an MoE router's balancing losses) joins the objective. Micro-batches
  # are weighted by their counts, in the loss, the gradients and the statistics alike.
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
  # Beyond loss, perplexity and (on text) bits per byte, from the mean eval loss.
  eval_metrics: Callable[[Any, float], dict[str, float]] = _no_extra_metrics
  check: Callable[[Any, int], None] = _no_check  # (cfg, seq_len): raises ConfigError across sections.
  compute_dtype: Callable[[Any], str] = _float32  # Of its matmuls: which peak FLOP/s MFU divides by.
  # Token ids it reads (its embedding rows); None: data ids are checked against the tokenizer's alone.
  vocab_size: Callable[[Any], int | None] = _no_vocab
  # (cfg, num_ids): the config for a tokenizer of num_ids() ids (called only when the config defers to it,
  # e.g. a vocabulary size 'from the tokenizer').
  for_tokenizer: Callable[[Any, Callable[[], int]], Any] = _ignore_tokenizer
  # Its Hugging Face conversion (a module like `models.hf_llama`: MODEL_TYPES, model_options, config_json,
  # weight_names, their_shape, read, write), or None.
  hf: Any = None
