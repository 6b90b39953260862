"""Causal attention in blocks of queries: each block scores only the keys its queries may see.

The model-level checks (each block's softmax is the whole matrix's) are where the model is compared with
transformers and with itself: tests/test_hf.py (logits, loss and gradients), tests/test_sliding_window.py
(windows), tests/test_deepseek.py (latent attention), tests/test_packing.py (packed documents, padding).
"""

import numpy as np
import pytest

from mintrain.data import segments, tokenizer
from mintrain.models.transformer.context_attention import visible
from mintrain.models.transformer.query_blocks import keys_scored, query_blocks

BYTES = segments.Separators.of(tokenizer.BYTES)


def packed_rows(length: int, seed: int) -> dict:
  """Rows of random documents packed by the data pipeline's own layout, some ending in padding."""
  rng = np.random.default_rng(seed)
  windows_BL = rng.integers(1, 200, (6, length + 1)).astype(np.int32)
  windows_BL[rng.random(windows_BL.shape) < 0.15] = tokenizer.BOS
  for row, pad in enumerate(rng.integers(0, length // 2, len(windows_BL))):
    windows_BL[row, length + 1 - pad:] = -1  # Padding, as `pipeline.PaddedDocuments` marks it.
  return segments.split_inputs_targets(windows_BL, separators=BYTES)


@pytest.mark.parametrize('length,rows,window', [(32, 8, 0), (32, 5, 0), (32, 8, 6), (33, 8, 20), (32, 1, 3),
                                                (16, 64, 0)])
def test_every_key_a_token_sees_lies_within_its_blocks_keys(length, rows, window):
  batch = packed_rows(length, seed=length + rows + window)
  positions_BL, segments_BL = batch['positions'], batch['segment_ids']
  assert (segments_BL == 0).any() and (segments_BL.max(axis=1) > 1).any()  # Padding, and packed documents.
  visible_BLM = visible(positions_BL, positions_BL, segments_BL, segments_BL, window)
  blocks = query_blocks(length, rows, window)
  assert np.concatenate([np.arange(s, e) for s, e, _, _ in blocks]).tolist() == list(range(length))
  assert all(m == e for _, e, _, m in blocks)  # Keys end with the queries.
  outside = np.ones((length, length), bool)
  for s, e, k, m in blocks:
    outside[s:e, k:m] = False
  counted_BL1 = (segments_BL > 0)[:, :, None]
  assert not (visible_BLM & outside & counted_BL1).any()
  if rows < length:  # The check can fail: padding sees padding stored after its block.
    assert (visible_BLM & outside & ~counted_BL1).any()


@pytest.mark.parametrize('start,length,rows,window',
                         [(0, 9, 4, 0), (5, 9, 4, 0), (7, 3, 1, 0), (11, 6, 4, 5)])
def test_new_tokens_blocks_cover_the_cache_slots_they_see_and_none_they_cannot(start, length, rows, window):
  """A prefill at `start` over a cache holding positions 0..: each new token sees the slots up to its own
  position (within the window), all inside its block's keys, which stop at the block's last position."""
  slots = start + length + 7  # The cache is longer than what is written so far.
  positions_L = start + np.arange(length)
  visible_LS = visible(positions_L, np.arange(slots), window=window)
  covered = np.zeros((length, slots), bool)
  for s, e, k, m in query_blocks(length, rows, window, start):
    assert m == start + e <= start + length
    covered[s:e, k:m] = True
  assert covered.any(axis=1).all() and not (visible_LS & ~covered).any()
  assert not covered[:, start + length:].any()  # No unwritten slot is scored.


@pytest.mark.parametrize('length,window', [(32, 0), (32, 6), (7, 3)])
def test_one_query_a_block_scores_exactly_the_causal_keys(length, window):
  counts = [min(q + 1, window or length) for q in range(length)]
  assert keys_scored(length, 1, window) == sum(counts) / length
  assert keys_scored(length, length, window) == length  # One block: the whole matrix.


def test_blocks_score_less_the_smaller_they_are_down_to_half_the_matrix():
  scored = [keys_scored(256, rows) for rows in (256, 128, 64, 32)]
  assert scored == sorted(scored, reverse=True) and scored[0] == 256
  assert scored[1] == 0.75 * 256 and scored[2] == 0.625 * 256
