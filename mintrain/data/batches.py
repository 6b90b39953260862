"""Per-process local batches -> one global batch sharded on the `batch` logical axes.

A global batch has shape (grad_accum_steps, micro_batch, ...): the leading axis
is scanned over by the train step, the second is split over the batch mesh axes.
Each process reads only its own rows (`global_batch_size / process_count` per
step) and contributes them with `jax.make_array_from_process_local_data`.

The iterators are checkpointable: `get_state()` is a JSON-able dict that a
checkpoint stores, and `set_state()` makes a restored run see exactly the
batches the uninterrupted one would have seen.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding

from mintrain.data import pipeline, sources, synthetic
from mintrain.partitioning import AxisRules

LocalBatch = dict[str, np.ndarray]
EVAL_STEP_OFFSET = 1 << 40  # Synthetic eval batches use step numbers training never reaches.


def batch_sharding(mesh: Mesh, rules: AxisRules, ndim: int) -> NamedSharding:
  """(accum, batch, ...) with `batch` on its mesh axes and the rest replicated."""
  batch_spec = rules.activation_spec(('batch',))
  return NamedSharding(mesh, jax.P(None, *batch_spec, *([None] * (ndim - 2))))


class SyntheticRows:
  """This process's rows of the synthetic global batch of each step; state is the next step."""

  def __init__(self, config: ml_collections.ConfigDict, process_index: int, process_count: int,
               first_step: int = 0):
    self.config, self.step = config, first_step
    local = config.train.global_batch_size // process_count
    self.rows = np.arange(process_index * local, (process_index + 1) * local)

  def __iter__(self) -> SyntheticRows:
    return self

  def __next__(self) -> LocalBatch:
    m, seed = self.config.model, self.config.seed
    if m.name == 'mlp':
      batch = synthetic.classification_rows(seed, self.step, self.rows, m.input_dim, m.num_classes)
    else:
      batch = synthetic.token_rows(seed, self.step, self.rows, self.config.train.seq_len, m.vocab_size)
    self.step += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {'next_step': self.step}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self.step = int(state['next_step'])


class GlobalBatches:
  """Global (accum, micro, ...) arrays from an iterator of this process's local batches.

  With `ahead` > 0, that many further batches are already read and sent to their devices when
  one is handed out, so a step never waits for its batch's transfer. The position it reports
  (`get_state`) is still that of the batches handed out, so a checkpoint resumes exactly.
  """

  def __init__(self, local: Iterator[LocalBatch], source: str, mesh: Mesh, rules: AxisRules, accum: int,
               global_batch_size: int, ahead: int = 0):
    self.local, self.source = local, source
    self.mesh, self.rules, self.accum = mesh, rules, accum
    self.micro = global_batch_size // accum
    self.ahead = ahead
    self.ready: collections.deque[tuple[dict[str, Any], dict[str, jax.Array]]] = collections.deque()

  def __iter__(self) -> GlobalBatches:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    while len(self.ready) <= self.ahead:
      position = self.local.get_state() if self.ahead else {}
      self.ready.append((position, self._to_devices(next(self.local))))
    return self.ready.popleft()[1]

  def _to_devices(self, local_batch: LocalBatch) -> dict[str, jax.Array]:
    out = {}
    for key, value in local_batch.items():
      local = value.reshape(self.accum, value.shape[0] // self.accum, *value.shape[1:])
      shape = (self.accum, self.micro, *value.shape[1:])
      sharding = batch_sharding(self.mesh, self.rules, len(shape))
      out[key] = jax.make_array_from_process_local_data(sharding, local, shape)
    return out

  def get_state(self) -> dict[str, Any]:
    """The position after the last batch handed out (batches read ahead are not counted)."""
    position = self.ready[0][0] if self.ready else self.local.get_state()
    return {'source': self.source, 'iterator': position}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Continues from a checkpoint's state; a state of another source is an error."""
    if state.get('source') != self.source:
      raise ValueError(f"The checkpoint's data iterator is for data.source={state.get('source')!r}, "
                       f'not {self.source!r}; it cannot continue this stream.')
    self.ready.clear()
    self.local.set_state(state['iterator'])


def _local_iterator(config: ml_collections.ConfigDict, split: str, seed: int) -> Iterator[LocalBatch]:
  index, count = jax.process_index(), jax.process_count()
  if config.data.source == 'synthetic':
    return SyntheticRows(config, index, count, first_step=EVAL_STEP_OFFSET if split == 'eval' else 0)
  return pipeline.make_iterator(config.data, split=split, seq_len=config.train.seq_len,
                                global_batch_size=config.train.global_batch_size, seed=seed,
                                process_index=index, process_count=count)


def make_batches(config: ml_collections.ConfigDict, mesh: Mesh, rules: AxisRules, *,
                 split: str = 'train') -> GlobalBatches:
  """Global batches of `split`: train batches run on forever (`data.device_prefetch` of them on their
  devices ahead of the step), eval batches restart per evaluation."""
  ahead = sources.option(config.data, 'device_prefetch') if split == 'train' else 0
  if not isinstance(ahead, int) or ahead < 0:
    raise sources.DataError(f'data.device_prefetch={ahead!r} must be an integer >= 0 (batches sent to '
                            'the devices ahead of the step).')
  return GlobalBatches(_local_iterator(config, split, config.seed), config.data.source, mesh, rules,
                       config.train.grad_accum_steps, config.train.global_batch_size, ahead=ahead)
