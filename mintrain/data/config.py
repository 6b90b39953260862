"""The `data` section, parsed once here; the data layer reads it as given and checks only the data."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mintrain import fields
from mintrain.errors import ConfigError
from mintrain.fields import option

# Read a block at a time (mintrain.data.records).
STREAMED_SOURCES = ('jsonl', 'parquet', 'arrayrecord', 'hf_datasets')
# Sources whose records may hold a conversation (data.format='chat').
CHAT_SOURCES = ('jsonl', 'parquet', 'hf_datasets')
# Sources whose records may hold preference pairs (data.format='preference').
PREFERENCE_SOURCES = ('jsonl', 'parquet')
# What each source of a mixture may set; the rest (threads, prefetch) belongs to the whole mixture.
MIXTURE_KEYS = ('source', 'path', 'eval_path', 'eval_fraction', 'token_dtype', 'text_field', 'record_format',
                'block_bytes', 'shuffle_window', 'skip_bad_records', 'format', 'messages_field', 'loss_on',
                'hf_split', 'hf_config', 'hf_streaming')


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = option(choices=('stdlib', 'text', 'tokens', 'synthetic', *STREAMED_SOURCES, 'mixture'))
  path: str = option()
  tokenizer: str = option()  # 'byte', a tokenizer file or dir; '' the HF checkpoint's (which must hold one).
  eval_path: str = option()  # A held-out corpus (a glob of the same source) for eval; '': held out of path.
  eval_fraction: float = option(at_least=0, below=1)
  token_dtype: str = option(choices=('uint16', 'uint32'))
  max_bytes: int = option(at_least=0)
  packing: str = option(choices=('pack', 'pad'))
  num_threads: int = option(at_least=0)
  prefetch: int = option(at_least=0)
  device_prefetch: int = option(at_least=0)
  text_field: str = option()
  record_format: str = option(choices=('text', 'tokens'))
  block_bytes: int = option(at_least=1)
  shuffle_window: int = option(at_least=1)
  skip_bad_records: bool = option()
  on_corpus_change: str = option(choices=('continue', 'restart'))
  hf_split: str = option()
  hf_config: str = option()
  hf_streaming: bool = option()  # load_dataset(..., streaming=True): a shard per block (hf_datasets).
  format: str = option(choices=('text', 'chat', 'preference', 'prompt'))
  messages_field: str = option()
  loss_on: str = option(choices=('assistant', 'all'))
  chat_template: str = option()  # A template file; '' the tokenizer's.
  mixture: tuple = option()  # ((settings as sorted (key, value) pairs, weight), ...), from (dict, weight)s.

  def __post_init__(self):
    entries = tuple(_mixture_entry(i, entry) for i, entry in enumerate(self.mixture))
    object.__setattr__(self, 'mixture', entries)
    if (self.source == 'mixture') != bool(entries):
      raise ConfigError("data.source='mixture' and a non-empty data.mixture go together: set both (a list of "
                        "({'source': 'jsonl', 'path': ...}, weight)) or neither.")
    for where, source, fmt in self._formats():
      if fmt == 'chat' and source not in CHAT_SOURCES:
        raise ConfigError(f"{where}data.format='chat' reads conversations from records of {CHAT_SOURCES}, "
                          f'not data.source={source!r}; use one of those or data.format=text.')
      if fmt == 'preference' and source not in PREFERENCE_SOURCES:
        raise ConfigError(f"{where}data.format='preference' reads pairs from the records of "
                          f'{PREFERENCE_SOURCES}, not data.source={source!r}; use one of those.')
    formats = {fmt for _, _, fmt in self._formats()}
    if 'preference' in formats and len(formats) > 1:
      others = sorted(formats - {'preference'})
      raise ConfigError(f"data.mixture mixes data.format='preference' with {others}: a batch holds pairs or "
                        "sequences, not both; give every source format 'preference' or none.")
    if self.format == 'prompt' and self.source != 'jsonl':
      raise ConfigError("data.format='prompt' reads prompt records from JSONL files; set data.source='jsonl' "
                        f'(not {self.source!r}).')

  def _formats(self) -> list[tuple[str, str, str]]:
    """(where, source, format) of each source: the mixture's (a source's own format, else data.format)."""
    if not self.mixture:
      return [('', self.source, self.format)]
    return [(f'data.mixture[{i}]: ', dict(s)['source'], dict(s).get('format', self.format))
            for i, (s, _) in enumerate(self.mixture)]

  @property
  def pairs(self) -> bool:
    """Whether the sources hold preference pairs (data.format='preference'): all of them do, or none."""
    return any(fmt == 'preference' for _, _, fmt in self._formats())

  @property
  def chat(self) -> bool:
    """Whether any source holds conversations (data.format='chat'), which need a chat template."""
    return any(fmt == 'chat' for _, _, fmt in self._formats())


def _mixture_entry(i: int, entry: Any) -> tuple[tuple[tuple[str, Any], ...], float]:
  """A mixture entry as ((key, value), ...) and its weight, checked; ConfigError names the entry."""
  where = f'data.mixture[{i}]'
  if not isinstance(entry, (list, tuple)) or len(entry) != 2:
    raise ConfigError(f"{where}={entry!r} must be a pair (settings, weight), e.g. "
                      f"({{'source': 'jsonl', 'path': 'a/*.jsonl'}}, 0.5).")
  settings, weight = entry
  if isinstance(settings, (list, tuple)):  # As saved in a checkpoint's config.
    settings = dict(settings)
  if not isinstance(settings, Mapping):
    raise ConfigError(f'{where}: settings {settings!r} must be a dict of data options.')
  for key in settings:
    if key not in MIXTURE_KEYS:
      raise ConfigError(f'{where}: {key!r} is not an option a mixture source may set; choose from '
                        f'{MIXTURE_KEYS}.')
  source = settings.get('source')
  if source not in STREAMED_SOURCES:
    raise ConfigError(f"{where}: source={source!r} is not a source a mixture can draw from; choose one of "
                      f'{STREAMED_SOURCES}.')
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float('inf'):
    raise ConfigError(f'{where}: weight={weight!r} must be a finite number > 0.')
  checked = fields.check(DataConfig, settings, where)  # Each value's own check.
  return tuple(sorted(checked.items())), float(weight)
