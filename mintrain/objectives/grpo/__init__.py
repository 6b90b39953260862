"""Group relative policy optimisation (GRPO, Shao et al. 2024) with verifiable rewards, as TRL's
`GRPOTrainer`: each step samples `grpo.group_size` completions of each prompt (`rollout`), scores them with
Python reward functions (`rewards`), and makes `grpo.num_iterations` updates with the clipped surrogate of
the group-normalised advantages and a KL penalty to the frozen reference (`loss`).

train.global_batch_size counts completions (rows), so a step reads global_batch_size / group_size prompts.
"""

from __future__ import annotations

import dataclasses

from mintrain.data import prompts
from mintrain.errors import ConfigError
from mintrain.fields import option
from mintrain.objectives.grpo import loss, rollout
from mintrain.objectives.objective import Objective


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  reward: str = option()
  reward_weights: tuple[float, ...] = option()
  group_size: int = option(at_least=2)
  max_new_tokens: int = option(at_least=1)
  temperature: float = option(above=0)
  top_p: float = option(above=0, at_most=1)
  num_iterations: int = option(at_least=1)
  clip_eps: float = option(above=0, below=1)
  clip_eps_high: float = option(at_least=0)
  kl_coef: float = option(at_least=0)
  loss_norm: str = option(choices=('token', 'sequence'))


def check(config) -> None:
  cfg, train = config.grpo, config.train
  if config.data.format != 'prompt':
    raise ConfigError(f"train.objective='grpo' samples completions of prompt records; data.format="
                      f"{config.data.format!r} has none. Set data.format='prompt' and data.source='jsonl'.")
  if config.family.complete is None:
    raise ConfigError(f"train.objective='grpo' samples from the model; model.name={config.model_name!r} has "
                      'no sampler.')
  if cfg.max_new_tokens >= train.seq_len:
    raise ConfigError(f'grpo.max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in '
                      f'train.seq_len={train.seq_len} + 1 tokens; lower it or raise train.seq_len.')
  if config.eval.steps:
    raise ConfigError("train.objective='grpo' has no held-out loss to evaluate; set eval.steps=0.")


def read_prompts(config, tok) -> prompts.PromptBatches:
  """Whole prompt records, global_batch_size / group_size a step, each short enough for its completions."""
  cfg, train = config.grpo, config.train
  return prompts.PromptBatches(prompts.read(config.data, tok, train.seq_len + 1 - cfg.max_new_tokens),
                               train.global_batch_size // cfg.group_size, config.seed, config.data.source)


OBJECTIVE = Objective(check=check, make_loss=loss.make_loss,
                      keeps_reference=lambda config: config.grpo.kl_coef > 0,
                      updates_per_step=lambda config: config.grpo.num_iterations,
                      read_batches=read_prompts, make_rollout=rollout.Rollout)
