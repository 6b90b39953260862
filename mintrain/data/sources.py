"""Corpora as token streams for one split: the Python standard library (a real corpus wherever Python
runs, no download), text files, or memory-mapped token files. A file's split follows the SHA-256 of its
path, so it is the same on every machine and adding files never moves the others."""

from __future__ import annotations

import glob
import hashlib
import os
import pathlib
import sysconfig
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mintrain.data import tokenizer
from mintrain.errors import DataError
from mintrain.runtime.lazy import lazy_import

grain = lazy_import('grain')  # Loaded when a text source is first read.

if TYPE_CHECKING:
  from mintrain.data.config import DataConfig

SOURCES = ('stdlib', 'text', 'tokens')
SPLITS = ('train', 'eval')
STDLIB_EXCLUDED_DIRS = frozenset({'test', 'tests', 'idle_test', 'site-packages', 'dist-packages',
                                  '__pycache__'})
_SCAN_CHUNK = 1 << 24  # Tokens checked per step when validating a token file.
DOCS_PER_MAP = 64  # Text files tokenized together.


def describe(data_cfg: DataConfig) -> str:
  """The source as the config names it, for error messages."""
  source = data_cfg.source
  return f'data.source={source!r}' if source == 'stdlib' else f'data.path={data_cfg.path!r}'


def key_hash(key: str) -> float:
  """A key's place in [0, 1): SHA-256, never Python's salted `hash()`."""
  return int.from_bytes(hashlib.sha256(key.encode('utf-8')).digest()[:8], 'big') / 2**64


def in_eval(key: str, eval_fraction: float) -> bool:
  """Whether a document goes to eval by its key alone."""
  return key_hash(key) < eval_fraction


def eval_members(keys: Sequence[str], eval_fraction: float) -> np.ndarray:
  """Which units (files, blocks or documents) are held out for eval: those whose key hashes below the
  fraction; where that leaves a split empty (a small corpus), the round(fraction * n) of smallest hash, at
  least one and never all, so both splits hold something whenever there are two units."""
  places = np.array([key_hash(k) for k in keys])
  chosen = places < eval_fraction
  n = len(keys)
  if n >= 2 and eval_fraction > 0 and (not chosen.any() or chosen.all()):
    chosen = np.zeros(n, bool)
    chosen[np.argsort(places)[:min(max(1, round(eval_fraction * n)), n - 1)]] = True
  return chosen


def too_small(where: str, units: str) -> DataError:
  return DataError(f'{where} holds one {units}: no eval split can be held out of it; give a held-out corpus '
                   f'as data.eval_path=GLOB, or turn evaluation off with eval.steps=0.')


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
  """(path relative to the stdlib root, path) of its `.py` files without tests, sorted."""
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
    for name in filenames:
      if name.endswith('.py') and not name.startswith('test_'):
        path = pathlib.Path(dirpath) / name
        files.append((path.relative_to(root).as_posix(), path))
  if not files:
    raise DataError(f"data.source='stdlib': no .py files under {root} (a zipped standard library?); "
                    f"use data.source='text' with data.path set to a glob of text files.")
  return sorted(files)


def glob_files(pattern: str) -> list[tuple[str, pathlib.Path]]:
  """(path relative to the glob's fixed prefix, path) of the files matching `pattern`, sorted."""
  if not pattern:
    raise DataError("data.path is empty; set it to a glob of files, e.g. 'data/*.txt'.")
  pattern = os.path.expanduser(pattern)
  parts = pathlib.PurePath(pattern).parts
  fixed = next((i for i, p in enumerate(parts) if any(c in p for c in '*?[')), len(parts) - 1)
  base = pathlib.Path(*parts[:fixed]) if fixed else pathlib.Path('.')
  paths = [pathlib.Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
  if not paths:
    raise DataError(f'data.path={pattern!r} matches no files (relative to {os.getcwd()}); '
                    f'check the pattern.')
  return sorted((os.path.relpath(p, base).replace(os.sep, '/'), p) for p in paths)


def first_bytes(files: list[tuple[str, pathlib.Path]], max_bytes: int) -> list[tuple[str, pathlib.Path]]:
  """The leading files, in order, until their total size reaches `max_bytes` (0: all)."""
  if not max_bytes:
    return files
  kept, total = [], 0
  for key, path in files:
    if total >= max_bytes:
      break
    kept.append((key, path))
    total += path.stat().st_size
  return kept


def read_text(path: pathlib.Path, where: str) -> bytes:
  """The UTF-8 bytes of a text file, or a DataError naming the file."""
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise DataError(f'{where}: cannot read {path} ({e.strerror}); fix it or leave it out.') from e
  nul = raw.find(b'\0')
  if nul >= 0:
    raise DataError(f'{where}: {path} is binary (NUL byte at offset {nul}); leave it out of data.path.')
  try:
    raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise DataError(f'{where}: {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset '
                    f'{e.start}); convert it to UTF-8 or leave it out of data.path.') from None
  return raw


def _split_files(data_cfg: DataConfig, split: str) -> list[pathlib.Path]:
  """The text files of `split`, in sorted order; a DataError when there are none."""
  where, fraction = describe(data_cfg), data_cfg.eval_fraction
  if data_cfg.eval_path and data_cfg.source != 'stdlib':  # A held-out corpus: nothing held out of path.
    return [path for _, path in first_bytes(glob_files(data_cfg.eval_path if split == 'eval' else
                                                       data_cfg.path), data_cfg.max_bytes)]
  files = stdlib_files() if data_cfg.source == 'stdlib' else glob_files(data_cfg.path)
  files = first_bytes(files, data_cfg.max_bytes)
  if len(files) == 1:  # Its one document trains; there is none to hold out.
    if split == 'eval':
      raise too_small(where, 'file')
    return [files[0][1]]
  chosen = eval_members([key for key, _ in files], fraction)
  mine = [path for (_, path), held in zip(files, chosen) if held == (split == 'eval')]
  if not mine:
    owner = 'eval' if split == 'train' else 'train'
    change = 'lower' if split == 'train' else 'raise'
    more = ', raise data.max_bytes' if data_cfg.max_bytes else ''
    raise DataError(f'The {split} split of {where} is empty: all {len(files)} file(s) hash into {owner} at '
                    f'data.eval_fraction={fraction}; {change} it{more} or add files.')
  return mine


def documents(data_cfg: DataConfig, tok: tokenizer.Tokenizer, split: str) -> grain.MapDataset:
  """The split's documents as lists of token arrays, DOCS_PER_MAP at a time: a Grain map that reads and
  tokenizes files when asked (together, so the tokenizer's threads encode them in parallel)."""
  where = describe(data_cfg)
  return (grain.MapDataset.source(_split_files(data_cfg, split))
          .map(lambda path: read_text(path, where).decode('utf-8'))
          .batch(DOCS_PER_MAP, batch_fn=list)
          .map(tok.documents))


def text_bytes(data_cfg: DataConfig, split: str) -> int:
  """UTF-8 bytes of the split's text files (their sizes): what bits per byte divide by."""
  return sum(path.stat().st_size for path in _split_files(data_cfg, split))


def _text_streams(data_cfg: DataConfig, tok: tokenizer.Tokenizer, split: str,
                  vocab_size: int) -> list[np.ndarray]:
  docs = documents(data_cfg, tok, split)
  if tok.vocab_size > vocab_size:
    raise DataError(f'data.tokenizer={tok.name!r} has {tok.vocab_size} ids, more than the model\'s '
                    f'vocabulary ({vocab_size}); set model.vocab_size=0 (from the tokenizer) or at least '
                    f'{tok.vocab_size}.')
  if tok.bos_id is None and tok.eos_id is None:
    raise DataError(f'data.tokenizer={tok.name!r} has neither a BOS nor an EOS token to separate documents; '
                    f'name one (eos_token) in the tokenizer_config.json beside its tokenizer.json.')
  return [np.concatenate([doc for i in range(len(docs)) for doc in docs[i]])]


def _check_ids(part: np.ndarray, path: pathlib.Path, offset: int, vocab_size: int) -> None:
  for start in range(0, len(part), _SCAN_CHUNK):
    chunk = np.asarray(part[start:start + _SCAN_CHUNK])
    if chunk.max() >= vocab_size:
      at = int(np.argmax(chunk >= vocab_size))
      token = offset + start + at
      raise DataError(f'data.path: {path} holds token id {int(chunk[at])} at token {token} (byte offset '
                      f'{token * part.itemsize}), outside the vocabulary [0, {vocab_size}) of {vocab_size} '
                      f'ids; check data.token_dtype or the tokenizer that wrote it or model.vocab_size.')


def _token_streams(data_cfg: DataConfig, split: str, vocab_size: int) -> list[np.ndarray]:
  dtype_name, fraction = data_cfg.token_dtype, data_cfg.eval_fraction
  dtype = np.dtype(dtype_name)
  max_bytes = data_cfg.max_bytes
  budget = max_bytes // dtype.itemsize if max_bytes else None
  streams, held_out = [], bool(data_cfg.eval_path)  # A held-out corpus: each file whole in its split.
  if held_out:
    fraction = 0.0 if split == 'train' else 1.0
  for _, path in glob_files(data_cfg.eval_path if held_out and split == 'eval' else data_cfg.path):
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
      raise DataError(f'data.path: {path} is {size} bytes, not a positive multiple of {dtype.itemsize} '
                      f'(data.token_dtype={dtype_name!r}); fix data.token_dtype or the file.')
    try:
      tokens = np.memmap(path, dtype=dtype, mode='r')
    except OSError as e:
      raise DataError(f'data.path: cannot read {path} ({e.strerror}); fix it or leave it out.') from e
    if budget is not None:
      tokens = tokens[:budget]
      budget -= len(tokens)
    cut = 0 if fraction == 1.0 else len(tokens) - int(len(tokens) * fraction)
    part, offset = (tokens[:cut], 0) if split == 'train' else (tokens[cut:], cut)
    if len(part):
      _check_ids(part, path, offset, vocab_size)
      streams.append(part)
    if budget == 0:
      break
  if not streams:
    raise DataError(f'The {split} split of {describe(data_cfg)} is empty: data.eval_fraction={fraction} '
                    f'of each file rounds to no tokens; raise it or add data.')
  return streams


def load_split(data_cfg: DataConfig, tok: tokenizer.Tokenizer, split: str, *,
               vocab_size: int | None = None) -> list[np.ndarray]:
  """The token streams of `split` ('train' or 'eval') by the run's tokenizer `tok`, every id below
  `vocab_size` (the model's; default: the tokenizer's), validated; DataError names what to change."""
  source = data_cfg.source
  if source not in SOURCES:
    raise DataError(f'data.source={source!r} is not a file source; choose one of {SOURCES}.')
  if split not in SPLITS:
    raise DataError(f'split={split!r}; choose one of {SPLITS}.')
  if split == 'eval' and data_cfg.eval_fraction == 0.0 and not data_cfg.eval_path:
    raise DataError('data.eval_fraction=0 leaves the eval split empty; set it to e.g. 0.05.')
  if vocab_size is None:
    vocab_size = tok.vocab_size
  if source == 'tokens':
    return _token_streams(data_cfg, split, vocab_size)
  return _text_streams(data_cfg, tok, split, vocab_size)
