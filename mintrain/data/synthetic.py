"""Deterministic synthetic batches, a pure function of (seed, step, row).

Token sequences are arithmetic progressions modulo the vocabulary with a random
start and stride per row: learnable from two tokens, so the loss falls clearly.
MLP inputs are Gaussian vectors labelled by a fixed random linear teacher.
Every row depends only on the seed, the step and its global index, so any
process layout produces the same global batch.
"""

from __future__ import annotations

import numpy as np


def _row_rng(seed: int, step: int, rows: np.ndarray) -> list[np.random.Generator]:
  return [np.random.default_rng((seed, step, int(r))) for r in rows]


def token_rows(seed: int, step: int, rows: np.ndarray, seq_len: int, vocab_size: int) -> dict:
  """inputs/targets (len(rows), seq_len) int32 for the given global row indices."""
  starts, strides = [], []
  for g in _row_rng(seed, step, rows):
    starts.append(g.integers(vocab_size))
    strides.append(g.integers(1, 8))
  t = np.arange(seq_len + 1)
  seq = (np.asarray(starts)[:, None] + np.asarray(strides)[:, None] * t[None, :]) % vocab_size
  seq = seq.astype(np.int32)
  return {'inputs': seq[:, :-1], 'targets': seq[:, 1:]}


def classification_rows(seed: int, step: int, rows: np.ndarray, input_dim: int,
                        num_classes: int) -> dict:
  """inputs (len(rows), input_dim) float32 and teacher labels (len(rows),) int32."""
  teacher = np.random.default_rng((seed, 2**31 - 1)).standard_normal((input_dim, num_classes))
  x = np.stack([g.standard_normal(input_dim) for g in _row_rng(seed, step, rows)]).astype(np.float32)
  return {'inputs': x, 'targets': np.argmax(x @ teacher, axis=-1).astype(np.int32)}
