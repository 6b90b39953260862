"""Documents of large corpora, read a block at a time: JSONL (`.jsonl`, `.jsonl.gz`), Parquet, ArrayRecord,
or a Hugging Face dataset (`hf_datasets`).

A corpus (the files of the glob `data.path`) is cut into blocks, the units that streaming shuffles and
hands out: a byte range of about `data.block_bytes` of a JSONL file (the lines that start in it), a whole
`.jsonl.gz` file (it cannot be entered in the middle), a Parquet row group, or a run of ArrayRecord records
of about `data.block_bytes`. Blocks are listed from file sizes and footers alone, so listing a corpus reads
almost nothing and its list is a few numbers per block; a block's documents are read only when asked for.

A document is a str (JSONL's `data.text_field`, Parquet's column of that name, an ArrayRecord record of
UTF-8 text) or, for ArrayRecord files written by scripts/tokenize_corpus.py (`data.record_format='tokens'`),
an array of `data.token_dtype` ids that already starts with BOS. With `data.format='chat'` a JSONL or
Parquet record holds a conversation (`data.messages_field`, and `tools` if it has them), read as a
`Conversation`: the ids of its render by the chat template and the loss weight of each (`mintrain.data.chat`).

Bad input is a DataError naming the file and the line, row or record; with `data.skip_bad_records` it is a
counted warning (on stderr in a run) instead, and the record (or unreadable file) is left out.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import logging
import pathlib
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from mintrain.data import hf_datasets, preference, sources, tokenizer
from mintrain.errors import ConfigError, DataError, first_line
from mintrain.runtime.lazy import lazy_import

grain = lazy_import('grain')

if TYPE_CHECKING:
  from mintrain.data.config import DataConfig

FORMATS = ('jsonl', 'parquet', 'arrayrecord', 'hf_datasets')
TOOLS_FIELD = 'tools'  # A chat record's tool schemas, passed to the template.


@dataclasses.dataclass(frozen=True)
class Conversation:
  """A chat record rendered by the chat template: its ids and the loss weight of predicting each
  (`data.loss_on`)."""
  ids: np.ndarray  # int32 (n,)
  weights: np.ndarray  # float32 (n,)


@dataclasses.dataclass(frozen=True)
class Pair:
  """A preference record (`data.format='preference'`, `mintrain.data.preference`): prompt + chosen and
  prompt + rejected, each weighted on its response alone."""
  chosen: Conversation
  rejected: Conversation


Document = str | np.ndarray | Conversation | Pair
_log = logging.getLogger(__name__)  # The run routes it (metrics.console_logging).
_OPEN_ARRAY_RECORDS = 16  # ArrayRecord files kept open per process.


def _parquet_file(path: pathlib.Path) -> Any:
  """pyarrow's reader, imported on first use: pyarrow is large and brings its own allocator and threads,
  which a run on other data should not carry (nor `lazy_import`, which would import `pyarrow` itself to
  find `pyarrow.parquet`)."""
  import pyarrow.parquet as pq
  return pq.ParquetFile(path)

class BadRecords:
  """Raises on a bad record, or with `skip` counts it and warns (the first ten, then every
  power of ten), so nothing is left out silently."""

  def __init__(self, skip: bool):
    self.skip, self.count = skip, 0

  def __call__(self, message: str) -> None:
    if not self.skip:
      raise DataError(f'{message}; fix it or set data.skip_bad_records=True to skip bad records.')
    self.count += 1
    if self.count <= 10 or str(self.count).rstrip('0') == '1':
      _log.warning(f'warning: data.skip_bad_records: skipped {message} ({self.count} skipped so far)')


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A corpus's blocks: block i is `start[i]:end[i]` (bytes, row group or records) of `paths[file[i]]`.

  A path of None stands for a file that is gone or changed since a checkpoint listed it: its blocks keep
  their places in the block order and hold no documents.
  """

  paths: list[pathlib.Path | None]
  keys: list[str]  # Each file's path relative to the glob's fixed prefix: the split's hash key.
  file: np.ndarray  # int32 (U,)
  start: np.ndarray  # int64 (U,)
  end: np.ndarray  # int64 (U,)

  def __len__(self) -> int:
    return len(self.file)

  def key(self, i: int) -> str:
    return f'{self.keys[self.file[i]]}#{self.start[i]}'

  def select(self, keep: np.ndarray) -> Blocks:
    return dataclasses.replace(self, file=self.file[keep], start=self.start[keep], end=self.end[keep])


class Reader:
  """Lists a corpus's blocks and reads a block's documents, with the data settings' field and checks."""

  def __init__(self, data_cfg: DataConfig, tok: tokenizer.Tokenizer, vocab_size: int | None = None):
    if data_cfg.source not in FORMATS:
      raise DataError(f'data.source={data_cfg.source!r} is not a streamed format; choose one of {FORMATS}.')
    self.kind, self.chat = data_cfg.source, data_cfg.format == 'chat'
    self.preference = data_cfg.format == 'preference'
    self.field = data_cfg.messages_field if self.chat else data_cfg.text_field
    self.option = 'data.messages_field' if self.chat else 'data.text_field'
    if self.chat:
      from mintrain.data import chat  # jinja2 only for chat data.
      template = chat.run_template(tok, data_cfg.chat_template)
      self._render = functools.partial(chat.encode, tok, template=template, loss_on=data_cfg.loss_on)
    if self.preference:
      self._pair = functools.partial(preference.encode, tok, render=_pair_render(tok, data_cfg.chat_template))
    self.block_bytes = data_cfg.block_bytes
    self.tokens = self.kind == 'arrayrecord' and data_cfg.record_format == 'tokens'
    self.dtype = np.dtype(data_cfg.token_dtype)
    # Token records' ids stay below the model's vocabulary (default: the tokenizer's).
    self.vocab_size = vocab_size or tok.vocab_size
    self.bad = BadRecords(data_cfg.skip_bad_records)
    self.pattern, self.max_bytes = data_cfg.path, data_cfg.max_bytes
    self._open: dict[pathlib.Path, Any] = {}
    self._hf = (hf_datasets.Dataset(data_cfg, self.field, self.option, [TOOLS_FIELD] if self.chat else [])
                if self.kind == 'hf_datasets' else None)

  def all_blocks(self) -> Blocks:
    """Every block of the files of `data.path`, in sorted file order."""
    if self.kind == 'hf_datasets':
      spans = self._hf.spans()
      return Blocks([pathlib.Path(self.pattern)], [self.pattern], np.zeros(len(spans), np.int32),
                    np.array([a for a, _ in spans], np.int64), np.array([b for _, b in spans], np.int64))
    files, keys, file_of, start, end = [], [], [], [], []
    for key, path in sources.first_bytes(sources.glob_files(self.pattern), self.max_bytes):
      spans = self._spans(path)
      if spans is None:
        continue
      index = len(files)
      files.append(path)
      keys.append(key)
      for a, b in spans:
        file_of.append(index)
        start.append(a)
        end.append(b)
    if not file_of:
      raise DataError(f'data.path={self.pattern!r}: no readable {self.kind} data in its files.')
    return Blocks(files, keys, np.array(file_of, np.int32), np.array(start, np.int64),
                  np.array(end, np.int64))

  def _spans(self, path: pathlib.Path) -> list[tuple[int, int]] | None:
    """The file's blocks as (start, end); None (counted, warned) for a bad file under skip_bad_records."""
    try:
      size = path.stat().st_size
    except OSError as e:
      raise DataError(f'data.path: cannot read {path} ({e.strerror}); fix it or leave it out.') from e
    if size == 0:
      self.bad(f'data.path: {path} is empty')
      return None
    if self.kind == 'jsonl':
      if path.name.endswith('.gz'):
        return [(0, -1)]
      return [(a, min(a + self.block_bytes, size)) for a in range(0, size, self.block_bytes)]
    if self.kind == 'parquet':
      try:
        meta = _parquet_file(path)
      except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is no Parquet.
        self.bad(f'data.path: {path} is not a readable Parquet file ({first_line(e)})')
        return None
      names = meta.schema_arrow.names
      for column in preference.FIELDS if self.preference else [self.field]:
        if column not in names:
          option = 'a preference record' if self.preference else self.option
          self.bad(f'data.path: {path} has no column {column!r} ({option}; its columns: {", ".join(names)})')
          return None
      return [(g, g + 1) for g in range(meta.metadata.num_row_groups)]
    try:
      count = len(self._array_records(path))
    except Exception as e:  # array_record raises RuntimeError with the reason.
      self.bad(f'data.path: {path} is not a readable ArrayRecord file ({first_line(e)})')
      return None
    per_block = max(1, count * self.block_bytes // size)
    return [(a, min(a + per_block, count)) for a in range(0, count, per_block)]

  def _array_records(self, path: pathlib.Path):
    source = self._open.pop(path, None)
    if source is None:
      source = grain.sources.ArrayRecordDataSource([str(path)])
      if len(self._open) >= _OPEN_ARRAY_RECORDS:
        self._open.pop(next(iter(self._open)))
    self._open[path] = source  # Most recently used last.
    return source

  def _read_dataset(self, start: int, end: int) -> list[Document]:
    """Rows `start:end` of a dataset, or all of shard `start` of a stream, in order."""
    where, start, table = self._hf.rows(start, end, self.bad)
    docs: list[Document] = []
    for k, value in enumerate(table[self.field]):
      if self.chat:
        tools = table[TOOLS_FIELD][k] if len(self._hf.columns) > 1 else None
        problem = self._conversation(value, tools, docs)
      elif isinstance(value, str):
        docs.append(value)
        problem = None
      else:
        kind = 'null' if value is None else type(value).__name__
        problem = f'column {self.field!r} is {kind}, not a string'
      if problem:
        self.bad(f'{where} row {start + k}: {problem}')
    return docs

  def read(self, blocks: Blocks, i: int) -> list[Document]:
    """The documents of block `i`, in file order."""
    path, start, end = blocks.paths[blocks.file[i]], int(blocks.start[i]), int(blocks.end[i])
    if path is None:
      return []
    if self.kind == 'hf_datasets':
      return self._read_dataset(start, end)
    if self.kind == 'jsonl':
      return self._read_jsonl(path, start, end)
    if self.kind == 'parquet':
      return self._read_parquet(path, start)
    return self._read_array_records(path, start, end)

  def _read_jsonl(self, path: pathlib.Path, start: int, end: int) -> list[Document]:
    docs = []
    try:
      if end < 0:
        with gzip.open(path, 'rb') as f:
          lines = list(f)  # A gzip file is one block; its text is a few times its size.
        if not lines:
          self.bad(f'data.path: {path} is empty')
        for number, line in enumerate(lines, 1):
          problem = self._parse_line(line, docs)
          if problem:
            self.bad(f'{path}:{number}: {problem}')
        return docs
      with open(path, 'rb') as f:
        if start:  # A line belongs to the block its first byte lies in.
          f.seek(start - 1)
          f.readline()
        first, lines = f.tell(), []
        while f.tell() < end:
          line = f.readline()
          if not line:
            break
          lines.append(line)
    except (OSError, EOFError, zlib.error) as e:
      raise DataError(f'data.path: cannot read {path} ({first_line(e)}); fix it or leave it out.') from e
    for k, line in enumerate(lines):
      problem = self._parse_line(line, docs)
      if problem:
        self.bad(f'{path}:{_line_number(path, first) + k}: {problem}')
    return docs

  def _parse_line(self, line: bytes, docs: list[Document]) -> str | None:
    """Appends the line's text to `docs` (a blank line holds none), or says what is wrong with it."""
    if not line.strip():
      return None
    try:
      record = json.loads(line)
    except ValueError as e:
      return f'not valid JSON ({first_line(e)})'
    if self.preference:
      return self._preference(record, docs)
    if not isinstance(record, dict) or self.field not in record:
      return f'no field {self.field!r} ({self.option})'
    if self.chat:
      return self._conversation(record[self.field], record.get(TOOLS_FIELD), docs)
    if not isinstance(record[self.field], str):
      return f'field {self.field!r} (data.text_field) is {type(record[self.field]).__name__}, not a string'
    docs.append(record[self.field])
    return None

  def _conversation(self, messages: Any, tools: Any, docs: list[Document]) -> str | None:
    """Appends the chat rendered by the template, or says what is wrong with it (a message without a
    role, content that is no string, a role the template refuses, ...)."""
    try:
      ids, weights = self._render(messages, tools=tools)
    except DataError as e:
      return str(e).rstrip('.')
    if not len(ids):
      return 'the chat template renders the chat as no tokens'
    docs.append(Conversation(ids, weights))
    return None

  def _preference(self, record: Any, docs: list[Document]) -> str | None:
    """Appends the record's pair, or says what is wrong with it."""
    try:
      chosen, rejected = self._pair(record)
    except DataError as e:
      return str(e).rstrip('.')
    docs.append(Pair(Conversation(*chosen), Conversation(*rejected)))
    return None

  def _read_parquet(self, path: pathlib.Path, group: int) -> list[Document]:
    if self.preference:
      return self._read_parquet_pairs(path, group)
    try:
      file = _parquet_file(path)
      tools = self.chat and TOOLS_FIELD in file.schema_arrow.names
      table = file.read_row_group(group, columns=[self.field, *([TOOLS_FIELD] if tools else [])])
    except Exception as e:  # Corrupt pages, a column that changed type, I/O errors.
      self.bad(f'{path} row group {group}: cannot be read ({first_line(e)})')
      return []
    docs = table.column(0).to_pylist()
    kept: list[Document] = []
    if self.chat:
      all_tools = table.column(1).to_pylist() if tools else [None] * len(docs)
      for row, (messages, row_tools) in enumerate(zip(docs, all_tools, strict=True)):
        problem = self._conversation(messages, row_tools, kept)
        if problem:
          self.bad(f'{path} row group {group} row {row}: {problem}')
      return kept
    for row, doc in enumerate(docs):
      if isinstance(doc, str):
        kept.append(doc)
      else:
        what = 'is null' if doc is None else f'is {type(doc).__name__}, not a string'
        self.bad(f'{path} row group {group} row {row}: column {self.field!r} {what}')
    return kept

  def _read_parquet_pairs(self, path: pathlib.Path, group: int) -> list[Document]:
    try:
      rows = _parquet_file(path).read_row_group(group, columns=list(preference.FIELDS)).to_pylist()
    except Exception as e:  # Corrupt pages, a missing or changed column, I/O errors.
      self.bad(f'{path} row group {group}: cannot be read ({first_line(e)})')
      return []
    kept: list[Document] = []
    for row, record in enumerate(rows):
      problem = self._preference(record, kept)
      if problem:
        self.bad(f'{path} row group {group} row {row}: {problem}')
    return kept

  def _read_array_records(self, path: pathlib.Path, start: int, end: int) -> list[Document]:
    try:
      raw = self._array_records(path).__getitems__(list(range(start, end)))
    except Exception as e:  # A damaged chunk: name the block, since the reader does not say which record.
      self.bad(f'{path} records [{start}, {end}): cannot be read ({first_line(e)})')
      return []
    docs: list[Document] = []
    for index, record in zip(range(start, end), raw, strict=True):
      if self.tokens:
        if len(record) % self.dtype.itemsize:
          self.bad(f'{path} record {index}: {len(record)} bytes, not a multiple of {self.dtype.itemsize} '
                   f'(data.token_dtype={self.dtype.name!r})')
          continue
        ids = np.frombuffer(record, self.dtype)
        if len(ids) and ids.max() >= self.vocab_size:
          self.bad(f'{path} record {index}: token id {int(ids.max())} is outside the vocabulary '
                   f'[0, {self.vocab_size}); check data.token_dtype or the tokenizer that wrote it or '
                   'model.vocab_size')
          continue
        docs.append(ids)
      else:
        try:
          docs.append(record.decode('utf-8'))
        except UnicodeDecodeError as e:
          self.bad(f'{path} record {index}: not UTF-8 text (byte 0x{record[e.start]:02x} at offset '
                   f"{e.start}); for token records set data.record_format='tokens'")
    return docs


def _pair_render(tok: tokenizer.Tokenizer, template_file: str) -> Any:
  """`mintrain.data.chat.render` with the run's template for conversational preference records, or None
  where the tokenizer has no chat template (string records need none); a template file must load."""
  if not template_file and not isinstance(tok, tokenizer.HFTokenizer):
    return None
  from mintrain.data import chat  # jinja2 only for chat data.
  try:
    template = chat.run_template(tok, template_file)
  except ConfigError:
    if template_file:
      raise
    return None
  return functools.partial(chat.render, tok, template=template)


def _line_number(path: pathlib.Path, offset: int) -> int:
  """1-based number of the line that starts at byte `offset`: counted only to name a bad line."""
  count, chunk = 1, 1 << 20
  with open(path, 'rb') as f:
    while offset > 0:
      data = f.read(min(chunk, offset))
      count += data.count(b'\n')
      offset -= len(data)
  return count
