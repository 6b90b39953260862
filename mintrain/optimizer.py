"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax
from flax import nnx

from mintrain.models.layers import LAYERS


def schedule(opt: Mapping[str, Any], total_steps: int) -> optax.Schedule:
  peak = opt['learning_rate']
  warmup = min(opt['warmup_steps'], total_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=peak * opt['end_lr_fraction'])


def decay_mask(params: Any) -> Any:
  """Weight decay on matrices only: not on norms, biases (1-D) or embedding tables.

  The leading `layers` axis of stacked per-layer parameters is not a matrix dimension: a
  stack of norm scales is still a norm.
  """
  def decays(path, leaf) -> Any:
    names = '.'.join(str(getattr(k, 'key', k)) for k in path)
    if not isinstance(leaf, nnx.Variable):
      return leaf.ndim >= 2 and 'embedding' not in names
    stacked = (leaf.get_metadata().get('out_sharding') or (None,))[0] == LAYERS
    return leaf.replace(leaf.ndim - stacked >= 2 and 'embedding' not in names)  # Same tree as the params.
  return jax.tree.map_with_path(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(opt: Mapping[str, Any], total_steps: int) -> optax.GradientTransformation:
  clip = (optax.clip_by_global_norm(opt['grad_clip_norm']) if opt['grad_clip_norm'] > 0
          else optax.identity())
  return optax.chain(
      clip,
      optax.adamw(schedule(opt, total_steps), b1=opt['b1'], b2=opt['b2'], eps=opt['eps'],
                  weight_decay=opt['weight_decay'], mask=decay_mask))
