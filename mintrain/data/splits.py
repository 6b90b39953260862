"""One source's train or eval split of a streamed corpus: its blocks, and which block fills each slot of the
endless block order that the rows' streams (`streaming`) read.

Whole blocks (`records.Blocks`) go to one split by their keys (`sources.eval_members`); a one-block corpus is
split by document. The train split orders its blocks by a permutation drawn from the seed for each epoch (new
each epoch); the eval split keeps them in file order, unshuffled. A window of `data.shuffle_window` slots is
read together, its documents shuffled with the seed in training (`Split.documents`).

A corpus may change between a checkpoint and its resume (shards added, removed, rewritten). The state
records each source's files (path, size, modification time, blocks) for each era of the block order: the
corpus as it was from a slot on. On resume a changed corpus is named, and `data.on_corpus_change` chooses:
'continue' keeps the checkpoint's order to the end of the epoch the rows are in (a removed or changed
file's blocks read as empty), then orders the corpus as it is now (a new era); rows whose current window
held none of those files continue exactly. 'restart' starts the source's order anew at the checkpoint's step.
State (`Split.corpus_state`): [[first slot, first epoch, [[path, size, mtime_ns, blocks], ...]] per era].
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from mintrain.data import records, sources, tokenizer
from mintrain.errors import DataError

if TYPE_CHECKING:
  from mintrain.data.config import DataConfig

_BLOCK_ORDER, _DOCUMENT_ORDER = 0x0B10C, 0xD0C5  # Separate random streams drawn from the seed.
_log = logging.getLogger(__name__)  # The run routes it (metrics.console_logging).
_SAY_EVERY_S = 10.0  # At most one "ran out" line per source this often (a small corpus repeats quickly).


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
