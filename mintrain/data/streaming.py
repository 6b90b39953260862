"""Streamed corpora and mixtures of them: one packed stream per row of the global batch, checkpointable.

Row g (of G = train.global_batch_size; row r of micro-batch a is g = a * M + r) of every global batch is the
next sequence of its own stream, so a process builds and reads only the streams of the rows its devices
hold (`batches.process_rows`), and the state, the position of every row's stream, is the same whatever the
number of processes: a run restored on another count continues the same global batches.

A row's stream: the corpus's blocks (`records.Blocks`) in an order drawn from the seed for each epoch (a
permutation of all blocks, new each epoch); row g takes every G-th slot of that endless order (slots g,
g + G, ...). Its slots are grouped in windows of `data.shuffle_window` blocks whose documents it reads
together and shuffles with the seed, so memory is a few blocks per row, whatever the size of the corpus.
Each document is BOS + its ids (a conversation, its chat template's render, with a loss weight per token);
the stream packs them as the in-memory pipeline does (windows of seq_len + 1 tokens at stride seq_len,
documents running on across windows). The eval split keeps its
blocks in file order, unshuffled.

A mixture (`data.mixture`: (settings, weight) pairs) gives each row one stream per source and draws the
source of row g at step n from the seed, in proportion to the weights; a source whose blocks run out starts
a new epoch (said on stdout, at most every 10 s).
A corpus may change between a checkpoint and its resume (shards added, removed, rewritten). The state
records each source's files (path, size, modification time, blocks) for each era of the block order: the
corpus as it was from a slot on. On resume a changed corpus is named, and `data.on_corpus_change` chooses:
'continue' keeps the checkpoint's order to the end of the epoch the rows are in (a removed or changed
file's blocks read as empty), then orders the corpus as it is now (a new era); rows whose current window
held none of those files continue exactly. 'restart' starts the source's order anew at the checkpoint's step.
State: {'step': n, 'rows': {g: [window, document, token] per source},
        'corpus': [[[first slot, first epoch, [[path, size, mtime_ns, blocks], ...]] per era] per source]}.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mintrain.data import preference, records, segments, sources, tokenizer
from mintrain.errors import DataError

if TYPE_CHECKING:
  from mintrain.data.config import DataConfig

_BLOCK_ORDER, _DOCUMENT_ORDER, _MIX = 0x0B10C, 0xD0C5, 0x313C  # Separate random streams drawn from the seed.
_STATE_WIDTH = 3  # (window, document, token) per source.
_log = logging.getLogger(__name__)  # The run routes it (metrics.console_logging).
_SAY_EVERY_S = 10.0  # At most one "ran out" line per source this often (a small corpus repeats quickly).


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


def describe(data_cfg: DataConfig) -> str:
  return f'{data_cfg.source} {data_cfg.path!r}'


def _files(blocks: records.Blocks) -> list[list]:
  """[path key, size, mtime_ns, its blocks in `blocks`] of each file: what a resume checks the corpus by."""
  counts = np.bincount(blocks.file, minlength=len(blocks.paths))
  out = []
  for key, path, count in zip(blocks.keys, blocks.paths, counts):
    if not path.exists():  # A Hub dataset's name (data.source='hf_datasets').
      out.append([key, 0, 0, int(count)])
      continue
    stat = path.stat()
    out.append([key, stat.st_size, stat.st_mtime_ns, int(count)])
  return out


@dataclasses.dataclass(frozen=True)
class _Era:
  """The corpus as the block order holds it from `first_slot` (the start of epoch `first_epoch`) on."""
  first_slot: int
  first_epoch: int
  listed: records.Blocks  # Its blocks, as listed then.
  files: list  # `_files` of the corpus then.


def _names(keys: list[str]) -> str:
  return ', '.join(keys[:3]) + (f' and {len(keys) - 3} more' if len(keys) > 3 else '')


class Split:
  """One source's blocks of one split, and which block fills each slot of the endless block order."""

  def __init__(self, data_cfg: DataConfig, tok: tokenizer.Tokenizer, split: str, seed: int,
               vocab_size: int | None = None):
    if split == 'eval' and data_cfg.eval_fraction == 0.0 and not data_cfg.eval_path:
      raise DataError('data.eval_fraction=0 leaves the eval split empty; set it to e.g. 0.05.')
    if data_cfg.eval_path and split == 'eval':  # A held-out corpus, read whole.
      data_cfg = dataclasses.replace(data_cfg, path=data_cfg.eval_path)
    self.reader, self.tok = records.Reader(data_cfg, tok, vocab_size), tok
    every = self.reader.all_blocks()
    self.held_docs: dict[str, np.ndarray] | None = None  # By block key, its documents in this split.
    self.split = split
    if data_cfg.eval_path:
      self.split_blocks = every
    else:
      chosen = sources.eval_members([every.key(i) for i in range(len(every))], data_cfg.eval_fraction)
      if len(every) == 1 and data_cfg.eval_fraction > 0:  # A small corpus: split by document instead.
        self.held_docs = self._documents_of(every, data_cfg.eval_fraction, split, describe(data_cfg))
        self.fraction = data_cfg.eval_fraction
        chosen = np.array([split == 'eval'])
      self.split_blocks = every.select(chosen if split == 'eval' else ~chosen)
    self.shuffle, self.seed, self.window = split == 'train', seed, data_cfg.shuffle_window
    self.small = False  # Fewer blocks than a batch's rows read at once (`make_iterator`): no epoch lines.
    self.name, self.epochs_said, self.said_at = describe(data_cfg), 0, -float('inf')
    self._orders: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()  # Recent epochs'.
    self.files = _files(self.split_blocks)
    self.eras = [_Era(0, 0, self.split_blocks, self.files)]

  def _documents_of(self, every: records.Blocks, fraction: float, split: str,
                    where: str) -> dict[str, np.ndarray]:
    """For a one-block corpus, which of its documents are this split's (`sources.eval_members` of their
    keys, so both splits hold one whenever there are two)."""
    count = len(self.reader.read(every, 0))
    if count < 2:
      raise sources.too_small(where, 'document')
    chosen = sources.eval_members([f'{every.key(0)}#{j}' for j in range(count)], fraction)
    return {every.key(0): chosen if split == 'eval' else ~chosen}

  def read(self, blocks: records.Blocks, i: int) -> list[records.Document]:
    """Block `i`'s documents of this split: all of them, or, split by document, this split's share (a
    block added to the corpus since, by each document's own key)."""
    docs = self.reader.read(blocks, i)
    if self.held_docs is None:
      return docs
    key = blocks.key(i)
    mine = self.held_docs.get(key)
    if mine is None:
      held = self.split == 'eval'
      mine = [sources.in_eval(f'{key}#{j}', self.fraction) == held for j in range(len(docs))]
    return [doc for doc, keep in zip(docs, mine) if keep]

  def block(self, slot: int) -> tuple[records.Blocks, int]:
    """(the blocks of the era holding `slot`, the index of the block that fills it)."""
    era = next(e for e in reversed(self.eras) if e.first_slot <= slot)
    local_epoch, k = divmod(slot - era.first_slot, len(era.listed))
    epoch = era.first_epoch + local_epoch
    if (epoch > self.epochs_said and self.shuffle and not self.small
        and time.monotonic() - self.said_at > _SAY_EVERY_S):
      self.epochs_said, self.said_at = epoch, time.monotonic()
      _log.info(f'data: {self.name} ran out; repeating it (epoch {epoch + 1}).')
    if not self.shuffle:
      return era.listed, k
    if epoch not in self._orders:  # Rows cross an epoch's end at different steps: keep a few.
      rng = np.random.default_rng([self.seed, _BLOCK_ORDER, epoch])
      self._orders[epoch] = rng.permutation(len(era.listed))
      if len(self._orders) > 4:
        self._orders.popitem(last=False)
    return era.listed, int(self._orders[epoch][k])

  def corpus_state(self) -> list:
    """The eras of the block order, JSON-able, for the data state."""
    return [[era.first_slot, era.first_epoch, era.files] for era in self.eras]

  def resume(self, eras: list, last_slot: int, on_change: str) -> str | None:
    """Takes a checkpoint's eras (`corpus_state`) on the corpus as it is now, whose rows have read up to
    slot `last_slot`; a changed corpus gets a new era ('continue', at the next epoch) or replaces the
    order ('restart'). Returns the line that says what changed, None if nothing did."""
    now = {files[0]: files[1:] for files in self.files}
    then = {files[0]: files[1:] for files in eras[-1][2]}
    self._orders.clear()  # Drawn for the eras before these.
    self.eras = [_Era(first_slot, first_epoch, self._rebuild(files), files)
                 for first_slot, first_epoch, files in eras]
    added = sorted(set(now) - set(then))
    removed = sorted(set(then) - set(now))
    changed = sorted(k for k in set(now) & set(then) if now[k] != then[k])  # Size, time or blocks.
    if not (added or removed or changed):
      return None
    what = '; '.join(f'{len(keys)} file(s) {verb} ({_names(keys)})'
                     for keys, verb in ((added, 'added'), (removed, 'removed'), (changed, 'changed')) if keys)
    current = _Era(0, 0, self.split_blocks, self.files)
    if on_change == 'restart':
      self.eras = [current]
      return (f"data: {self.name} changed since the checkpoint: {what}; its data order starts anew at the "
              f"checkpoint's step (data.on_corpus_change='restart').")
    last = self.eras[-1]
    epochs = (last_slot - last.first_slot) // len(last.listed) + 1
    self.eras.append(dataclasses.replace(current, first_slot=last.first_slot + epochs * len(last.listed),
                                         first_epoch=last.first_epoch + epochs))
    return (f"data: {self.name} changed since the checkpoint: {what}; continuing its order with the files "
            f"unchanged until epoch {last.first_epoch + epochs + 1}, which reads the corpus as it is now "
            f"(data.on_corpus_change='continue').")

  def _rebuild(self, files: list) -> records.Blocks:
    """The blocks an era listed (`files`): each unchanged file's as they are now, a file since removed or
    changed as as many empty blocks, so every block keeps its place in the order."""
    current = self.split_blocks
    if files == self.files:
      return current
    index = {row[0]: (i, row[1:]) for i, row in enumerate(self.files)}
    first = np.searchsorted(current.file, np.arange(len(current.paths) + 1))  # Blocks are in file order.
    paths, file_of, start, end = [], [], [], []
    for key, size, mtime, count in files:
      i, now = index.get(key, (None, None))
      same = now == [size, mtime, count]
      paths.append(current.paths[i] if same else None)
      file_of.append(np.full(count, len(paths) - 1, np.int32))
      start.append(current.start[first[i]:first[i + 1]] if same else np.zeros(count, np.int64))
      end.append(current.end[first[i]:first[i + 1]] if same else np.zeros(count, np.int64))
    return records.Blocks(paths, [row[0] for row in files], np.concatenate(file_of), np.concatenate(start),
                          np.concatenate(end))

  def documents(self, row: int, num_rows: int, window: int) -> list[records.Document]:
    """The documents of `row`'s window `window` (its slots window * W ... + W - 1), shuffled in training."""
    docs = []
    for k in range(window * self.window, (window + 1) * self.window):
      docs += self.read(*self.block(k * num_rows + row))
    if self.shuffle:
      order = np.random.default_rng([self.seed, _DOCUMENT_ORDER, row, window]).permutation(len(docs))
      docs = [docs[i] for i in order]
    return docs


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
