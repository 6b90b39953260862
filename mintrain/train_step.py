"""The train step: one pure function (state, batch) -> (state, metrics). Micro-batches are weighted by
their counted targets, so loss, gradients and the family's statistics are those of one step on the whole
batch; dropout keys fold in the step and micro-batch index, never the mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mintrain.errors import ConfigError
from mintrain.fields import option
from mintrain.models.layers import merge
from mintrain.objectives import OBJECTIVES, lm
from mintrain.objectives.objective import LossFn
from mintrain.train_state import PRNG_IMPL, TrainState


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = option(at_least=1)
  global_batch_size: int = option(at_least=1)
  seq_len: int = option(at_least=1)
  grad_accum_steps: int = option(at_least=1)
  log_every: int = option(at_least=1)
  hang_timeout_s: float = option(above=0)
  compilation_cache: bool = option()
  objective: str = option(choices=tuple(OBJECTIVES))

  def __post_init__(self):
    if self.global_batch_size % self.grad_accum_steps:
      raise ConfigError(
          f'train.global_batch_size={self.global_batch_size} is not divisible by '
          f'train.grad_accum_steps={self.grad_accum_steps}; every micro-batch must have the same size.')

  @property
  def micro_batch_size(self) -> int:
    return self.global_batch_size // self.grad_accum_steps

Batch = dict[str, jax.Array]


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    use_dropout: bool, loss_fn: LossFn = lm.loss, updates: int = 1
                    ) -> Callable[[TrainState, Batch], tuple]:
  """The jitted step of the objective's `loss_fn` (`mintrain.objectives`), with the state donated: `updates`
  optimizer updates on the batch (the objective's `updates_per_step`), whose metrics are averaged. Gradients
  are of `params` alone: the state's `frozen` variables (LoRA's base) and reference model, if any, are read
  and carried along untouched. A statistic `balance` (arrays, averaged like the metrics) is not logged: the
  model's `after_step(balance)` makes the step's parameters from it, an update without gradient (a
  router's balancing bias)."""

  def update(state: TrainState, params: nnx.State, opt_state, batch: Batch, step_key: jax.Array
             ) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array]]:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro_step(carry, xs):
      metric_sum, count_sum, grad_sum = carry
      index, micro_batch = xs
      key = jax.random.fold_in(step_key, index) if use_dropout else None
      (_, (count, metrics)), grads = grad_fn(params, graphdef, micro_batch, key, state.frozen,
                                              state.reference)
      grad_sum = jax.tree.map(lambda total, g: total + g * count, grad_sum, grads)
      metric_sum = jax.tree.map(lambda total, m: total + m * count, metric_sum, metrics)
      return (metric_sum, count_sum + count, grad_sum), None

    accum = jax.tree.leaves(batch)[0].shape[0]
    first = jax.tree.map(lambda x: x[0], batch)
    if accum == 1:
      # The mean's own gradients, with no pass over them to weight and scale. A batch without a counted
      # target has a zero loss and gradients of it; a family's auxiliary loss (a router's balance) applies.
      key = jax.random.fold_in(step_key, 0) if use_dropout else None
      (_, (_, model_metrics)), grads = grad_fn(params, graphdef, first, key, state.frozen, state.reference)
      return apply(state, params, opt_state, grads, model_metrics)
    zeros = jax.tree.map(jnp.zeros_like, params)
    metric_zeros = jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype),
                                jax.eval_shape(loss_fn, params, graphdef, first, None, state.frozen,
                                               state.reference)[1][1])
    (metric_sum, count, grad_sum), _ = jax.lax.scan(
        micro_step, (metric_zeros, jnp.zeros((), jnp.float32), zeros), (jnp.arange(accum), batch))
    total = jnp.where(count > 0, count, 1.0)  # A step without a counted target: zero loss and gradients.
    model_metrics = jax.tree.map(lambda m: m / total, metric_sum)
    grads = jax.tree.map(lambda g: g / total, grad_sum)
    return apply(state, params, opt_state, grads, model_metrics)

  def apply(state, params, opt_state, grads, model_metrics):
    deltas, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, deltas)
    balance = model_metrics.pop('balance', None)
    if balance is not None:
      params = merge(graphdef, params, state.frozen).after_step(balance)
    return params, opt_state, {**model_metrics, 'grad_norm': optax.tree.norm(grads)}

  def step_fn(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng, impl=PRNG_IMPL), state.step)
    params, opt_state, per_update = state.params, state.opt_state, []
    for i in range(updates):
      key = step_key if updates == 1 else jax.random.fold_in(step_key, i)  # One update: the keys as ever.
      params, opt_state, metrics = update(state, params, opt_state, batch, key)
      per_update.append(metrics)
    metrics = jax.tree.map(lambda *m: sum(m) / updates, *per_update)
    metrics = {**metrics, 'param_norm': optax.tree.norm(params),
               'learning_rate': schedule(state.step * updates)}
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  return jax.jit(step_fn, donate_argnums=0)


def make_eval_step(graphdef: nnx.GraphDef,
                   loss_fn: LossFn = lm.loss) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """Jitted (summed loss, count) of params (with the frozen ones, against the objective's `reference` model,
  if any) over the counted units of one (accum, micro, ...) batch; no gradients, no dropout. Summed, so
  that batches with fewer counted units weigh less."""
  def eval_fn(params: nnx.State, batch: Batch, frozen: nnx.State | None = None,
              reference: nnx.State | None = None) -> tuple[jax.Array, jax.Array]:
    def micro(micro_batch: Batch) -> tuple[jax.Array, jax.Array]:
      _, (count, metrics) = loss_fn(params, graphdef, micro_batch, None, frozen, reference)
      return metrics['loss'], count
    losses, counts = jax.lax.map(micro, batch)
    return jnp.sum(losses * counts), jnp.sum(counts)
  return jax.jit(eval_fn)
