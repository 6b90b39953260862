"""Per-process rows -> one global batch (grad_accum_steps, micro_batch, ...) sharded on the `batch` logical
axes: each process reads only the rows its devices hold (`process_rows`, from the mesh, as t5x's data
layout); the iterators' state is checkpointed so a restored run sees exactly the batches it would have."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from mintrain.data import pipeline, streaming, tokenizer
from mintrain.partitioning import AxisRules

LocalBatch = dict[str, np.ndarray]
EVAL_STEP_OFFSET = 1 << 40  # Synthetic eval batches use step numbers training never reaches.


def batch_sharding(mesh: Mesh, rules: AxisRules, ndim: int) -> NamedSharding:
  """(accum, batch, ...) with `batch` on its mesh axes and the rest replicated."""
  batch_spec = rules.activation_spec(('batch',))
  return NamedSharding(mesh, jax.P(None, *batch_spec, *([None] * (ndim - 2))))


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> np.ndarray:
  """The rows of dimension 1 (the micro-batch) of a global batch of `shape` laid out as `sharding` that
  this process's devices hold, sorted: what it must read (t5x's `get_data_layout`, for any layout).

  Taken from the mesh, not from `process_index`, so any rule for `batch` and any device order feed the
  right rows; processes that hold the same rows (a batch replicated across them) read the same ones.
  """
  rows = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    rows.update(range(*index[1].indices(shape[1])))
  return np.array(sorted(rows))


class SyntheticRows:
  """This process's rows of the synthetic global batch of each step; state is the next step."""

  def __init__(self, make_rows: Callable[[int, np.ndarray], LocalBatch], accum: int, micro_batch_size: int,
               rows: np.ndarray, first_step: int = 0):
    self.make_rows, self.step = make_rows, first_step
    # Row r of micro-batch a is row a * M + r of the step's global batch, as in `pipeline`.
    self.rows = (np.arange(accum)[:, None] * micro_batch_size + rows[None, :]).reshape(-1)

  def __iter__(self) -> SyntheticRows:
    return self

  def __next__(self) -> LocalBatch:
    batch = self.make_rows(self.step, self.rows)
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
               global_batch_size: int, rows: np.ndarray, ahead: int = 0):
    self.local, self.source = local, source
    self.mesh, self.rules, self.accum = mesh, rules, accum
    self.micro = global_batch_size // accum
    self.rows = rows  # Of each micro-batch, the ones this process reads (`process_rows`).
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
    """Each device gets its slice of the rows this process read, wherever they sit in the batch."""
    out = {}
    for key, value in local_batch.items():
      local = value.reshape(self.accum, len(self.rows), *value.shape[1:])
      shape = (self.accum, self.micro, *value.shape[1:])

      def shard(index: tuple[slice, ...], local=local) -> np.ndarray:
        wanted = np.arange(*index[1].indices(self.micro))
        return local[index[0], np.searchsorted(self.rows, wanted)][(slice(None), slice(None), *index[2:])]

      out[key] = jax.make_array_from_callback(shape, batch_sharding(self.mesh, self.rules, len(shape)), shard)
    return out

  def get_state(self) -> dict[str, Any]:
    """The position after the last batch handed out (batches read ahead are not counted)."""
    position = self.ready[0][0] if self.ready else self.local.get_state()
    if 'rows' in position:  # A streamed source's: each process knows its own rows' positions.
      position = streaming.gather_rows(position, self.micro * self.accum)
    return {'source': self.source, 'iterator': position}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Continues from a checkpoint's state; a state of another source is an error."""
    if state.get('source') != self.source:
      raise ValueError(f"The checkpoint's data iterator is for data.source={state.get('source')!r}, "
                       f'not {self.source!r}; it cannot continue this stream.')
    self.ready.clear()
    self.local.set_state(state['iterator'])


def make_batches(config: Any, mesh: Mesh, rules: AxisRules, tok: tokenizer.Tokenizer, *,
                 split: str = 'train') -> GlobalBatches:
  """Global batches of `split` of a run's `config` (`mintrain.config.Config`, whose sections the data
  layer reads but never imports) and its tokenizer `tok` (`config.resolve`'s): train batches run on forever
  (`data.device_prefetch` of them on their devices ahead of the step), eval batches restart per evaluation."""
  data, train = config.data, config.train
  shape = (train.grad_accum_steps, train.micro_batch_size)
  rows = process_rows(batch_sharding(mesh, rules, len(shape)), shape)
  if data.source == 'synthetic':
    def make_rows(step: int, rows: np.ndarray) -> LocalBatch:
      return config.model.synthetic_rows(config.seed, step, rows, train.seq_len)
    local = SyntheticRows(make_rows, train.grad_accum_steps, train.micro_batch_size, rows,
                          first_step=EVAL_STEP_OFFSET if split == 'eval' else 0)
  else:
    local = pipeline.make_iterator(data, tok, split=split, seq_len=train.seq_len,
                                   global_batch_size=train.global_batch_size,
                                   micro_batch_size=train.micro_batch_size, rows=rows, seed=config.seed,
                                   vocab_size=config.model.vocab_size)
  return GlobalBatches(local, data.source, mesh, rules, train.grad_accum_steps, train.global_batch_size, rows,
                       ahead=data.device_prefetch if split == 'train' else 0)
