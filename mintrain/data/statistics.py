"""What the eval split says before training: the unigram entropy a model must beat, and UTF-8 bytes per
token (for bits per byte), of in-memory and streamed sources alike."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mintrain.data import pipeline, sources, splits, streaming, tokenizer
from mintrain.data.config import DataConfig

BASELINE_TOKENS = 1 << 26  # Tokens of each streamed source's eval split counted for its unigram entropy.


def token_counts(streams: Sequence[np.ndarray]) -> np.ndarray:
  """int64 occurrences of each id (up to the largest), read in chunks so a memory-mapped corpus fits."""
  counts = np.zeros(0, np.int64)
  chunk = 1 << 24
  for stream in streams:
    for start in range(0, len(stream), chunk):
      counts = _add_counts(counts, np.bincount(np.asarray(stream[start:start + chunk])))
  return counts


def unigram_bits_per_token(data_cfg: DataConfig, tok: tokenizer.Tokenizer, *, split: str = 'eval') -> float:
  """Entropy of the split's own token frequencies: the loss a model ignoring context cannot beat.

  Counts every token of the split, BOS and EOS included, as the training loss does when packing (of a
  streamed source, its first 2**26 tokens; of a mixture, each source's frequencies weighted by its share).
  """
  if pipeline.streamed(data_cfg):
    counts = _streamed_unigram_counts(data_cfg, tok, split)
  else:
    counts = token_counts(sources.load_split(data_cfg, tok, split))
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())


def bytes_per_token(data_cfg: DataConfig, tok: tokenizer.Tokenizer, *, split: str = 'eval',
                    max_tokens: int = 1 << 22) -> float:
  """UTF-8 bytes per token of the split: the tokenizer's own figure where it is fixed (bytes: 1), else
  measured: the text files' bytes over their tokens (BOS and EOS included, as the loss counts them), or
  for token files, the bytes their first `max_tokens` tokens decode to."""
  if tok.bytes_per_token is not None:
    return tok.bytes_per_token
  if pipeline.streamed(data_cfg):
    return _streamed_bytes_per_token(data_cfg, tok, split)
  streams = sources.load_split(data_cfg, tok, split)
  if data_cfg.source != 'tokens':
    return sources.text_bytes(data_cfg, split) / sum(len(s) for s in streams)
  ids = np.concatenate([np.asarray(s[:max_tokens]) for s in streams])[:max_tokens]
  return len(tok.decode(ids).encode('utf-8')) / len(ids)


def _eval_documents(data_cfg: DataConfig, tok: tokenizer.Tokenizer,
                    split: str) -> Iterator[tuple[int, Any, np.ndarray]]:
  """(source index, document, its ids) of the first `BASELINE_TOKENS` of each source's split, in file
  order: what the unigram baseline and the bytes per token are measured on."""
  for source, (cfg, _) in enumerate(streaming.source_settings(data_cfg)):
    part, seen = splits.Split(cfg, tok, split, seed=0), 0
    for i in range(len(part.split_blocks)):
      for doc in part.read(part.split_blocks, i):
        ids = streaming.encode_document(doc, tok)
        seen += len(ids)
        yield source, doc, ids
      if seen >= BASELINE_TOKENS:
        break


def _add_counts(counts: np.ndarray, more: np.ndarray) -> np.ndarray:
  """Per-id counts of two lengths summed, the shorter padded with zeros."""
  size = max(len(counts), len(more))
  return np.pad(counts, (0, size - len(counts))) + np.pad(more, (0, size - len(more)))


def _streamed_unigram_counts(data_cfg: DataConfig, tok: tokenizer.Tokenizer, split: str) -> np.ndarray:
  """float64 frequency of each id in each source's measured split (`_eval_documents`), each source's
  frequencies scaled to its mixture weight."""
  weights = [w for _, w in streaming.source_settings(data_cfg)]
  counts = [np.zeros(0, np.int64) for _ in weights]
  for source, _, ids in _eval_documents(data_cfg, tok, split):
    counts[source] = _add_counts(counts[source], np.bincount(ids))
  total = np.zeros(0, np.float64)
  for weight, c in zip(weights, counts):
    total = _add_counts(total, weight * c / max(c.sum(), 1))
  return total


def _streamed_bytes_per_token(data_cfg: DataConfig, tok: tokenizer.Tokenizer, split: str) -> float:
  """UTF-8 bytes per token of each source's measured split (`_eval_documents`; token records and chats
  decoded by the tokenizer), averaged over the sources by their mixture weights."""
  weights = [w for _, w in streaming.source_settings(data_cfg)]
  num_bytes, num_tokens = np.zeros(len(weights)), np.zeros(len(weights))
  for source, doc, ids in _eval_documents(data_cfg, tok, split):
    text = doc if isinstance(doc, str) else tok.decode(ids)
    num_bytes[source] += len(text.encode('utf-8'))
    num_tokens[source] += len(ids)
  return float(np.dot(weights, num_bytes / np.maximum(num_tokens, 1)) / sum(weights))
