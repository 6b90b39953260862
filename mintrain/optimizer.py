"""The optimizer (AdamW, Lion, Adafactor, Muon or SGD), its learning-rate schedule (linear warmup, then
cosine, linear, constant or warmup-stable-decay) and global-norm clipping."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mintrain.fields import option

OPTIMIZERS = ('adamw', 'lion', 'adafactor', 'muon', 'sgd')
SCHEDULES = ('cosine', 'linear', 'constant', 'wsd')
DECAY_SHAPES = ('linear', 'cosine', 'sqrt')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  name: str = option(choices=OPTIMIZERS)
  learning_rate: float = option(above=0)
  schedule: str = option(choices=SCHEDULES)
  warmup_steps: int = option(at_least=0)
  end_lr_fraction: float = option(at_least=0, at_most=1)
  decay_fraction: float = option(at_least=0, at_most=1)
  decay_shape: str = option(choices=DECAY_SHAPES)
  b1: float = option(at_least=0, below=1)
  b2: float = option(at_least=0, below=1)
  eps: float = option(above=0)
  weight_decay: float = option(at_least=0)
  grad_clip_norm: float = option(at_least=0)
  mu_dtype: str = option(choices=('', 'float32', 'bfloat16'))


def schedule(opt: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then `opt.schedule` down to `end_lr_fraction` of it at the last step;
  'wsd' holds the peak until its last `decay_fraction` of the steps."""
  peak, end = opt.learning_rate, opt.learning_rate * opt.end_lr_fraction
  warmup = min(opt.warmup_steps, total_steps)
  rest = max(total_steps - warmup, 1)
  if opt.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, warmup + rest, end)
  if opt.schedule == 'constant':
    after = optax.constant_schedule(peak)
  elif opt.schedule == 'linear':
    after = optax.linear_schedule(peak, end, rest)
  else:
    decay = max(round(rest * opt.decay_fraction), 1)
    after = optax.join_schedules([optax.constant_schedule(peak), _decay(opt.decay_shape, peak, end, decay)],
                                 [rest - decay])
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _decay(shape: str, peak: float, end: float, steps: int) -> optax.Schedule:
  """From `peak` to `end` over `steps`: linearly, along a half cosine, or as 1 - sqrt(t) (MiniCPM's WSD)."""
  if shape == 'linear':
    return optax.linear_schedule(peak, end, steps)
  if shape == 'cosine':
    return optax.cosine_decay_schedule(peak, steps, alpha=end / peak)

  def sqrt_decay(step):
    t = jnp.clip(step / steps, 0.0, 1.0)
    return end + (peak - end) * (1.0 - jnp.sqrt(t))
  return sqrt_decay


def _by_variable(fn, params: Any) -> Any:
  """`fn(variable)` for every parameter, as a tree with the params' structure (Variables included)."""
  def one(leaf: Any) -> Any:
    if not isinstance(leaf, nnx.Variable):
      return fn(leaf)
    # Inside `optax.partition`, the other partition's parameters are masked out.
    return leaf if isinstance(leaf.get_value(), optax.MaskedNode) else leaf.replace(fn(leaf))
  return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _axes(leaf: Any) -> tuple[str | None, ...]:
  return tuple(leaf.get_metadata().get('out_sharding') or ()) if isinstance(leaf, nnx.Variable) else ()


def _decays(leaf: Any) -> bool:
  if isinstance(leaf, nnx.Variable):
    return bool(leaf.get_metadata().get('weight_decay', leaf.ndim >= 2))
  return leaf.ndim >= 2


def decay_mask(params: Any) -> Any:
  """Weight decay where each parameter's metadata says (`layers.param(..., decay=...)`): matrices by
  default, not norms, biases or lookup tables."""
  return _by_variable(_decays, params)


BATCH_AXES = ('layers', 'expert')  # Leading axes of stacked matrices: one matrix each.


def muon_dims(leaf: Any) -> optax.contrib.MuonDimensionNumbers | None:
  """Which axes of a parameter are a matrix's input (reduction) and output axes for Muon, None for what
  AdamW updates (vectors, and the embedding and output layer, as Moonlight and Levanter keep them). The
  axes after the stacking ones (`BATCH_AXES`) read input first: `embed` last means it is the output
  (`wo_HKD`: input H and K); otherwise the first is the input (`wq_DHK`: output H and K)."""
  axes = _axes(leaf)
  matrix = [i for i, name in enumerate(axes) if name not in BATCH_AXES]
  if len(matrix) < 2 or 'vocab' in axes or not _decays(leaf):
    return None
  inputs = matrix[:-1] if axes[matrix[-1]] == 'embed' else matrix[:1]
  outputs = [i for i in matrix if i not in inputs]
  return optax.contrib.MuonDimensionNumbers(tuple(inputs), tuple(outputs))


def _muon(opt: OptimizerConfig, lr: optax.Schedule, mu_dtype: Any) -> optax.GradientTransformation:
  """Muon on the hidden matrices (updates scaled to AdamW's RMS, Moonlight's rule, so one learning rate
  and weight decay serve both), AdamW on the rest."""
  def labels(params: Any) -> Any:
    return _by_variable(lambda leaf: 'adamw' if muon_dims(leaf) is None else 'muon', params)

  def dims(params: Any) -> Any:
    return _by_variable(muon_dims, params)

  muon = _gathered(optax.contrib.muon(lr, beta=opt.b1, eps=opt.eps, weight_decay=opt.weight_decay,
                                     mu_dtype=mu_dtype, muon_weight_dimension_numbers=dims,
                                     consistent_rms=0.2))
  adamw = optax.adamw(lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask,
                      mu_dtype=mu_dtype)
  return optax.partition({'muon': muon, 'adamw': adamw}, labels)


def _gathered(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` updating whole (replicated) matrices, its results and state split back as they came: Newton-
  Schulz multiplies whole matrices. Every device repeats the orthogonalisation; the state stays split."""
  def whole(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.sharding.reshard(x, jax.P()), tree)

  def update(updates, state, params=None):
    if jax.sharding.get_abstract_mesh().empty:
      return inner.update(updates, state, params)
    new_updates, new_state = inner.update(whole(updates), whole(state), whole(params))
    split = lambda x, like: jax.sharding.reshard(x, jax.typeof(like).sharding)  # noqa: E731
    return jax.tree.map(split, new_updates, updates), jax.tree.map(split, new_state, state)

  return optax.GradientTransformation(inner.init, update)


def make_optimizer(opt: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
  lr, mu_dtype = schedule(opt, total_steps), jnp.dtype(opt.mu_dtype) if opt.mu_dtype else None
  wd = opt.weight_decay
  if opt.name == 'adamw':
    tx = optax.adamw(lr, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=wd, mask=decay_mask,
                     mu_dtype=mu_dtype)
  elif opt.name == 'lion':
    tx = optax.lion(lr, b1=opt.b1, b2=opt.b2, weight_decay=wd, mask=decay_mask, mu_dtype=mu_dtype)
  elif opt.name == 'adafactor':  # Factored second moments; momentum (b1 > 0) in mu_dtype.
    tx = optax.adafactor(lr, momentum=opt.b1 or None, dtype_momentum=mu_dtype or jnp.float32,
                         weight_decay_rate=wd or None, weight_decay_mask=decay_mask,
                         multiply_by_parameter_scale=False)
  elif opt.name == 'muon':
    tx = _muon(opt, lr, mu_dtype)
  else:
    tx = optax.chain(optax.add_decayed_weights(wd, decay_mask),  # L2, as torch's SGD.
                     optax.sgd(lr, momentum=opt.b1 or None, accumulator_dtype=mu_dtype))
  clip = clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm > 0 else optax.identity()
  return optax.chain(clip, tx)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax's clipping (and its empty state), as one factor for all gradients: a product each reader of
  them repeats, where optax's per-element division makes XLA store the clipped gradients first."""
  def update(updates, state, params=None):
    del params
    factor = jnp.minimum(1.0, max_norm / optax.tree.norm(updates))
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state

  return optax.GradientTransformation(optax.clip_by_global_norm(max_norm).init, update)
