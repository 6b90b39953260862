"""Preference records -> pairs of token sequences (TRL's preference format): a record holds `prompt`, `chosen`
and `rejected`, each a string, or (conversational) the prompt a list of messages and each response a list of
assistant messages. A string prompt is BOS + its ids and a string response its ids + EOS; a conversational
prompt is its render by the tokenizer's chat template with the assistant's turn opened
(`add_generation_prompt`), and a response what the template adds to the prompt's render when it follows.
Prompt and response are tokenised apart, as TRL does; only the response's tokens are weighted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mintrain.data import tokenizer
from mintrain.errors import DataError

FIELDS = ('prompt', 'chosen', 'rejected')
RESPONSES = FIELDS[1:]


def max_pairs_per_row(seq_len: int) -> int:
  """How many packed pairs a row of seq_len targets may hold (`data.packing='pack'`): each sequence of a
  pair has at least one target, so two tokens; a bound the loss sums each pair's log-probabilities over."""
  return (seq_len + 1) // 2


def encode(tok: tokenizer.Tokenizer, record: Any, render: Callable[..., tuple[str, Any]] | None
           ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """((ids, weights) of prompt + chosen, (ids, weights) of prompt + rejected): int32 ids, float32 weights 1.0
  on the response. `render(messages, add_generation_prompt=...)` renders messages with the chat template
  (`mintrain.data.chat.render`); a DataError says what is wrong with the record."""
  if not isinstance(record, dict):
    raise DataError(f'a preference record is a JSON object with {", ".join(FIELDS)}, not '
                    f'{type(record).__name__}')
  for field in FIELDS:
    if record.get(field) is None:
      raise DataError(f'no field {field!r} (a preference record holds {", ".join(FIELDS)})')
  prompt = record['prompt']
  if isinstance(prompt, str):
    for field in RESPONSES:
      if not isinstance(record[field], str):
        raise DataError(f'field {field!r} is {type(record[field]).__name__}, not a string as the prompt is')
    head = [tok.bos_id] if tok.bos_id is not None else []
    tail = [tok.eos_id] if tok.eos_id is not None else []
    prompt_ids = np.array(head + list(tok.encode(prompt)), np.int32)
    return tuple(_joined(prompt_ids, np.array(list(tok.encode(record[f])) + tail, np.int32))
                 for f in RESPONSES)
  if not isinstance(prompt, list):
    raise DataError(f"field 'prompt' is {type(prompt).__name__}, not a string or a list of messages")
  if render is None:
    raise DataError('a conversational prompt needs a tokenizer with a chat template')
  prompt_text, _ = render(prompt, add_generation_prompt=True)
  pairs = []
  for field in RESPONSES:
    response = record[field]
    if not isinstance(response, list) or not all(isinstance(m, dict) and m.get('role') == 'assistant'
                                                 for m in response):
      raise DataError(f'field {field!r} must be a list of assistant messages, as the prompt is a list of '
                      'messages')
    text, _ = render(prompt + response)
    if not text.startswith(prompt_text):
      raise DataError(f'the chat template renders the prompt differently when {field!r} follows it, so the '
                      'response cannot be told apart')
    pairs.append(_joined(_ids(tok, prompt_text), _ids(tok, text[len(prompt_text):])))
  return tuple(pairs)


def _ids(tok: tokenizer.Tokenizer, text: str) -> np.ndarray:
  """Rendered text's ids: the template wrote its special tokens itself."""
  return np.asarray(tok.encode(text), np.int32)


def _joined(prompt_ids: np.ndarray, response_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  if not len(response_ids):
    raise DataError('a response renders as no tokens')
  ids = np.concatenate([prompt_ids, response_ids]).astype(np.int32)
  weights = np.concatenate([np.zeros(len(prompt_ids), np.float32), np.ones(len(response_ids), np.float32)])
  return ids, weights
