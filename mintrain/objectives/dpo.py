"""Direct preference optimisation (DPO, Rafailov et al. 2023) and its relatives, as TRL's `DPOTrainer`
defines them: each pair's chosen and rejected responses are scored by the summed log-probability of their
tokens (the batch's `target_weights`: the response, never the prompt) under the policy and under the frozen
reference model (the initial weights, `objective.reference`), and the loss pushes the policy's log-ratio
of chosen over rejected above the reference's.

A batch holds pairs: every array is (B, 2, L), [:, 0] the prompt and chosen response, [:, 1] the prompt and
rejected response (`data.format='preference'`); they go through the model as 2B rows, chosen and rejected
side by side, so a pair never spans devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.errors import ConfigError
from mintrain.fields import option
from mintrain.models.layers import merge
from mintrain.objectives.objective import Batch, LossFn, Objective

LOSSES = ('sigmoid', 'ipo', 'hinge', 'simpo')


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  beta: float = option(above=0)
  loss: str = option(choices=LOSSES)
  label_smoothing: float = option(at_least=0, below=0.5)
  gamma: float = option(at_least=0)


def check(config) -> None:
  if config.data.format != 'preference':
    raise ConfigError(f"train.objective='dpo' learns from (prompt, chosen, rejected) records; "
                      f"data.format={config.data.format!r} has none. Set data.format='preference' (and "
                      "data.source='jsonl' or 'parquet').")
  if config.dpo.label_smoothing and config.dpo.loss not in ('sigmoid', 'simpo'):
    raise ConfigError(f'dpo.label_smoothing={config.dpo.label_smoothing} applies to the sigmoid and simpo '
                      f"losses, not dpo.loss={config.dpo.loss!r}; set it to 0 or choose one of those.")


def pair_losses(cfg: DPOConfig, chosen_P: jax.Array, rejected_P: jax.Array, ref_chosen_P: jax.Array | None,
                ref_rejected_P: jax.Array | None, chosen_tokens_P: jax.Array, rejected_tokens_P: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(loss, chosen reward, rejected reward) of each of P pairs from the summed log-probabilities of their
  responses (and response lengths): TRL's `dpo_loss`. 'ipo' compares length-averaged log-probabilities,
  as TRL does; 'simpo' (Meng et al. 2024) is reference-free, length-averaged, with a target margin gamma."""
  beta = cfg.beta
  if cfg.loss == 'simpo':
    chosen_P, rejected_P = chosen_P / chosen_tokens_P, rejected_P / rejected_tokens_P
    logits_P = chosen_P - rejected_P - cfg.gamma / beta
    chosen_rewards_P, rejected_rewards_P = beta * chosen_P, beta * rejected_P
  else:
    if cfg.loss == 'ipo':
      chosen_P, rejected_P = chosen_P / chosen_tokens_P, rejected_P / rejected_tokens_P
      ref_chosen_P = ref_chosen_P / chosen_tokens_P
      ref_rejected_P = ref_rejected_P / rejected_tokens_P
    logits_P = (chosen_P - rejected_P) - (ref_chosen_P - ref_rejected_P)
    chosen_rewards_P = beta * (chosen_P - ref_chosen_P)
    rejected_rewards_P = beta * (rejected_P - ref_rejected_P)
  if cfg.loss in ('sigmoid', 'simpo'):
    smoothing = cfg.label_smoothing
    losses_P = (-jax.nn.log_sigmoid(beta * logits_P) * (1 - smoothing)
                - jax.nn.log_sigmoid(-beta * logits_P) * smoothing)
  elif cfg.loss == 'hinge':
    losses_P = jax.nn.relu(1 - beta * logits_P)
  else:
    losses_P = (logits_P - 1 / (2 * beta)) ** 2
  return losses_P, chosen_rewards_P, rejected_rewards_P


def _rows(batch: Batch) -> Batch:
  """(B, 2, L) pair arrays as (2B, L) rows: chosen and rejected of pair i at rows 2i and 2i + 1."""
  return {k: v.reshape(v.shape[0] * v.shape[1], *v.shape[2:]) for k, v in batch.items()}


def _log_probs(params: nnx.State, graphdef: nnx.GraphDef, rows: Batch, dropout_key: jax.Array | None,
               frozen: nnx.State | None) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """(chosen, rejected) summed response log-probabilities, each (B,), and the family's statistics."""
  logp_R, stats = merge(graphdef, params, frozen).sequence_log_probs(rows, dropout_key=dropout_key)
  if not jax.sharding.get_abstract_mesh().empty:  # A handful of numbers: whole on every device, so the
    logp_R = jax.sharding.reshard(logp_R, jax.P())  # pairs' reshape needs no layout of its own.
  logp_BT = logp_R.reshape(-1, 2)
  return logp_BT[:, 0], logp_BT[:, 1], stats


def make_loss(config) -> LossFn:
  cfg: DPOConfig = config.dpo
  reference_free = cfg.loss == 'simpo'

  def loss(params: nnx.State, graphdef: nnx.GraphDef, batch: Batch, dropout_key: jax.Array | None,
           frozen: nnx.State | None = None, reference: nnx.State | None = None
           ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
    """The mean loss over the batch's pairs (plus the family's `aux_loss`, if any), their count, and the
    loss, rewards and log-probabilities averaged over the pairs."""
    rows = _rows(batch)
    chosen_P, rejected_P, stats = _log_probs(params, graphdef, rows, dropout_key, frozen)
    if reference_free:
      ref_chosen_P = ref_rejected_P = None
    else:
      # With LoRA, the reference's adapters are the initial ones (B = 0): the frozen base itself.
      ref_chosen_P, ref_rejected_P, _ = _log_probs(jax.lax.stop_gradient(reference), graphdef, rows, None,
                                                   frozen)
    tokens_PT = jnp.sum(batch['target_weights'], axis=-1)
    tokens_P = jnp.maximum(tokens_PT, 1.0)  # A response truncated away: log-probability 0 over 1 token.
    losses_P, chosen_rewards_P, rejected_rewards_P = pair_losses(
        cfg, chosen_P, rejected_P, ref_chosen_P, ref_rejected_P, tokens_P[:, 0], tokens_P[:, 1])
    mean = jnp.mean(losses_P)
    metrics = {'loss': mean,
               'dpo_reward_accuracy': jnp.mean((chosen_rewards_P > rejected_rewards_P).astype(jnp.float32)),
               'dpo_reward_margin': jnp.mean(chosen_rewards_P - rejected_rewards_P),
               'dpo_chosen_reward': jnp.mean(chosen_rewards_P),
               'dpo_rejected_reward': jnp.mean(rejected_rewards_P),
               'dpo_chosen_logp': jnp.mean(chosen_P),
               'dpo_rejected_logp': jnp.mean(rejected_P), **stats}
    objective = mean + stats['aux_loss'] if 'aux_loss' in stats else mean
    return objective, (jnp.float32(losses_P.shape[0]), metrics)

  return loss


def keeps_reference(config) -> bool:
  return config.dpo.loss != 'simpo'


OBJECTIVE = Objective(check=check, make_loss=make_loss, keeps_reference=keeps_reference)
