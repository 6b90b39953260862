"""Causal self-attention's queries in blocks, each scoring only the keys it may see.

The einsum path scores every query against every key, the (L, L) matrix, though a causal query sees at
most the keys up to its own. Over tokens stored in position order (packed documents too: each document's
tokens in order), a block of queries [s, e) sees no key stored after e, nor, with a sliding window W, any
stored before s - W + 1; so it scores only keys [k, e), and the blocks together score about half the
matrix (less with a window), in smaller products that stay in cache. Each query's visible keys lie within
its block's, so every query gets the softmax it gets over the whole matrix. Only padding, whose positions
are all 0, sees keys stored after it by position: it sees fewer of its own kind in blocks, and no counted
token reads padding.
"""

from __future__ import annotations

# (first query, end of the queries, first key) of each block: block [s, e) scores keys [k, e).
Blocks = list[tuple[int, int, int]]


def query_blocks(length: int, rows: int, window: int = 0) -> Blocks:
  """The blocks of `rows` queries (the last may be shorter) of a sequence of `length` tokens."""
  return [(s, min(s + rows, length), max(0, s - window + 1) if window else 0) for s in range(0, length, rows)]


def keys_scored(length: int, rows: int, window: int = 0) -> float:
  """Keys each query scores, on average over the sequence, in blocks of `rows` queries."""
  return sum((e - s) * (e - k) for s, e, k in query_blocks(length, rows, window)) / length
