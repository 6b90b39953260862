"""Pre-tokenize a corpus with the run's tokenizer, one output file per input file, in parallel.

  python scripts/tokenize_corpus.py --config mintrain/configs/dp4_tp2.py --config.data.source=jsonl \\
      --config.data.path='corpus/*.jsonl.gz' --out corpus_tokens
  python scripts/tokenize_corpus.py ... --format tokens   # flat token files, for data.source=tokens

The input is read as training reads it (data.source jsonl, parquet or arrayrecord; data.path,
data.text_field, data.skip_bad_records); each document becomes BOS + its ids. `--format arrayrecord` (the
default) writes one record per document of data.token_dtype ids, read back with
data.source=arrayrecord data.record_format=tokens; `--format tokens` writes the documents end to end.
Progress goes to stderr; the last line on stdout is the setting that trains on the output.

  python scripts/tokenize_corpus.py ... --config.data.source=jsonl --config.data.path='chats/*.jsonl' \\
      --config.data.tokenizer=path/to/hf_dir --format chat --show 3

`--format chat` reads the records as conversations (data.format=chat) and `--show N` prints the first N as
the chat template renders them, the tokens the loss trains on (data.loss_on) between ⟦ and ⟧ (green on a
terminal), with the count of trained and all tokens. Chat data trains from its JSONL or Parquet files.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import pathlib
import sys
import time
from typing import TYPE_CHECKING

from mintrain import configs
from mintrain.errors import ConfigError, DataError
from mintrain.runtime import startup

if TYPE_CHECKING:
  from mintrain.data import tokenizer
  from mintrain.data.config import DataConfig

SUFFIXES = ('.jsonl.gz', '.jsonl', '.parquet', '.arrayrecord')
MARKS = {False: ('⟦', '⟧'), True: ('\033[32m', '\033[0m')}  # Around trained text; on a terminal, green.
OUTPUT_SUFFIX = {'arrayrecord': '.arrayrecord', 'tokens': '.bin'}


def output_path(key: str, out: pathlib.Path, fmt: str) -> pathlib.Path:
  """OUT/<the file's path under the glob's fixed prefix, its suffix replaced>."""
  stem = next((key[:-len(s)] for s in SUFFIXES if key.endswith(s)), key)
  return out / (stem + OUTPUT_SUFFIX[fmt])


def tokenize_file(data_cfg: DataConfig, path: pathlib.Path, target: pathlib.Path,
                  fmt: str) -> tuple[int, int, int, int]:
  """Writes `path`'s documents as ids to `target` (through a temporary name); (documents, tokens, bytes
  read, records skipped)."""
  import numpy as np

  from mintrain.data import records, streaming, tokenizer

  tok = tokenizer.load(data_cfg.tokenizer)  # In each worker process.
  reader = records.Reader(dataclasses.replace(data_cfg, path=str(path)), tok)
  blocks = reader.all_blocks()
  dtype = np.dtype(data_cfg.token_dtype)
  target.parent.mkdir(parents=True, exist_ok=True)
  partial = target.with_name(target.name + '.partial')
  docs = tokens = 0
  if fmt == 'arrayrecord':
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(str(partial), 'group_size:1')
    write, close = (lambda ids: writer.write(ids.tobytes())), writer.close
  else:
    handle = open(partial, 'wb')
    write, close = (lambda ids: handle.write(ids.tobytes())), handle.close
  try:
    for i in range(len(blocks)):
      for doc in reader.read(blocks, i):
        ids = streaming.encode_document(doc, tok)
        if ids.max(initial=0) > np.iinfo(dtype).max:
          raise DataError(f'{path}: token id {int(ids.max())} does not fit data.token_dtype='
                          f'{dtype.name!r}; use uint32.')
        write(ids.astype(dtype))
        docs, tokens = docs + 1, tokens + len(ids)
    close()
  except BaseException:
    close()
    partial.unlink(missing_ok=True)
    raise
  os.replace(partial, target)
  return docs, tokens, path.stat().st_size, reader.bad.count


def show(data_cfg: DataConfig, tok: tokenizer.Tokenizer, count: int) -> None:
  """Prints the corpus's first `count` conversations, each span of trained tokens decoded between MARKS,
  and how many of their tokens are trained."""
  import numpy as np

  from mintrain.data import records

  reader = records.Reader(data_cfg, tok)
  blocks = reader.all_blocks()
  start, end = MARKS[sys.stdout.isatty()]
  shown = 0
  for i in range(len(blocks)):
    for doc in reader.read(blocks, i):
      if shown == count:
        return
      shown += 1
      cuts = [0, *np.flatnonzero(np.diff(doc.weights > 0)) + 1, len(doc.ids)]
      text = ''.join((start + piece + end) if doc.weights[a] > 0 else piece
                     for a, b in zip(cuts, cuts[1:])
                     for piece in [tok.tokenizer.decode(doc.ids[a:b].tolist(), skip_special_tokens=False)])
      print(f'--- conversation {shown} ---\n{text}\n({int((doc.weights > 0).sum())} of {len(doc.ids)} tokens '
            'trained)')


class Progress:
  """A one-line bar on stderr, redrawn in place on a terminal and printed per file elsewhere."""

  def __init__(self, total_files: int, total_bytes: int):
    self.files, self.total_files, self.total_bytes = 0, total_files, total_bytes
    self.docs = self.tokens = self.bytes = self.skipped = 0
    self.start = time.perf_counter()
    self.tty = sys.stderr.isatty()

  def add(self, docs: int, tokens: int, size: int, skipped: int) -> None:
    self.files, self.docs, self.tokens = self.files + 1, self.docs + docs, self.tokens + tokens
    self.bytes, self.skipped = self.bytes + size, self.skipped + skipped
    done = self.bytes / max(self.total_bytes, 1)
    rate = self.bytes / max(time.perf_counter() - self.start, 1e-9) / 1e6
    bar = '#' * int(30 * done) + '.' * (30 - int(30 * done))
    line = (f'[{bar}] {self.files}/{self.total_files} files, {self.docs:,} documents, '
            f'{self.tokens:,} tokens, {rate:.1f} MB/s')
    line += f', {self.skipped} bad records skipped' if self.skipped else ''
    print(('\r' if self.tty else '') + line, end='' if self.tty else '\n', file=sys.stderr, flush=True)

  def close(self) -> None:
    if self.tty:
      print(file=sys.stderr)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--config', default=str(configs.path('base')), help='the run config whose data and '
                      'tokenizer to use (default: base.py), with --config.key=value overrides')
  parser.add_argument('--out', help='the directory to write the tokenized files to')
  parser.add_argument('--format', default='arrayrecord', choices=(*OUTPUT_SUFFIX, 'chat'),
                      help="the files to write, or 'chat': read conversations (data.format=chat) to --show")
  parser.add_argument('--show', type=int, default=0, metavar='N',
                      help='print the first N conversations, their trained tokens marked, and write nothing')
  parser.add_argument('--workers', type=int, default=os.cpu_count(), help='files tokenized at once')
  args, config, tok = startup.parse(parser)  # Each worker process loads the tokenizer again.
  from mintrain.data import records, sources
  data_cfg = config.data
  if data_cfg.source not in records.FORMATS:
    startup.fail(f'data.source={data_cfg.source!r}: tokenize_corpus.py reads {records.FORMATS}; set '
                    f'--config.data.source and --config.data.path.')
  if args.format == 'chat':
    try:
      data_cfg = dataclasses.replace(data_cfg, format='chat')  # Checked anew.
    except ConfigError as e:
      startup.fail(str(e))
  if args.show < 0 or (args.show and data_cfg.format != 'chat'):
    startup.fail(f'--show={args.show} prints conversations: give N >= 1 with --format chat.')
  if data_cfg.format == 'chat' and not args.show:
    startup.fail('chat data trains from its JSONL or Parquet files (token files would lose which tokens '
                 'the loss trains on); use --show N to see how they render.')
  if args.show:
    try:
      show(data_cfg, tok, args.show)
    except (ConfigError, DataError, OSError) as e:
      startup.fail(str(e).splitlines()[0])
    return 0
  if not args.out:
    parser.error('--out is required to write tokenized files')
  if args.workers < 1:
    startup.fail(f'--workers={args.workers} must be >= 1.')
  out = pathlib.Path(args.out)
  try:
    files = sources.glob_files(data_cfg.path)
    progress = Progress(len(files), sum(path.stat().st_size for _, path in files))
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(args.workers, len(files))) as pool:
      pending = [pool.submit(tokenize_file, data_cfg, path, output_path(key, out, args.format), args.format)
                 for key, path in files]
      for future in concurrent.futures.as_completed(pending):
        progress.add(*future.result())
    progress.close()
  except (DataError, OSError) as e:
    startup.fail(str(e).splitlines()[0])
  read_back = (f'--config.data.source=arrayrecord --config.data.record_format=tokens '
               f"--config.data.path='{out}/**/*.arrayrecord'" if args.format == 'arrayrecord' else
               f"--config.data.source=tokens --config.data.path='{out}/**/*.bin'")
  print(f'Wrote {progress.files} files ({progress.docs:,} documents, {progress.tokens:,} tokens) to {out}; '
        f'train on them with {read_back} --config.data.token_dtype={data_cfg.token_dtype}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
