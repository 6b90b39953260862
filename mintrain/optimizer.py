"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx

from mintrain.fields import option


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = option(above=0)
  warmup_steps: int = option(at_least=0)
  end_lr_fraction: float = option(at_least=0, at_most=1)
  b1: float = option(at_least=0, below=1)
  b2: float = option(at_least=0, below=1)
  eps: float = option(above=0)
  weight_decay: float = option(at_least=0)
  grad_clip_norm: float = option(at_least=0)


def schedule(opt: OptimizerConfig, total_steps: int) -> optax.Schedule:
  warmup = min(opt.warmup_steps, total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt.learning_rate, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=opt.learning_rate * opt.end_lr_fraction)


def decay_mask(params: Any) -> Any:
  """Weight decay where each parameter's metadata says (`layers.param(..., decay=...)`): matrices by
  default, not norms, biases or lookup tables."""
  def decays(leaf: Any) -> Any:
    if isinstance(leaf, nnx.Variable):
      # The mask has the params' tree, Variables included.
      return leaf.replace(bool(leaf.get_metadata().get('weight_decay', leaf.ndim >= 2)))
    return leaf.ndim >= 2
  return jax.tree.map(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(opt: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  clip = optax.clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm > 0 else optax.identity()
  return optax.chain(
      clip,
      optax.adamw(schedule(opt, total_steps), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                  weight_decay=opt.weight_decay, mask=decay_mask))
