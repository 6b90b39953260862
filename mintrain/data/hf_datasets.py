"""A Hugging Face dataset as a streamed corpus (`data.source='hf_datasets'`, `pip install -e '.[datasets]'`):
loaded once, listed as blocks and read a block's rows at a time; `records.Reader` makes the rows documents.

`data.path` is a directory written by `save_to_disk`, a glob of local files (`load_dataset` of their
format), or a name on the Hub (needs a connection); its `data.hf_split` is read. A block is a run of about
`data.block_bytes` of rows or, with `data.hf_streaming`, one shard of an `IterableDataset`.
"""

from __future__ import annotations

import glob
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mintrain.errors import DataError, first_line

if TYPE_CHECKING:
  from mintrain.data.config import DataConfig

# What `datasets.load_dataset` reads a glob of local files as, by suffix.
BUILDERS = {'.parquet': 'parquet', '.json': 'json', '.jsonl': 'json', '.gz': 'json', '.arrow': 'arrow',
            '.csv': 'csv', '.txt': 'text'}
_BATCH_ROWS = 1024  # Rows of a stream converted at once.


class Dataset:
  """`data.path` as a Hugging Face dataset, loaded on first use, and the columns its documents are read
  from: `field` (named by the setting `option`) and those of `optional` it has."""

  def __init__(self, data_cfg: DataConfig, field: str, option: str, optional: Sequence[str] = ()):
    self.pattern, self.block_bytes = data_cfg.path, data_cfg.block_bytes
    self.split, self.config, self.streaming = data_cfg.hf_split, data_cfg.hf_config, data_cfg.hf_streaming
    self.field, self.option, self.optional = field, option, tuple(optional)
    self.where = f'data.path={self.pattern!r}'
    self.columns: list[str] = []
    self._loaded: Any = None

  def load(self) -> Any:
    """The dataset of `data.hf_split`. With `data.hf_streaming`, files or a Hub name load as an
    `IterableDataset`, resharded (a Parquet file's row groups become shards), so a block is one shard and
    nothing is read before its block is."""
    if self._loaded is not None:
      return self._loaded
    try:
      import datasets
    except ImportError:
      raise DataError("data.source='hf_datasets' needs Hugging Face datasets: "
                      "pip install -e '.[datasets]'.") from None
    where, path = self.where, pathlib.Path(self.pattern).expanduser()
    files = [] if path.is_dir() else [pathlib.Path(p) for p in sorted(glob.glob(str(path), recursive=True))
                                       if os.path.isfile(p)]
    datasets.disable_progress_bars()
    first = None  # A stream's first row.
    try:
      if path.is_dir():
        if self.streaming:
          raise DataError(f'{where} is a save_to_disk directory, read a block at a time from the disk '
                          'already; data.hf_streaming streams load_dataset sources (files, Hub names): '
                          'set it to False.')
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
          if self.split not in loaded:
            raise DataError(f'{where}: no split {self.split!r} (data.hf_split); it has '
                            f'{", ".join(loaded)}.')
          loaded = loaded[self.split]
      elif files:
        builder = BUILDERS.get(files[0].suffix)
        if builder is None:
          raise DataError(f'{where}: Hugging Face datasets reads no {files[0].suffix!r} files; give '
                          f'{", ".join(sorted(BUILDERS))} files or a save_to_disk directory.')
        loaded = datasets.load_dataset(builder, data_files=[str(f) for f in files], split='train',
                                       streaming=self.streaming)
      elif path.is_absolute() or self.pattern.startswith(('.', '~')):
        raise DataError(f'{where} matches no files and is no save_to_disk directory; check the path.')
      else:  # A name on the Hub.
        loaded = datasets.load_dataset(self.pattern, self.config or None, split=self.split,
                                       streaming=self.streaming)
      if self.streaming:
        loaded = loaded.reshard()
        first = next(iter(loaded.take(1)), None)
    except DataError:
      raise
    except StopIteration:  # load_dataset infers a JSON schema from the first file's rows.
      raise DataError(f'{where}: the dataset has no rows (its first file is empty).') from None
    except Exception as e:  # datasets raises many kinds: FileNotFoundError, DatasetNotFoundError, ...
      raise DataError(f'{where}: Hugging Face datasets cannot load it ({first_line(e)}).') from None
    if self.streaming and first is None:
      raise DataError(f'{where}: the dataset has no rows.')
    columns = loaded.column_names or list(first or {})  # A stream's features may be known only from rows.
    if self.field not in columns:
      raise DataError(f'{where}: no column {self.field!r} ({self.option}; its columns: '
                      f'{", ".join(columns)}).')
    self.columns = [self.field, *(c for c in self.optional if c in columns)]
    self._loaded = loaded
    return loaded

  def spans(self) -> list[tuple[int, int]]:
    """The blocks as (start, end) rows, in runs of about `data.block_bytes` (from the Arrow size per row),
    or a stream's shards as (shard, shard + 1)."""
    data = self.load()
    if self.streaming:
      return [(i, i + 1) for i in range(data.num_shards)]
    rows = len(data)
    if not rows:
      raise DataError(f'{self.where}: the dataset has no rows.')
    per_block = max(1, rows * self.block_bytes // max(data.data.nbytes, 1))
    return [(a, min(a + per_block, rows)) for a in range(0, rows, per_block)]

  def rows(self, start: int, end: int, bad: Callable[[str], None]) -> tuple[str, int, dict[str, list]]:
    """(where, the number of the first row, {column: values}) of rows `start:end`, or of all of shard
    `start` of a stream (rows numbered in the shard), in order; a shard that cannot be read is `bad`: none."""
    data = self.load()
    if not self.streaming:
      return self.where, start, data.select_columns(self.columns)[start:end]
    where, shard = f'{self.where} shard {start}', data.shard(num_shards=data.num_shards, index=start)
    try:  # As Arrow tables: a few times faster than a dict per row.
      tables = list(shard.select_columns(self.columns).with_format('arrow').iter(batch_size=_BATCH_ROWS))
    except Exception as e:  # A file that does not parse, a row that does not fit the features, I/O.
      bad(f'{where}: cannot be read ({first_line(e)})')
      return where, 0, {c: [] for c in self.columns}
    return where, 0, {c: [v for t in tables for v in t.column(c).to_pylist()] for c in self.columns}
