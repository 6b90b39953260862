"""Streamed corpora and mixtures of them: one packed stream per row of the global batch, checkpointable.

Row g (of G = train.global_batch_size; row r of micro-batch a is g = a * M + r) of every global batch is the
next sequence of its own stream, so a process builds and reads only the streams of the rows its devices
hold (`batches.process_rows`), and the state, the position of every row's stream, is the same whatever the
number of processes: a run restored on another count continues the same global batches.

A row's stream: its source's split (`splits.Split`), the blocks in an order drawn from the seed for each
epoch; row g takes every G-th slot of that endless order (slots g, g + G, ...). Its slots are grouped in
windows of `data.shuffle_window` blocks whose documents it reads together and shuffles with the seed, so
memory is a few blocks per row, whatever the size of the corpus.
Each document is BOS + its ids (a conversation, its chat template's render, with a loss weight per token);
the stream packs them as the in-memory pipeline does (windows of seq_len + 1 tokens at stride seq_len,
documents running on across windows).

A mixture (`data.mixture`: (settings, weight) pairs) gives each row one stream per source and draws the
source of row g at step n from the seed, in proportion to the weights; a source whose blocks run out starts
a new epoch (said on stdout, at most every 10 s). A corpus that changed since the checkpoint continues or
restarts its order as `data.on_corpus_change` says (`splits`).
State: {'step': n, 'rows': {g: [window, document, token] per source},
        'corpus': [[[first slot, first epoch, [[path, size, mtime_ns, blocks], ...]] per era] per source]}.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mintrain.data import preference, records, segments, tokenizer
from mintrain.data.splits import Split
from mintrain.errors import DataError

if TYPE_CHECKING:
  from mintrain.data.config import DataConfig

_MIX = 0x313C  # The mixture's draws: a random stream of the seed apart from the orders of `splits`.
_STATE_WIDTH = 3  # (window, document, token) per source.
_log = logging.getLogger(__name__)  # The run routes it (metrics.console_logging).


def encode_document(doc: records.Document, tok: tokenizer.Tokenizer) -> np.ndarray:
  """A document's ids, with the BOS and EOS the tokenizer's conventions add; token records and
  conversations (rendered by the chat template) already hold theirs."""
  if isinstance(doc, records.Conversation):
    return doc.ids
  if isinstance(doc, records.Pair):  # Both sequences, for the statistics of the tokens read.
    return np.concatenate([doc.chosen.ids, doc.rejected.ids])
  return doc if isinstance(doc, np.ndarray) else tok.document(doc)


Window = tuple[np.ndarray, np.ndarray, np.ndarray]  # (ids int32, weights float32, document starts bool).


def source_settings(data_cfg: DataConfig) -> list[tuple[DataConfig, float]]:
  """(settings, weight) of each source: the mixture's, each over `data_cfg`, or `data_cfg` alone."""
  if data_cfg.source != 'mixture':
    return [(data_cfg, 1.0)]
  return [(dataclasses.replace(data_cfg, mixture=(), **dict(settings)), float(weight))
          for settings, weight in data_cfg.mixture]


class RowStream:
  """Row `row`'s packed sequences of one source; position (window, document, token) of the next one."""

  def __init__(self, split: Split, row: int, num_rows: int, seq_len: int):
    self.split, self.row, self.num_rows, self.seq_len = split, row, num_rows, seq_len
    self.position = (0, 0, 0)
    self._windows: collections.OrderedDict[int, list] = collections.OrderedDict()
    self._tokens: collections.OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = (
        collections.OrderedDict())

  def forget(self) -> None:
    """Drops the windows and documents read so far."""
    self._windows.clear()
    self._tokens.clear()

  def _docs(self, window: int) -> list[records.Document]:
    if window not in self._windows:
      self._windows[window] = self.split.documents(self.row, self.num_rows, window)
      if len(self._windows) > 2:  # The current window and the next, which a sequence may reach into.
        self._windows.popitem(last=False)
    return self._windows[window]

  def _doc_tokens(self, window: int, doc: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A document's ids and, for a conversation, the loss weight of each (None: all count)."""
    key = (window, doc)
    if key not in self._tokens:
      document = self._docs(window)[doc]
      weights = document.weights if isinstance(document, records.Conversation) else None
      self._tokens[key] = encode_document(document, self.split.tok), weights
      if len(self._tokens) > 4:
        self._tokens.popitem(last=False)
    return self._tokens[key]

  def _find(self, window: int, doc: int) -> tuple[int, int]:
    """The position of the first document at or after (window, doc): windows may hold none."""
    empty_windows = 0
    while doc >= len(docs := self._docs(window)):
      empty_windows = empty_windows + 1 if not docs else 0
      if empty_windows > 4 * len(self.split.split_blocks) + 16:
        raise DataError(f'{self.split.name}: no documents left to read in its blocks; check the files '
                        f'(or the skipped records).')
      window, doc = window + 1, 0
    return window, doc

  def _take(self, position: tuple[int, int, int], out: Window) -> tuple[int, int, int]:
    """Fills `out` (ids, weights, starts) with the tokens from `position` on; the position after them."""
    window, doc, token = position
    out_ids, out_weights, out_starts = out
    filled = 0
    while filled < len(out_ids):
      window, doc = self._find(window, doc)  # Mid-document (token > 0), it is where it was.
      ids, weights = self._doc_tokens(window, doc)
      if token >= len(ids):  # A position in a document that changed since the checkpoint: the next one.
        doc, token = doc + 1, 0
        continue
      take = min(len(out_ids) - filled, len(ids) - token)
      out_ids[filled:filled + take] = ids[token:token + take]
      out_weights[filled:filled + take] = 1.0 if weights is None else weights[token:token + take]
      out_starts[filled] = token == 0
      filled, token = filled + take, token + take
      if token == len(ids):
        doc, token = doc + 1, 0
    return window, doc, token

  def next_sequence(self) -> Window:
    """(seq_len + 1,) ids, weights and document starts of the next window; the one after starts at its
    last token."""
    size = self.seq_len + 1
    out = np.empty(size, np.int32), np.empty(size, np.float32), np.zeros(size, bool)
    self.position = self._take(self.position, tuple(x[:-1] for x in out))
    self._take(self.position, tuple(x[-1:] for x in out))
    return out

  def next_document(self, separators: segments.Separators) -> Window:
    """(seq_len + 1,) ids, weights and document starts of the next document with a target, alone in its
    window (`data.packing='pad'`): truncated, PAD (weight 0) past its end; the next document's BOS, where
    documents start with one, is a text document's last target, as in a packed row."""
    window, doc, _ = self.position
    while True:
      window, doc = self._find(window, doc)
      document = self._docs(window)[doc]
      if isinstance(document, records.Pair):  # (2, seq_len + 1): chosen, then rejected.
        self.position = (window, doc + 1, 0)
        parts = [_padded(c.ids, c.weights, self.seq_len) for c in (document.chosen, document.rejected)]
        return tuple(np.stack(x) for x in zip(*parts))
      ids, weights = self._doc_tokens(window, doc)
      doc += 1
      if weights is None:
        if separators.bos is not None:
          ids = np.append(ids, separators.bos)
        weights = np.ones(len(ids), np.float32)
      if len(ids) >= 2:
        self.position = (window, doc, 0)
        return _padded(ids, weights, self.seq_len)


  def next_pairs(self) -> Window:
    """(2, seq_len + 1) ids, weights and document starts of the next preference pairs packed into one row
    (`data.packing='pack'`): each pair's chosen in the first half and its rejected in the second, in the
    same order, as many whole pairs as both halves hold (at least one, truncated as a padded one is),
    PAD (weight 0) past them."""
    size = self.seq_len + 1
    ids, weights = np.full((2, size), segments.PAD, np.int32), np.zeros((2, size), np.float32)
    starts = np.zeros((2, size), bool)
    used, pairs = [0, 0], 0
    window, doc, _ = self.position
    while pairs < preference.max_pairs_per_row(self.seq_len):
      window, doc = self._find(window, doc)
      pair = self._docs(window)[doc]
      halves = (pair.chosen, pair.rejected)
      if pairs and any(used[k] + len(h.ids) > size for k, h in enumerate(halves)):
        break
      for k, half in enumerate(halves):
        n = min(len(half.ids), size - used[k])
        ids[k, used[k]:used[k] + n], weights[k, used[k]:used[k] + n] = half.ids[:n], half.weights[:n]
        starts[k, used[k]] = True
        used[k] += n
      pairs, doc = pairs + 1, doc + 1
    self.position = (window, doc, 0)
    return ids, weights, starts


def _padded(ids: np.ndarray, weights: np.ndarray, seq_len: int) -> Window:
  """A document alone in its (seq_len + 1,) window: ids, weights (0 past its end) and starts."""
  padded = np.zeros(seq_len + 1, np.float32)
  padded[:min(len(weights), seq_len + 1)] = weights[:seq_len + 1]
  starts = np.zeros(seq_len + 1, bool)
  starts[0] = True
  return segments.padded_window(ids, seq_len), padded, starts


def mixture_choices(weights: Sequence[float], seed: int, step: int, num_rows: int) -> np.ndarray:
  """int (num_rows,): the source of each row of the global batch of `step`, in proportion to `weights`."""
  if len(weights) == 1:
    return np.zeros(num_rows, np.int64)
  cumulative = np.cumsum(weights) / np.sum(weights)
  u = np.random.default_rng([seed, _MIX, step]).random(num_rows)
  return np.minimum(np.searchsorted(cumulative, u, side='right'), len(weights) - 1)


def token_fractions(data_cfg: DataConfig, seed: int, num_rows: int, steps: range) -> dict[str, float]:
  """{'data_fraction_<i>': share of the tokens of `steps` from source i} of a mixture: the draws of
  `mixture_choices`, the same on every process."""
  weights = [w for _, w in source_settings(data_cfg)]
  counts = np.zeros(len(weights), np.int64)
  for step in steps:
    counts += np.bincount(mixture_choices(weights, seed, step, num_rows), minlength=len(weights))
  return {f'data_fraction_{i}': float(c / max(counts.sum(), 1)) for i, c in enumerate(counts)}


class RowsIterator:
  """This process's local batches: its rows of each step, micro-batch by micro-batch."""

  def __init__(self, splits: list[Split], weights: list[float], rows: np.ndarray, num_rows: int,
               seq_len: int, seed: int, separators: segments.Separators, padded: bool, on_corpus_change: str):
    self.splits, self.on_corpus_change = splits, on_corpus_change
    self.weights, self.rows, self.num_rows, self.seed = weights, rows, num_rows, seed
    self.separators, self.padded = separators, padded
    # Conversations and preference pairs mark where documents start.
    self.chat = any(split.reader.chat or split.reader.preference for split in splits)
    self.streams = {int(g): [RowStream(s, int(g), num_rows, seq_len) for s in splits] for g in rows}
    self.step = 0

  def __iter__(self) -> RowsIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    choice = mixture_choices(self.weights, self.seed, self.step, self.num_rows)
    streams = [self.streams[int(g)][choice[g]] for g in self.rows]
    parts = [s.next_document(self.separators) if self.padded else
             s.next_pairs() if s.split.reader.preference else s.next_sequence() for s in streams]
    windows, weights, starts = (np.stack(x) for x in zip(*parts))
    self.step += 1
    size = windows.shape[-1]  # Pairs' (B, 2, seq_len + 1) are split as 2B rows.
    windows_BL, weights_BL, starts_BL = (x.reshape(-1, size) for x in (windows, weights, starts))
    out = segments.split_inputs_targets(windows_BL, self.separators, weights_BL,
                                        starts_BL if self.chat else None)
    return {key: value.reshape(*windows.shape[:-1], size - 1) for key, value in out.items()}

  def get_state(self) -> dict[str, Any]:
    return {'step': self.step,
            'rows': {str(g): [p for s in streams for p in s.position] for g, streams in self.streams.items()},
            'corpus': [split.corpus_state() for split in self.splits]}

  def set_state(self, state: Mapping[str, Any]) -> None:
    missing = [g for g in self.streams if str(g) not in state['rows']]
    if missing:
      raise DataError(f"The data state holds no position for row(s) {missing}; it was saved with another "
                      f'train.global_batch_size or data.mixture.')
    self.step = int(state['step'])
    for g, streams in self.streams.items():
      position = state['rows'][str(g)]
      if len(position) != _STATE_WIDTH * len(streams):
        raise DataError(f'The data state of row {g} has {len(position) // _STATE_WIDTH} source(s), this '
                        f'data.mixture {len(streams)}; it cannot continue it.')
      for i, stream in enumerate(streams):
        stream.position = tuple(int(p) for p in position[_STATE_WIDTH * i:_STATE_WIDTH * (i + 1)])
        stream.forget()  # Windows read before may be of another era.
    for i, (split, eras) in enumerate(zip(self.splits, state.get('corpus', []))):
      windows = [position[_STATE_WIDTH * i] for position in state['rows'].values()]
      last_slot = max(((w + 1) * split.window - 1) * self.num_rows + int(g)
                      for g, w in zip(state['rows'], windows))
      change = split.resume(eras, last_slot, self.on_corpus_change)
      if change:
        _log.warning(f'warning: {change}')
      if change and self.on_corpus_change == 'restart':
        for streams in self.streams.values():
          streams[i].position = (0, 0, 0)


class Prefetch:
  """`ahead` batches of `rows` read on a daemon thread; the state is that of the batches handed out.

  The first batch is read before it returns, so a bad first block stops a run before it writes anything.
  """

  def __init__(self, rows: RowsIterator, ahead: int):
    self.rows, self.ahead = rows, ahead
    self.state = rows.get_state()
    self.first = (next(rows), rows.get_state())
    self._start()

  def _start(self) -> None:
    self.queue: queue.Queue = queue.Queue(maxsize=self.ahead)
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._fill, args=(self.queue, self.stop), daemon=True,
                                   name='mintrain-data')
    self.thread.start()

  def _fill(self, out: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
      try:
        item = (next(self.rows), self.rows.get_state())
      except Exception as e:  # Handed to the reader, which raises it where the batch was wanted.
        item = e
      while not stop.is_set():
        try:
          out.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if isinstance(item, Exception):
        return

  def __iter__(self) -> Prefetch:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    item, self.first = self.first or self.queue.get(), None
    if isinstance(item, Exception):
      raise item
    batch, self.state = item
    return batch

  def get_state(self) -> dict[str, Any]:
    return self.state

  def set_state(self, state: Mapping[str, Any]) -> None:
    self.stop.set()
    self.thread.join()
    self.first = None
    self.rows.set_state(state)
    self.state = self.rows.get_state()
    self._start()


def make_iterator(data_cfg: DataConfig, tok: tokenizer.Tokenizer, *, split: str, seq_len: int,
                  global_batch_size: int, micro_batch_size: int, rows: np.ndarray, seed: int,
                  separators: segments.Separators | None = None,
                  vocab_size: int | None = None) -> RowsIterator | Prefetch:
  """This process's endless local batches of a streamed source or mixture (the layout of
  `pipeline.make_dataset`, packed or padded as `data.packing` says), read `data.prefetch` batches ahead
  on a thread; text becomes ids by the run's tokenizer `tok` and documents are told apart by `separators`
  (default: `tok`'s; conversations by where each starts); token records' ids must be below `vocab_size`
  (default: `tok`'s)."""
  settings = source_settings(data_cfg)
  splits = [Split(cfg, tok, split, seed, vocab_size) for cfg, _ in settings]
  for part in splits if split == 'train' else ():
    if len(part.split_blocks) < global_batch_size * part.window:
      part.small = True
      _log.info(f'data: {part.name} is small ({len(part.split_blocks)} block(s) of data.block_bytes for '
                f'{global_batch_size} rows of {part.window} blocks each): the rows share its blocks, and it '
                f'repeats from the first batch on.')
  accum = global_batch_size // micro_batch_size
  mine = (np.arange(accum)[:, None] * micro_batch_size + np.asarray(rows)[None, :]).reshape(-1)
  separators = separators or segments.Separators.of(tok)
  local = RowsIterator(splits, [w for _, w in settings], mine, global_batch_size, seq_len, seed, separators,
                       padded=data_cfg.packing == 'pad', on_corpus_change=data_cfg.on_corpus_change)
  return Prefetch(local, data_cfg.prefetch) if data_cfg.prefetch else local


def gather_rows(state: dict[str, Any], num_rows: int) -> dict[str, Any]:
  """The state with every process's rows: each process holds only its own, a checkpoint needs all."""
  if jax.process_count() == 1:
    return state
  from jax.experimental import multihost_utils
  width = len(next(iter(state['rows'].values())))
  mine = np.full((num_rows, width), -1, np.int64)
  for g, position in state['rows'].items():
    mine[int(g)] = position
  every = np.asarray(multihost_utils.process_allgather(mine)).max(axis=0)  # Rows held twice agree.
  return {**state, 'rows': {str(g): [int(p) for p in every[g]] for g in range(num_rows)
                            if every[g, 0] >= 0}}
