"""Prompt records (`data.format='prompt'`, for train.objective='grpo'): JSONL records of `prompt`, a string
(BOS + its ids) or a list of messages (rendered by the chat template with the assistant's turn opened), and
any other fields, which the reward functions receive. Every process reads every prompt of a step (a reward
needs them all); the order is shuffled with the seed, anew each epoch, and the position is the count of
prompts handed out, so a resumed run reads the prompts it would have."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from mintrain.data import sources, tokenizer
from mintrain.data.config import DataConfig
from mintrain.errors import ConfigError, DataError


@dataclasses.dataclass(frozen=True)
class Prompt:
  record: dict[str, Any]  # As read: `prompt` and the fields the rewards receive.
  ids_P: np.ndarray  # int32 ids to sample a completion after.
  where: str  # 'file:line', to name it.


def encode(tok: tokenizer.Tokenizer, record: Any, template: str | None) -> np.ndarray:
  """The int32 ids of a record's prompt; a DataError says what is wrong with the record."""
  if not isinstance(record, dict) or 'prompt' not in record:
    raise DataError('a prompt record is a JSON object with a field \'prompt\'')
  prompt = record['prompt']
  if isinstance(prompt, str):
    head = [tok.bos_id] if tok.bos_id is not None else []
    ids = np.array(head + list(tok.encode(prompt)), np.int32)
  elif isinstance(prompt, list):
    from mintrain.data import chat  # jinja2 only for chat prompts.

    try:
      text, _ = chat.render(tok, prompt, template=template, add_generation_prompt=True)
    except ValueError as e:
      raise DataError(f'its messages cannot be rendered: {e}') from None
    ids = np.asarray(tok.encode(text), np.int32)
  else:
    raise DataError(f"field 'prompt' is {type(prompt).__name__}, not a string or a list of messages")
  if not len(ids):
    raise DataError('the prompt has no tokens')
  return ids


def read(data_cfg: DataConfig, tok: tokenizer.Tokenizer, max_len: int) -> list[Prompt]:
  """Every record of data.path's JSONL files, in file and line order; a record whose prompt is longer than
  `max_len` tokens, or that is not one, is a DataError naming file and line."""
  template = None
  if isinstance(tok, tokenizer.HFTokenizer) or data_cfg.chat_template:
    from mintrain.data import chat

    try:
      template = chat.run_template(tok, data_cfg.chat_template)
    except ConfigError:
      if data_cfg.chat_template:
        raise
  prompts = []
  for _, path in sources.glob_files(data_cfg.path):
    with open(path, encoding='utf-8') as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
          ids_P = encode(tok, record, template)
        except (ValueError, DataError) as e:
          raise DataError(f'{path}:{number}: {e}') from None
        if len(ids_P) > max_len:
          raise DataError(f'{path}:{number}: the prompt has {len(ids_P)} tokens, more than train.seq_len + 1 '
                          f'- grpo.max_new_tokens = {max_len}; shorten it or raise train.seq_len.')
        prompts.append(Prompt(record, ids_P, f'{path}:{number}'))
  if not prompts:
    raise DataError(f'data.path={data_cfg.path!r} holds no prompt records.')
  return prompts


class PromptBatches:
  """Each step's `per_step` prompts (whole, on every process), in an order the seed shuffles each epoch."""

  def __init__(self, prompts: list[Prompt], per_step: int, seed: int, source: str):
    self.prompts, self.per_step, self.seed, self.source = prompts, per_step, seed, source
    self.next = 0  # Prompts handed out.

  def __iter__(self) -> PromptBatches:
    return self

  def _at(self, index: int) -> Prompt:
    epoch, i = divmod(index, len(self.prompts))
    order = np.random.default_rng([self.seed % 2**32, epoch]).permutation(len(self.prompts))
    return self.prompts[int(order[i])]

  def peek(self) -> list[Prompt]:
    """The next step's prompts, without moving on."""
    return [self._at(self.next + i) for i in range(self.per_step)]

  def __next__(self) -> list[Prompt]:
    batch = self.peek()
    self.next += self.per_step
    return batch

  def get_state(self) -> dict[str, Any]:
    return {'source': self.source, 'iterator': {'next_prompt': self.next}}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if state.get('source') != self.source:
      raise ValueError(f"The checkpoint's data position is for data.source={state.get('source')!r}, "
                       f'not {self.source!r}.')
    self.next = int(state['iterator']['next_prompt'])
