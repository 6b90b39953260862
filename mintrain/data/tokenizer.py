"""Byte-level tokenizer: token ids 0..255 are the UTF-8 bytes, then one special token.

No vocabulary file and no training: any text round-trips exactly, and since one
token is one byte, a loss in nats per token is a loss in nats per byte.
`BOS` starts every document, so it also separates documents in a packed stream.
There is no PAD token: padded rows (`data.packing='pad'`) mark padding in their segment ids
and target weights (`mintrain.data.pipeline`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

NUM_BYTES = 256
BOS = NUM_BYTES  # Begin-of-document; the separator between packed documents.
VOCAB_SIZE = NUM_BYTES + 1  # Ids the tokenizer produces; token files must stay below it.


def padded_vocab_size(multiple: int = 128) -> int:
  """VOCAB_SIZE rounded up, so the `vocab` axis splits evenly over a model axis of any size dividing it.

  The extra ids are never targets; the model learns to give them no probability.
  """
  return -(-VOCAB_SIZE // multiple) * multiple


def encode(text: str, *, bos: bool = False) -> np.ndarray:
  """int32 (n,) ids of the UTF-8 bytes of `text`, after a BOS if `bos`."""
  ids = np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32)
  return np.concatenate([np.array([BOS], np.int32), ids]) if bos else ids


def decode(ids: Sequence[int] | np.ndarray) -> str:
  """Text of the byte ids; special and out-of-range ids are dropped, broken UTF-8 becomes U+FFFD.

  Lenient on purpose: it decodes model samples, which may hold any id of the padded vocabulary.
  """
  ids = np.asarray(ids).reshape(-1)
  data = ids[(ids >= 0) & (ids < NUM_BYTES)].astype(np.uint8)
  return data.tobytes().decode('utf-8', errors='replace')


def bits_per_byte(loss_nats: float) -> float:
  """Mean cross-entropy in nats per token -> bits per byte.

  Every target is one byte except the BOS that starts each document; those are
  counted as bytes too (one per document, so ~1e-4 of the stdlib corpus).
  """
  return loss_nats / math.log(2)
