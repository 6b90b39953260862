"""What a training objective gives the train step, so that nothing outside `mintrain/objectives/` asks which
objective runs (as a model family's bundle, `mintrain.models.family`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

Batch = dict[str, jax.Array]
# (params, graphdef, batch, dropout_key, frozen, reference) -> (objective, (count, metrics)): the value to
# differentiate, how many units (targets, pairs) it averages over, and scalar metrics that hold `loss`.
# Micro-batches are weighted by their counts. `frozen` are the state's frozen variables (LoRA's base) and
# `reference` its reference model (or None each).
LossFn = Callable[[nnx.State, nnx.GraphDef, Batch, jax.Array | None, nnx.State | None, nnx.State | None],
                  tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]]
# (state, step, data batch) -> (train batch, host metrics): an objective's per-step hook on the host.
Rollout = Callable[[Any, int, Any], tuple[Batch, dict[str, float]]]


@dataclasses.dataclass(frozen=True)
class Objective:
  # (config) -> None: a ConfigError for options the objective cannot train with (`mintrain.config.Config`,
  # read before any file or device is touched).
  check: Callable[[Any], None]
  # (config) -> its LossFn.
  make_loss: Callable[[Any], LossFn]
  # (config) -> whether the state keeps a frozen reference model beside the trained parameters.
  keeps_reference: Callable[[Any], bool] = lambda config: False
  # (config) -> sequences each batch row sends through the trained model (a DPO pair: 2): what the tokens
  # per step and the activations of the memory plan scale by (`mintrain.report`).
  sequences_per_row: Callable[[Any], int] = lambda config: 1
  # (config) -> a batch row's FLOPs in one sequence's forward and backward passes (a forward pass without
  # gradient, a reference model's, is a third of that, as the backward is twice the forward).
  flops_factor: Callable[[Any], float] = lambda config: 1.0
  # (run, state, batches, eval_batches, *, fresh, workdir, is_main, say) -> (batches, eval_batches): the
  # iterators the run reads from, given the state it starts with (`fresh(split)` reads a split anew), once
  # every check has passed; the data's own by default.
  prepare_batches: Callable[..., tuple[Any, Any]] = lambda run, state, batches, eval_batches, **_: (
      batches, eval_batches)
  # (config, tokenizer) -> the batches of what the objective reads itself (GRPO's whole prompt records), or
  # None: the data layer's global batches (`mintrain.data.batches.make_batches`).
  read_batches: Callable[[Any, Any], Any] | None = None
  # (config) -> optimizer updates each step makes on its batch (GRPO's grpo.num_iterations).
  updates_per_step: Callable[[Any], int] = lambda config: 1
  # (run, tokenizer, train batches) -> None, or the per-step host hook (state, step, data batch) -> (train
  # batch, host metrics) that turns what the data gives (GRPO's prompts) into the batch the step learns from.
  # Made before the run writes anything, so bad input it finds stops the run clean.
  make_rollout: Callable[[Any, Any, Any], Rollout | None] = lambda run, tok, batches: None


def reference(keeps: bool, params: nnx.State) -> nnx.State | None:
  """The frozen reference model a fresh state starts with: the initial parameters themselves (copied, so
  that donating the state never frees them), or None. The one place that says what the reference is."""
  if not keeps:
    return None
  return jax.tree.map(lambda x: x.copy(), params)
