"""Grain pipelines of packed byte sequences: one process's local batches, checkpointable.

Packing: each token stream is cut into windows of seq_len + 1 tokens at stride seq_len
(neighbours share one token), so every token but a stream's first is a target exactly once;
a tail shorter than a window is dropped. inputs = window[:-1], targets = window[1:].

Order: train windows are shuffled globally with the seed, each epoch differently: Grain's
`shuffle` folds the epoch of an index past the end into its seed (seed + epoch), and `repeat()`
makes the index run on forever. Global batch s is the shuffled windows [s * G, (s + 1) * G);
process p builds only its rows [p * G / P, (p + 1) * G / P). So the global batch and the iterator
state ({'next_index': steps taken}) do not depend on the process count, and a run can resume on
another one. Eval windows come in order, unshuffled, and repeat as often as asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from mintrain.data import sources, tokenizer
from mintrain.data.sources import DataError


class PackedSequences:
  """Random access to the int32 (seq_len + 1,) windows of token streams; a Grain data source.

  Reads only the window asked for, so a memory-mapped corpus is touched only where a process reads.
  """

  def __init__(self, streams: Sequence[np.ndarray], seq_len: int):
    counts = [max(len(s) - 1, 0) // seq_len for s in streams]
    self.streams = [s for s, c in zip(streams, counts, strict=True) if c]
    self.starts = np.cumsum([0] + [c for c in counts if c])
    self.seq_len = seq_len

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, index: int) -> np.ndarray:
    j = int(np.searchsorted(self.starts, index, side='right')) - 1
    start = (index - int(self.starts[j])) * self.seq_len
    return np.asarray(self.streams[j][start:start + self.seq_len + 1], dtype=np.int32)


def split_inputs_targets(windows_BL: np.ndarray) -> dict[str, np.ndarray]:
  """(B, seq_len + 1) windows -> next-token inputs and targets, each (B, seq_len) int32."""
  return {'inputs': np.ascontiguousarray(windows_BL[:, :-1]),
          'targets': np.ascontiguousarray(windows_BL[:, 1:])}


def _check_layout(seq_len: int, global_batch_size: int, process_index: int, process_count: int) -> None:
  if not isinstance(seq_len, int) or seq_len < 1:
    raise DataError(f'train.seq_len={seq_len!r} must be a positive integer.')
  if not isinstance(process_count, int) or not 0 <= process_index < process_count:
    raise DataError(f'process_index={process_index} must be in [0, process_count={process_count}).')
  if not isinstance(global_batch_size, int) or global_batch_size < 1 or global_batch_size % process_count:
    raise DataError(f'train.global_batch_size={global_batch_size} must be a positive multiple of the '
                    f'process count {process_count}; each process reads an equal share.')


def make_dataset(data_cfg: Mapping[str, Any], *, split: str, seq_len: int, global_batch_size: int,
                 seed: int, process_index: int, process_count: int) -> grain.IterDataset:
  """This process's endless local batches of `split`; `iter()` it afresh to restart (e.g. per eval).

  Elements are {'inputs', 'targets'}: int32 (global_batch_size // process_count, seq_len).
  """
  _check_layout(seq_len, global_batch_size, process_index, process_count)
  streams = sources.load_split(data_cfg, split)
  windows = PackedSequences(streams, seq_len)
  if not len(windows):
    raise DataError(f'The {split} split of {sources.describe(data_cfg)} has {max(len(s) for s in streams)} '
                    f'tokens in its longest stream, fewer than train.seq_len + 1 = {seq_len + 1}; '
                    f'lower train.seq_len or add data.')
  threads, prefetch = sources.option(data_cfg, 'num_threads'), sources.option(data_cfg, 'prefetch')
  if not isinstance(threads, int) or not isinstance(prefetch, int) or threads < 0 or prefetch < 0:
    raise DataError(f'data.num_threads={threads!r} and data.prefetch={prefetch!r} must be integers >= 0.')
  ds = grain.MapDataset.source(windows)
  if split == 'train':
    ds = ds.shuffle(seed=seed % 2**32)
  ds = ds.repeat().batch(global_batch_size // process_count, drop_remainder=True)
  ds = ds[process_index::process_count].map(split_inputs_targets)
  read = grain.ReadOptions(num_threads=min(threads, prefetch), prefetch_buffer_size=prefetch)
  return ds.to_iter_dataset(read)


def make_iterator(data_cfg: Mapping[str, Any], *, split: str, seq_len: int, global_batch_size: int,
                  seed: int, process_index: int, process_count: int) -> grain.DatasetIterator:
  """An iterator over `make_dataset(...)`; `get_state()` is a JSON-able dict, `set_state` resumes it."""
  return iter(make_dataset(data_cfg, split=split, seq_len=seq_len, global_batch_size=global_batch_size,
                           seed=seed, process_index=process_index, process_count=process_count))


def token_counts(streams: Sequence[np.ndarray]) -> np.ndarray:
  """int64 (VOCAB_SIZE,) occurrences of each id, read in chunks so a memory-mapped corpus fits."""
  counts = np.zeros(tokenizer.VOCAB_SIZE, np.int64)
  chunk = 1 << 24
  for stream in streams:
    for start in range(0, len(stream), chunk):
      counts += np.bincount(np.asarray(stream[start:start + chunk]), minlength=tokenizer.VOCAB_SIZE)
  return counts


def unigram_bits_per_byte(data_cfg: Mapping[str, Any], *, split: str = 'eval') -> float:
  """Entropy of the split's own token frequencies: the loss a model ignoring context cannot beat.

  Counts every token of the split, BOS included, as the training loss does.
  """
  counts = token_counts(sources.load_split(data_cfg, split))
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())
