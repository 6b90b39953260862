"""The train step: one pure function (state, batch) -> (state, metrics).

The batch is (grad_accum_steps, micro_batch, ...); gradients are averaged over
the micro-batches with a scan, which equals one step on the whole batch.
Dropout keys are folded from the state's key, the step and the micro-batch
index, so they do not depend on the mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mintrain.train_state import TrainState

Batch = dict[str, jax.Array]


def loss_and_metrics(params: nnx.State, graphdef: nnx.GraphDef, batch: Batch,
                     dropout_key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(objective, metrics). A model's `loss` returns its loss, or (loss, statistics) when it has more to
  report: their `aux_loss` (e.g. an MoE router's balancing losses) is added to the objective, and every
  statistic joins the metrics beside `loss`, which stays the model's own loss."""
  model = nnx.merge(graphdef, params)
  out = model.loss(batch['inputs'], batch['targets'], dropout_key=dropout_key)
  loss, stats = out if isinstance(out, tuple) else (out, {})
  return loss + stats.get('aux_loss', 0.0), {'loss': loss, **stats}


def loss_fn(params: nnx.State, graphdef: nnx.GraphDef, batch: Batch,
            dropout_key: jax.Array | None) -> jax.Array:
  """The objective the train step minimises."""
  return loss_and_metrics(params, graphdef, batch, dropout_key)[0]


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, use_dropout: bool) -> Callable[[TrainState, Batch], tuple]:
  """The jitted step, with the state donated."""

  def step_fn(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    grad_fn = jax.value_and_grad(loss_and_metrics, has_aux=True)

    def micro_step(carry, xs):
      metric_sum, grad_sum = carry
      index, micro_batch = xs
      key = jax.random.fold_in(step_key, index) if use_dropout else None
      (_, metrics), grads = grad_fn(state.params, graphdef, micro_batch, key)
      return (jax.tree.map(jnp.add, metric_sum, metrics), jax.tree.map(jnp.add, grad_sum, grads)), None

    accum = jax.tree.leaves(batch)[0].shape[0]
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    first = jax.tree.map(lambda x: x[0], batch)
    metric_zeros = jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype),
                                jax.eval_shape(loss_and_metrics, state.params, graphdef, first, None)[1])
    (metric_sum, grad_sum), _ = jax.lax.scan(micro_step, (metric_zeros, zeros), (jnp.arange(accum), batch))
    model_metrics = jax.tree.map(lambda m: m / accum, metric_sum)
    grads = jax.tree.map(lambda g: g / accum, grad_sum)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**model_metrics, 'grad_norm': optax.tree.norm(grads), 'param_norm': optax.tree.norm(params),
               'learning_rate': schedule(state.step)}
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  return jax.jit(step_fn, donate_argnums=0)


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[nnx.State, Batch], jax.Array]:
  """Jitted mean loss of params on one (accum, micro, ...) batch; no gradients, no dropout."""
  def eval_fn(params: nnx.State, batch: Batch) -> jax.Array:
    losses = jax.lax.map(lambda micro: loss_and_metrics(params, graphdef, micro, None)[1]['loss'], batch)
    return jnp.mean(losses)
  return jax.jit(eval_fn)
