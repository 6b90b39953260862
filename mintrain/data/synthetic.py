"""Deterministic synthetic batches, a pure function of (seed, step, row).

Token sequences are arithmetic progressions modulo the vocabulary with a random
start and stride per row: learnable from two tokens, so the loss falls clearly.
MLP inputs are noisy copies of one of `num_classes` fixed random prototypes,
labelled by that prototype.
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
  """inputs (len(rows), input_dim) float32 and their prototype's label (len(rows),) int32."""
  prototypes = 0.3 * np.random.default_rng((seed, 2**31 - 1)).standard_normal((num_classes, input_dim))
  labels, x = [], []
  for g in _row_rng(seed, step, rows):
    labels.append(g.integers(num_classes))
    x.append(prototypes[labels[-1]] + g.standard_normal(input_dim))
  return {'inputs': np.stack(x).astype(np.float32), 'targets': np.asarray(labels, np.int32)}
