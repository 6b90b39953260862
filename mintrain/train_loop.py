"""The training loop: set up the mesh and state, step, log.

Metrics stay on device between logging steps; at a logging step the pending
values are fetched at once, so the loop never waits on the device in between.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import ml_collections

from mintrain import config as config_lib
from mintrain import mesh as mesh_lib
from mintrain import train_state
from mintrain.data import make_batches
from mintrain.metrics import MetricsLog, NonFiniteLossError, first_non_finite
from mintrain.optimizer import schedule
from mintrain.partitioning import AxisRules
from mintrain.train_step import make_train_step


@dataclasses.dataclass
class RunResult:
  records: list[dict]  # What was logged, one dict per logging interval.
  losses: list[float]  # Loss of every step, in order.
  state: train_state.TrainState


def tokens_per_step(config: ml_collections.ConfigDict) -> int:
  per_row = config.train.seq_len if config.model.name == 'transformer' else 1
  return config.train.global_batch_size * per_row


def run(config: ml_collections.ConfigDict, workdir: str | None, *,
        devices: Sequence[jax.Device] | None = None,
        print_fn: Callable[[str], None] = print) -> RunResult:
  """Trains `config` for `config.train.steps` steps on a mesh over `devices`."""
  config_lib.validate(config)
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  rules = AxisRules.from_config(config.partitioning)
  setup = train_state.setup(config, rules, mesh)
  is_main = jax.process_index() == 0
  if is_main:
    print_fn(train_state.format_report(setup.layout, setup.abstract_state, mesh))
  log = MetricsLog(workdir, is_main=is_main, print_fn=print_fn)

  total, log_every = config.train.steps, config.train.log_every
  with jax.set_mesh(mesh):
    state = setup.init()
    step_fn = make_train_step(setup.graphdef, setup.tx, schedule(config.optimizer, total),
                              use_dropout=config.model.dropout_rate > 0)
    batches = make_batches(config, mesh, rules)
    records, losses, pending = [], [], []
    start = int(state.step)
    interval_start, interval_steps = None, 0
    for step in range(start, total):
      state, metrics = step_fn(state, batches(step))
      pending.append(metrics)
      if interval_start is None:  # Rates exclude the first (compiling) step.
        jax.block_until_ready(metrics)
        interval_start, interval_steps = time.perf_counter(), 0
      else:
        interval_steps += 1
      if (step + 1) % log_every and step + 1 != total:
        continue
      fetched = jax.device_get(pending)
      first = step + 1 - len(fetched)
      step_losses = [float(m['loss']) for m in fetched]
      bad = first_non_finite(list(zip(range(first, step + 1), step_losses)))
      if bad is not None:
        raise NonFiniteLossError(
            f'Loss is {bad[1]} at step {bad[0]}: training stopped. Lower '
            'optimizer.learning_rate, enable optimizer.grad_clip_norm, or check the data.')
      losses += step_losses
      pending = []
      record = {'step': step + 1, **{k: float(v) for k, v in fetched[-1].items()}}
      elapsed = time.perf_counter() - interval_start
      if interval_steps:
        record['steps_per_sec'] = interval_steps / elapsed
        record['tokens_per_sec'] = record['steps_per_sec'] * tokens_per_step(config)
      interval_start, interval_steps = time.perf_counter(), 0
      records.append(record)
      log.write(record)
  return RunResult(records, losses, state)
