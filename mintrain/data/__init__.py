"""Input pipeline: per-process rows -> one global batch sharded on the `batch` logical axes.

A global batch has shape (grad_accum_steps, micro_batch, ...): the leading axis
is scanned over by the train step, the second is split over the batch mesh axes.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding

from mintrain.config import micro_batch_size
from mintrain.data import synthetic
from mintrain.partitioning import AxisRules


def batch_sharding(mesh: Mesh, rules: AxisRules, ndim: int) -> NamedSharding:
  """(accum, batch, ...) with `batch` on its mesh axes and the rest replicated."""
  batch_spec = rules.activation_spec(('batch',))
  return NamedSharding(mesh, jax.P(None, *batch_spec, *([None] * (ndim - 2))))


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
  """The contiguous range of micro-batch rows (dim 1) this process holds."""
  index_map = sharding.addressable_devices_indices_map(global_shape)
  starts = [idx[1].start or 0 for idx in index_map.values()]
  stops = [idx[1].stop if idx[1].stop is not None else global_shape[1] for idx in index_map.values()]
  return slice(min(starts), max(stops))


class SyntheticBatches:
  """Global batches for step `s` from the seed alone, each process building only its rows."""

  def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh, rules: AxisRules):
    self.config, self.mesh, self.rules = config, mesh, rules
    self.accum = config.train.grad_accum_steps
    self.micro = micro_batch_size(config)

  def _rows(self, step: int, rows: np.ndarray) -> dict[str, np.ndarray]:
    m, seed = self.config.model, self.config.seed
    if m.name == 'mlp':
      return synthetic.classification_rows(seed, step, rows, m.input_dim, m.num_classes)
    return synthetic.token_rows(seed, step, rows, self.config.train.seq_len, m.vocab_size)

  def __call__(self, step: int) -> dict[str, jax.Array]:
    example = self._rows(0, np.arange(1))
    out = {}
    local = None
    for key, value in example.items():
      shape = (self.accum, self.micro, *value.shape[1:])
      sharding = batch_sharding(self.mesh, self.rules, len(shape))
      if local is None:
        local = local_rows(sharding, shape)
        rows = (np.arange(self.accum)[:, None] * self.micro
                + np.arange(local.start, local.stop)[None, :]).reshape(-1)
        data = self._rows(step, rows)
      local_data = data[key].reshape(self.accum, local.stop - local.start, *value.shape[1:])
      out[key] = jax.make_array_from_process_local_data(sharding, local_data, shape)
    return out


def make_batches(config: ml_collections.ConfigDict, mesh: Mesh, rules: AxisRules) -> SyntheticBatches:
  if config.data.source != 'synthetic':
    raise ValueError(f"data.source={config.data.source!r}; only 'synthetic' is available.")
  return SyntheticBatches(config, mesh, rules)
