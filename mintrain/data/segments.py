"""Document boundaries in packed or padded rows, for every source: `segment_ids` (which document of the row,
0 for padding; attention never crosses them), `positions` (restarting at each document, for RoPE) and
`target_weights` (0 on padding; the prediction that a document ends counts), found from the tokenizer's
separators (a BOS, or for tokenizers without one, the previous EOS)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

PAD = -1  # Fills a padded window past its document; never a token id.
_SCAN_CHUNK = 1 << 24  # Tokens searched for separators at a time.


@dataclasses.dataclass(frozen=True)
class Separators:
  """The ids that separate documents in a stream: BOS starts one; EOS (when not BOS) ends one."""

  bos: int | None
  eos: int | None

  @classmethod
  def of(cls, tokenizer: Any) -> Separators:
    return cls(tokenizer.bos_id, tokenizer.eos_id)

  @property
  def _eos_ends(self) -> bool:
    return self.eos is not None and self.eos != self.bos

  def starts(self, ids_BL: np.ndarray) -> np.ndarray:
    """bool, the shape of `ids_BL`: where a document starts, as far as the ids show (a row's first
    position only when it holds a BOS)."""
    starts = ids_BL == self.bos if self.bos is not None else np.zeros(ids_BL.shape, bool)
    if self._eos_ends:
      starts[..., 1:] |= ids_BL[..., :-1] == self.eos
    return starts

  def document_starts(self, stream: np.ndarray) -> np.ndarray:
    """int64 offsets where the documents of a stream start: its first token and every start after it.
    Read in chunks, so a memory-mapped token file is never loaded whole."""
    found = [np.zeros(1, np.int64)]
    for start in range(0, len(stream), _SCAN_CHUNK):
      chunk = np.asarray(stream[start:start + _SCAN_CHUNK])
      if self.bos is not None:
        found.append(np.flatnonzero(chunk == self.bos) + start)
      if self._eos_ends:
        found.append(np.flatnonzero(chunk == self.eos) + start + 1)
    starts = np.unique(np.concatenate(found))
    return starts[starts < len(stream)]

  def padded_end(self, next_start: int) -> int:
    """Where a padded document that ends at `next_start` stops: after the next document's BOS, its last
    target (as a packed row counts it), or at its own EOS for a tokenizer without BOS."""
    return next_start + (1 if self.bos is not None else 0)


def padded_window(ids: np.ndarray, seq_len: int) -> np.ndarray:
  """int32 (seq_len + 1,): a document's ids truncated to the window, PAD past its end."""
  window = np.full(seq_len + 1, PAD, np.int32)
  window[:min(len(ids), seq_len + 1)] = ids[:seq_len + 1]
  return window


def split_inputs_targets(windows_BL: np.ndarray, separators: Separators, weights_BL: np.ndarray | None = None,
                         starts_BL: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """(B, seq_len + 1) windows (PAD past a padded document's end) -> the batch's (B, seq_len) arrays:
  inputs and targets (int32, 0 on padding), segment_ids, positions and target_weights (module doc).

  `weights_BL` (B, seq_len + 1), where given, is the loss weight of each token as a target (chat data's
  `data.loss_on`), and `starts_BL` (B, seq_len + 1) where documents start, instead of the separators (a
  conversation may hold its tokenizer's EOS in every turn)."""
  inputs_BL, targets_BL = windows_BL[:, :-1], windows_BL[:, 1:]
  counted_BL = targets_BL != PAD  # An input without a target (a padded row's last BOS) is padding too.
  starts_BL = separators.starts(inputs_BL) if starts_BL is None else starts_BL[:, :-1]
  segments_BL = np.cumsum(starts_BL, axis=1, dtype=np.int32) + (~starts_BL[:, :1]).astype(np.int32)
  index_L = np.arange(inputs_BL.shape[1], dtype=np.int32)
  positions_BL = index_L - np.maximum.accumulate(np.where(starts_BL, index_L, 0), axis=1)
  return {'inputs': np.where(counted_BL, inputs_BL, 0).astype(np.int32),
          'targets': np.where(counted_BL, targets_BL, 0).astype(np.int32),
          'segment_ids': np.where(counted_BL, segments_BL, 0).astype(np.int32),
          'positions': np.where(counted_BL, positions_BL, 0).astype(np.int32),
          'target_weights': (counted_BL if weights_BL is None else counted_BL * weights_BL[:, 1:]
                             ).astype(np.float32)}


def documents_with_targets(streams: Sequence[np.ndarray], seq_len: int,
                           separators: Separators) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(stream index, start, end) of every document of the streams as a padded row holds it, truncated to
  seq_len + 1 tokens; documents with no target (fewer than two tokens) are left out."""
  stream_ids, starts, ends = [], [], []
  for i, stream in enumerate(streams):
    first = separators.document_starts(stream)
    nxt = np.append(first[1:], len(stream))
    last = np.minimum(np.where(nxt < len(stream), separators.padded_end(nxt), nxt), first + seq_len + 1)
    kept = last - first >= 2
    stream_ids.append(np.full(int(kept.sum()), i))
    starts.append(first[kept])
    ends.append(last[kept])
  return tuple(np.concatenate(x) for x in (stream_ids, starts, ends))
