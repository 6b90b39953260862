"""Grain pipelines of packed token sequences: one process's share of each batch, checkpointable.

Rows (`data.packing`), each a window of seq_len + 1 tokens; inputs = window[:-1], targets = window[1:]:
  'pack'  each token stream is cut into windows at stride seq_len (neighbours share one token), so
          every token but a stream's first is a target exactly once and a row holds the end of one
          document, the documents that fit, and the start of another; a tail shorter than a window
          is dropped.
  'pad'   one document per row: from its BOS up to and including the next document's BOS, truncated
          to seq_len + 1 tokens, the rest padding.
Documents are told apart by the BOS that starts each one (the tokenizer's; token files' own), so
each row also carries its segment layout, computed here for every source:
  segment_ids     int32 (B, L): which document of the row an input belongs to, 1, 2, ... from the
                  row's start (a row starting mid-document starts with that document); 0 marks
                  padding. Attention never crosses segments.
  positions       int32 (B, L): the input's position in its document, 0 at each BOS (and at the row's
                  start), for rotary embeddings; 0 on padding.
  target_weights  float32 (B, L): 1 where the target counts, 0 on padding. The target after a
                  document's last token is the next document's BOS: it counts, as the prediction
                  that the document ends, made from that document alone.

Order: train windows are shuffled globally with the seed, each epoch differently: Grain's
`shuffle` folds the epoch of an index past the end into its seed (seed + epoch), and `repeat()`
makes the index run on forever. Global batch s is the shuffled windows [s * G, (s + 1) * G), its
micro-batch a the windows [a * M, (a + 1) * M) of those; a process reads only the rows of each
micro-batch that its devices hold (`batches.process_rows`, from the mesh), and nothing else. So the
global batch and the iterator state ({'next_index': steps taken}) depend on neither the process count
nor the layout, and a run can resume on any. Eval windows come in order, unshuffled, and repeat as
often as asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mintrain.data import sources, tokenizer
from mintrain.data.sources import DataError
from mintrain.lazy import lazy_import

grain = lazy_import('grain')  # Loaded when a file source is first read; synthetic data never needs it.

if TYPE_CHECKING:
  from mintrain.config import DataConfig

PACKINGS = ('pack', 'pad')
PAD = -1  # Fills a padded window past its document; never a token id.
_SCAN_CHUNK = 1 << 24  # Tokens searched for BOS at a time.


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


def document_starts(stream: np.ndarray, bos: int) -> np.ndarray:
  """int64 offsets where the documents of a stream start: its first token and every BOS after it.

  Read in chunks, so a memory-mapped token file is never loaded whole.
  """
  found = [np.zeros(1, np.int64)]
  for start in range(0, len(stream), _SCAN_CHUNK):
    found.append(np.flatnonzero(np.asarray(stream[start:start + _SCAN_CHUNK]) == bos) + start)
  return np.unique(np.concatenate(found))


class PaddedDocuments:
  """Random access to one document per int32 (seq_len + 1,) window, PAD past its end; a Grain data source.

  A document runs from its start up to and including the next document's BOS (its last target),
  truncated to the window; documents with no target (a stream's lone last token) are left out.
  """

  def __init__(self, streams: Sequence[np.ndarray], seq_len: int, bos: int):
    stream_ids, starts, ends = [], [], []
    for i, stream in enumerate(streams):
      first = document_starts(stream, bos)
      last = np.minimum(np.append(first[1:] + 1, len(stream)), first + seq_len + 1)
      kept = last - first >= 2
      stream_ids.append(np.full(int(kept.sum()), i))
      starts.append(first[kept])
      ends.append(last[kept])
    self.streams, self.seq_len = streams, seq_len
    self.stream_ids, self.starts, self.ends = (np.concatenate(x) for x in (stream_ids, starts, ends))

  def __len__(self) -> int:
    return len(self.starts)

  def __getitem__(self, index: int) -> np.ndarray:
    start, end = int(self.starts[index]), int(self.ends[index])
    window = np.full(self.seq_len + 1, PAD, np.int32)
    window[:end - start] = self.streams[int(self.stream_ids[index])][start:end]
    return window


def split_inputs_targets(windows_BL: np.ndarray, bos: int) -> dict[str, np.ndarray]:
  """(B, seq_len + 1) windows (PAD past a padded document's end) -> the batch's (B, seq_len) arrays:
  inputs and targets (int32, 0 on padding), segment_ids, positions and target_weights (see the module doc)."""
  inputs_BL, targets_BL = windows_BL[:, :-1], windows_BL[:, 1:]
  counted_BL = targets_BL != PAD  # An input without a target (a padded row's last BOS) is padding too.
  starts_BL = inputs_BL == bos
  segments_BL = np.cumsum(starts_BL, axis=1, dtype=np.int32) + (~starts_BL[:, :1]).astype(np.int32)
  index_L = np.arange(inputs_BL.shape[1], dtype=np.int32)
  positions_BL = index_L - np.maximum.accumulate(np.where(starts_BL, index_L, 0), axis=1)
  return {'inputs': np.where(counted_BL, inputs_BL, 0).astype(np.int32),
          'targets': np.where(counted_BL, targets_BL, 0).astype(np.int32),
          'segment_ids': np.where(counted_BL, segments_BL, 0).astype(np.int32),
          'positions': np.where(counted_BL, positions_BL, 0).astype(np.int32),
          'target_weights': counted_BL.astype(np.float32)}


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


def make_dataset(data_cfg: DataConfig, *, split: str, seq_len: int, global_batch_size: int,
                 micro_batch_size: int, rows: np.ndarray, seed: int, bos: int) -> grain.IterDataset:
  """This process's endless local batches of `split`; `iter()` it afresh to restart (e.g. per eval).

  Elements are {'inputs', 'targets', 'segment_ids', 'positions', 'target_weights'}, each
  (global_batch_size // micro_batch_size * len(rows), seq_len), micro-batch by micro-batch, each holding
  `rows` of its micro-batch. `bos` is the tokenizer's begin-of-document id, which separates documents.
  """
  if not isinstance(seq_len, int) or seq_len < 1:
    raise DataError(f'train.seq_len={seq_len!r} must be a positive integer.')
  if global_batch_size < 1 or micro_batch_size < 1 or global_batch_size % micro_batch_size:
    raise DataError(f'train.global_batch_size={global_batch_size} must be a positive multiple of the '
                    f'micro-batch ({micro_batch_size}).')
  if not len(rows) or min(rows) < 0 or max(rows) >= micro_batch_size:
    raise DataError(f'rows {list(rows)} must be some of the micro-batch\'s {micro_batch_size} rows.')
  if data_cfg.packing not in PACKINGS:
    raise DataError(f'data.packing={data_cfg.packing!r}; choose one of {PACKINGS}.')
  streams = sources.load_split(data_cfg, split)
  if data_cfg.packing == 'pad':
    windows = PaddedDocuments(streams, seq_len, bos)
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
  split_batch = functools.partial(split_inputs_targets, bos=bos)
  ds = grain.MapDataset.source(mine).batch(mine.per_step, drop_remainder=True).map(split_batch)
  threads, prefetch = data_cfg.num_threads, data_cfg.prefetch
  read = grain.ReadOptions(num_threads=min(threads, prefetch), prefetch_buffer_size=prefetch)
  return ds.to_iter_dataset(read)


def make_iterator(data_cfg: DataConfig, **layout) -> grain.DatasetIterator:
  """An iterator over `make_dataset(data_cfg, **layout)`; `get_state()` is a JSON-able dict, `set_state`
  resumes it."""
  return iter(make_dataset(data_cfg, **layout))


def token_counts(streams: Sequence[np.ndarray]) -> np.ndarray:
  """int64 (VOCAB_SIZE,) occurrences of each id, read in chunks so a memory-mapped corpus fits."""
  counts = np.zeros(tokenizer.VOCAB_SIZE, np.int64)
  chunk = 1 << 24
  for stream in streams:
    for start in range(0, len(stream), chunk):
      counts += np.bincount(np.asarray(stream[start:start + chunk]), minlength=tokenizer.VOCAB_SIZE)
  return counts


def unigram_bits_per_byte(data_cfg: DataConfig, *, split: str = 'eval') -> float:
  """Entropy of the split's own token frequencies: the loss a model ignoring context cannot beat.

  Counts every token of the split, BOS included, as the training loss does when packing.
  """
  counts = token_counts(sources.load_split(data_cfg, split))
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())
