"""The arithmetic task's verifiable rewards, called as TRL calls reward functions (`grpo.reward`)."""

from __future__ import annotations

import re


def _text(completion) -> str:
  """A completion's text: a string, or (conversational prompts) a list of one assistant message."""
  return completion if isinstance(completion, str) else completion[-1]['content']


def exact_answer(prompts: list, completions: list, answer: list[str], **fields) -> list[float]:
  """1.0 where the completion starts with the exact answer and no further digit follows it, else 0.0."""
  return [1.0 if re.match(rf'\s*{re.escape(a)}(?!\d)', _text(c)) else 0.0
          for c, a in zip(completions, answer, strict=True)]


def starts_with_a_number(prompts: list, completions: list, **fields) -> list[float]:
  """1.0 where the completion starts with a (signed) integer: the format the answer needs."""
  return [1.0 if re.match(r'\s*-?\d', _text(c)) else 0.0 for c in completions]
