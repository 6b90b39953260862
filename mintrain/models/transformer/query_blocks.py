"""Causal self-attention's queries in blocks, each scoring only the keys it may see.

The einsum path scores every query against every key, the (L, L) matrix, though a causal query sees at
most the keys up to its own. Over tokens stored in position order (packed documents too: each document's
tokens in order), a block of queries [s, e) sees no key stored after e, nor, with a sliding window W, any
stored before s - W + 1; so it scores only keys [k, e), and the blocks together score about half the
matrix (less with a window), in smaller products that stay in cache. Each query's visible keys lie within
its block's, so every query gets the softmax it gets over the whole matrix. Only padding, whose positions
are all 0, sees keys stored after it by position: it sees fewer of its own kind in blocks, and no counted
token reads padding.

A prefill (`Attention.decode` of new tokens at a known `start`) is the same: its queries sit at positions
start.., the cache's slots hold positions 0.., so block [s, e) sees no slot past start + e.
"""

from __future__ import annotations

# (first query, end of the queries, first key, end of the keys): block [s, e) scores keys [k, m).
Blocks = list[tuple[int, int, int, int]]


def query_blocks(length: int, rows: int, window: int = 0, start: int = 0) -> Blocks:
  """The blocks of `rows` queries (the last may be shorter) of `length` tokens at positions start.., over
  keys stored by position (index = position: the same tokens, or a cache that holds them from 0)."""
  return [(s, e, max(0, start + s - window + 1) if window else 0, start + e)
          for s in range(0, length, rows) for e in [min(s + rows, length)]]


def keys_scored(length: int, rows: int, window: int = 0) -> float:
  """Keys each query scores, on average over the sequence, in blocks of `rows` queries."""
  return sum((e - s) * (m - k) for s, e, k, m in query_blocks(length, rows, window)) / length
