"""Grain pipelines of rows of seq_len + 1 tokens (`data.packing`: documents back to back, or one per row),
globally shuffled with the seed and each epoch anew. A process reads only its devices' rows of each batch
(`batches.process_rows`), so the batches and the iterator state depend on neither process count nor layout."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mintrain.data import records, segments, sources, streaming, tokenizer
from mintrain.errors import DataError
from mintrain.runtime.lazy import lazy_import

grain = lazy_import('grain')  # Loaded when a file source is first read; synthetic data never needs it.

if TYPE_CHECKING:
  from mintrain.data.config import DataConfig


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


class PaddedDocuments:
  """Random access to one document per int32 (seq_len + 1,) window, PAD past its end; a Grain data source.

  A document runs from its start up to its last target (`segments.documents_with_targets`), truncated
  to the window; documents with no target (a stream's lone last token) are left out.
  """

  def __init__(self, streams: Sequence[np.ndarray], seq_len: int, separators: segments.Separators):
    self.streams, self.seq_len = streams, seq_len
    self.stream_ids, self.starts, self.ends = segments.documents_with_targets(streams, seq_len, separators)

  def __len__(self) -> int:
    return len(self.starts)

  def __getitem__(self, index: int) -> np.ndarray:
    start, end = int(self.starts[index]), int(self.ends[index])
    return segments.padded_window(self.streams[int(self.stream_ids[index])][start:end], self.seq_len)


class ProcessRows:
  """Random access to one process's windows of each global batch, in order: step s, micro-batch a,
  then row `rows[j]` of that micro-batch; a Grain data source over `windows` (which may be endless)."""

  def __init__(self, windows: grain.MapDataset, global_batch_size: int, micro_batch_size: int,
               rows: np.ndarray):
    self.windows, self.rows = windows, rows
    self.global_batch, self.micro = global_batch_size, micro_batch_size
    self.per_step = global_batch_size // micro_batch_size * len(rows)

  def __len__(self) -> int:
    return len(self.windows) // self.global_batch * self.per_step

  def __getitem__(self, index: int) -> np.ndarray:
    step, rest = divmod(index, self.per_step)
    micro, j = divmod(rest, len(self.rows))
    return self.windows[step * self.global_batch + micro * self.micro + int(self.rows[j])]


def make_dataset(data_cfg: DataConfig, tok: tokenizer.Tokenizer, *, split: str, seq_len: int,
                 global_batch_size: int, micro_batch_size: int, rows: np.ndarray, seed: int,
                 separators: segments.Separators | None = None,
                 vocab_size: int | None = None) -> grain.IterDataset:
  """This process's endless local batches of `split`; `iter()` it afresh to restart (e.g. per eval).

  Elements are {'inputs', 'targets', 'segment_ids', 'positions', 'target_weights'}, each
  (global_batch_size // micro_batch_size * len(rows), seq_len), micro-batch by micro-batch, each holding
  `rows` of its micro-batch; text becomes ids by the run's tokenizer `tok`, and `separators` (default:
  `tok`'s) tell documents apart. Every id is below `vocab_size` (the model's; default: `tok`'s), or it is a
  DataError.
  """
  if not len(rows) or min(rows) < 0 or max(rows) >= micro_batch_size:
    raise DataError(f'rows {list(rows)} must be some of the micro-batch\'s {micro_batch_size} rows.')
  separators = separators or segments.Separators.of(tok)
  streams = sources.load_split(data_cfg, tok, split, vocab_size=vocab_size)
  if data_cfg.packing == 'pad':
    windows = PaddedDocuments(streams, seq_len, separators)
    if not len(windows):
      raise DataError(f'The {split} split of {sources.describe(data_cfg)} has no document of two or more '
                      f"tokens; add data or use data.packing='pack'.")
  else:
    windows = PackedSequences(streams, seq_len)
    if not len(windows):
      raise DataError(f'The {split} split of {sources.describe(data_cfg)} has {max(len(s) for s in streams)} '
                      f'tokens in its longest stream, fewer than train.seq_len + 1 = {seq_len + 1}; '
                      f"lower train.seq_len, add data or use data.packing='pad'.")
  ds = grain.MapDataset.source(windows)
  if split == 'train':
    ds = ds.shuffle(seed=seed % 2**32)
  mine = ProcessRows(ds.repeat(), global_batch_size, micro_batch_size, np.asarray(rows))
  split_batch = functools.partial(segments.split_inputs_targets, separators=separators)
  ds = grain.MapDataset.source(mine).batch(mine.per_step, drop_remainder=True).map(split_batch)
  threads, prefetch = data_cfg.num_threads, data_cfg.prefetch
  read = grain.ReadOptions(num_threads=min(threads, prefetch), prefetch_buffer_size=prefetch)
  return ds.to_iter_dataset(read)


def streamed(data_cfg: DataConfig) -> bool:
  """Whether the source is read a block at a time (`streaming`) rather than loaded (`sources`)."""
  return data_cfg.source in (*records.FORMATS, 'mixture')


def make_iterator(data_cfg: DataConfig, tok: tokenizer.Tokenizer, **layout) -> grain.DatasetIterator:
  """An iterator over `make_dataset(data_cfg, tok, **layout)`, or over a streamed source's or mixture's
  rows (`streaming`); `get_state()` is a JSON-able dict, `set_state` resumes it."""
  if streamed(data_cfg):
    return streaming.make_iterator(data_cfg, tok, **layout)
  return iter(make_dataset(data_cfg, tok, **layout))
