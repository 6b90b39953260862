"""Metric records: one console line and one `metrics.jsonl` object per logging interval."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any


class NonFiniteLossError(FloatingPointError):
  """The loss became NaN or Inf; the message names the step."""


def format_line(record: Mapping[str, Any]) -> str:
  parts = [f"step {record['step']}"]
  for key, fmt in (('loss', '.4f'), ('grad_norm', '.3f'), ('learning_rate', '.2e'),
                   ('steps_per_sec', '.2f'), ('tokens_per_sec', ',.0f'), ('data_wait_fraction', '.1%'),
                   ('eval_loss', '.4f'), ('eval_perplexity', '.2f'), ('eval_bits_per_byte', '.3f')):
    if key in record:
      parts.append(f'{key} {record[key]:{fmt}}')
  return ' | '.join(parts)


class MetricsLog:
  """Appends records to `WORKDIR/metrics.jsonl` and prints them (process 0 only)."""

  def __init__(self, workdir: str | pathlib.Path | None, *, is_main: bool = True,
               print_fn: Callable[[str], None] = print):
    self.is_main, self.print_fn = is_main, print_fn
    self.path = None
    if workdir is not None and is_main:
      self.path = pathlib.Path(workdir) / 'metrics.jsonl'
      self.path.parent.mkdir(parents=True, exist_ok=True)

  def write(self, record: Mapping[str, Any], *, echo: bool = True) -> None:
    if not self.is_main:
      return
    if echo:
      self.print_fn(format_line(record))
    if self.path is not None:
      with self.path.open('a') as f:
        f.write(json.dumps(dict(record)) + '\n')
