"""Language modelling: the model family's own loss (next-token cross-entropy over the counted targets)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.errors import ConfigError
from mintrain.models.layers import merge
from mintrain.objectives.objective import Batch, LossFn, Objective


def check(config) -> None:
  if config.data.pairs:
    raise ConfigError("data.format='preference' holds (chosen, rejected) pairs, which train.objective='lm' "
                      "cannot learn from; set train.objective='dpo', or use text or chat data.")
  if config.data.format == 'prompt':
    raise ConfigError("data.format='prompt' holds prompts to sample completions of, which "
                      "train.objective='lm' cannot learn from; set train.objective='grpo'.")


def loss(params: nnx.State, graphdef: nnx.GraphDef, batch: Batch, dropout_key: jax.Array | None,
         frozen: nnx.State | None = None, reference: nnx.State | None = None
         ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
  """The family's mean loss, plus its statistics' `aux_loss` if any (an MoE router's balancing losses);
  the metrics are that mean loss as `loss` and every statistic. `frozen` (LoRA's base) takes part."""
  del reference
  mean, count, stats = merge(graphdef, params, frozen).loss(batch, dropout_key=dropout_key)
  objective = mean + stats['aux_loss'] if 'aux_loss' in stats else mean
  return objective, (jnp.asarray(count, jnp.float32), {'loss': mean, **stats})


def make_loss(config) -> LossFn:
  del config
  return loss


OBJECTIVE = Objective(check=check, make_loss=make_loss)
