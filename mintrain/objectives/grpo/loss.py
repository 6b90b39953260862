"""GRPO's loss, as TRL's `GRPOTrainer` computes it: per completion token, the clipped surrogate of the ratio
of the policy's probability to the sampling policy's, times the completion's group-normalised advantage, plus
kl_coef times the k3 estimate of the KL divergence to the reference; averaged per token or per sequence.

A batch holds rows of prompt + completion ('inputs', 'targets', 'target_weights' 1.0 on the completion's
targets), each row's 'advantages' (B,), and where they are needed 'old_logp' (the sampling policy's, for
grpo.num_iterations > 1) and 'ref_logp' (the reference's, for kl_coef > 0), each (B, L).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.models.layers import merge
from mintrain.objectives.objective import Batch, LossFn


def token_terms(logp_BL: jax.Array, old_logp_BL: jax.Array, ref_logp_BL: jax.Array | None,
                advantages_B: jax.Array, *, clip_eps: float, clip_eps_high: float, kl_coef: float
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(loss, KL estimate, clipped or not) of each token: -min(r A, clip(r, 1 - eps, 1 + eps_high) A) +
  kl_coef (exp(ref - logp) - (ref - logp) - 1), r = exp(logp - old_logp)."""
  ratio_BL = jnp.exp(logp_BL - old_logp_BL)
  advantages_B1 = advantages_B[:, None]
  clipped_BL = jnp.clip(ratio_BL, 1 - clip_eps, 1 + clip_eps_high)
  loss_BL = -jnp.minimum(ratio_BL * advantages_B1, clipped_BL * advantages_B1)
  was_clipped_BL = (((ratio_BL < 1 - clip_eps) & (advantages_B1 < 0))
                    | ((ratio_BL > 1 + clip_eps_high) & (advantages_B1 > 0)))
  if ref_logp_BL is None:
    return loss_BL, jnp.zeros_like(loss_BL), was_clipped_BL
  delta_BL = ref_logp_BL - logp_BL
  kl_BL = jnp.exp(delta_BL) - delta_BL - 1
  return loss_BL + kl_coef * kl_BL, kl_BL, was_clipped_BL


def make_loss(config) -> LossFn:
  cfg = config.grpo
  clip_eps_high = cfg.clip_eps_high or cfg.clip_eps

  def loss(params: nnx.State, graphdef: nnx.GraphDef, batch: Batch, dropout_key: jax.Array | None,
           frozen: nnx.State | None = None, reference: nnx.State | None = None
           ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
    """The loss per token (grpo.loss_norm='token': over the batch's completion tokens, counting them) or
    per sequence (each completion's mean, then their mean, counting completions), and its metrics."""
    del reference  # Its log-probabilities come with the batch ('ref_logp'), computed once per step.
    logp_BL, stats = merge(graphdef, params, frozen).token_log_probs(batch, dropout_key=dropout_key)
    old_logp_BL = batch['old_logp'] if 'old_logp' in batch else jax.lax.stop_gradient(logp_BL)
    loss_BL, kl_BL, clipped_BL = token_terms(
        logp_BL, old_logp_BL, batch.get('ref_logp') if cfg.kl_coef else None, batch['advantages'],
        clip_eps=cfg.clip_eps, clip_eps_high=clip_eps_high, kl_coef=cfg.kl_coef)
    weights_BL = batch['target_weights']
    tokens_B = jnp.sum(weights_BL, axis=1)
    tokens = jnp.maximum(jnp.sum(tokens_B), 1.0)
    if cfg.loss_norm == 'token':
      mean, count = jnp.sum(loss_BL * weights_BL) / tokens, jnp.sum(tokens_B)
    else:
      mean = jnp.mean(jnp.sum(loss_BL * weights_BL, axis=1) / jnp.maximum(tokens_B, 1.0))
      count = jnp.float32(weights_BL.shape[0])
    metrics = {'loss': mean, 'grpo_kl': jnp.sum(kl_BL * weights_BL) / tokens,
               'grpo_clip_fraction': jnp.sum(clipped_BL * weights_BL) / tokens, **stats}
    objective = mean + stats['aux_loss'] if 'aux_loss' in stats else mean
    return objective, (count, metrics)

  return loss
