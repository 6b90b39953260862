"""Byte tokenizer, corpus sources and the Grain pipeline, on tiny corpora in tmp_path (other tokenizers:
tests/test_tokenizers.py)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from mintrain import config as config_lib
from mintrain.data import pipeline, segments, sources, statistics, tokenizer
from mintrain.data.config import DataConfig
from mintrain.errors import ConfigError, DataError

BYTES = segments.Separators.of(tokenizer.BYTES)  # The byte tokenizer's: BOS starts a document.

BASE_DATA = config_lib.validate(config_lib.defaults()).data


def data_cfg(**values) -> DataConfig:
  """base.py's data section with `values` set, unchecked, so the data layer's own errors show."""
  return dataclasses.replace(BASE_DATA, **values)

LETTERS = np.frombuffer(b'abcdefghijklmnopqrstuvwxyz \n', np.uint8)


def write_corpus(root: pathlib.Path, n_files: int = 24, size: int = 300, seed: int = 0) -> list[bytes]:
  """Random-letter files: every 9-byte window is unique, so a window identifies its position."""
  rng = np.random.default_rng(seed)
  root.mkdir(parents=True, exist_ok=True)
  docs = []
  for i in range(n_files):
    doc = LETTERS[rng.integers(len(LETTERS), size=size)].tobytes()
    (root / f'doc_{i:02d}.txt').write_bytes(doc)
    docs.append(doc)
  return docs


@pytest.fixture
def corpus(tmp_path: pathlib.Path) -> dict:
  write_corpus(tmp_path / 'corpus')
  return data_cfg(source='text', path=str(tmp_path / 'corpus' / '*.txt'), eval_fraction=0.25)


def take(it, n: int) -> list[dict[str, np.ndarray]]:
  return [next(it) for _ in range(n)]


def train_iter(cfg, *, batch=8, seq_len=8, seed=0, index=0, count=1, split='train', micro=None):
  """Process `index` of `count` holding an equal block of each micro-batch's rows."""
  micro = micro or batch
  share = micro // count
  return pipeline.make_iterator(cfg, tokenizer.BYTES, split=split, seq_len=seq_len, global_batch_size=batch,
                                micro_batch_size=micro, rows=np.arange(index * share, (index + 1) * share),
                                seed=seed, separators=BYTES)


def rows(batches: list[dict[str, np.ndarray]]) -> list[tuple[int, ...]]:
  return [tuple(r) for b in batches for r in np.concatenate([b['inputs'], b['targets'][:, -1:]], 1)]


# Tokenizer.

@pytest.mark.parametrize('text', ['', 'hello', 'naïve café ☕ 日本語 🎉', 'tab\tnul\0cr\r\n', 'e\u0301'])
def test_encode_decode_round_trips_any_utf8_text(text):
  ids = tokenizer.BYTES.encode(text)
  assert ids.dtype == np.int32 and ids.shape == (len(text.encode('utf-8')),)
  assert ids.min(initial=0) >= 0 and ids.max(initial=0) < tokenizer.NUM_BYTES
  assert tokenizer.BYTES.decode(ids) == text


def test_decode_drops_special_ids_and_replaces_broken_utf8():
  assert tokenizer.BYTES.document('hi').tolist() == [tokenizer.BOS, 104, 105]
  assert tokenizer.BYTES.decode([tokenizer.BOS, 104, 105, 300, -1]) == 'hi'
  assert tokenizer.BYTES.decode([0xe2, 0x82]) == '\ufffd'


def test_vocab_size_counts_bytes_and_bos_and_pads_to_a_multiple():
  assert tokenizer.VOCAB_SIZE == 257 and tokenizer.BOS == 256
  byte = tokenizer.BYTES
  assert byte.vocab_size == 257 and byte.bos_id == 256 and byte.eos_id is None
  assert tokenizer.padded_vocab_size() == 384
  assert tokenizer.padded_vocab_size(257, 8) == 264
  resolved, _ = config_lib.resolve(config_lib.validate(config_lib.defaults()))
  assert resolved.model.vocab_size == 384  # model.vocab_size=0: from it.


def test_the_byte_tokenizer_has_one_byte_per_token_and_no_files(tmp_path):
  assert tokenizer.load('byte') is tokenizer.BYTES and tokenizer.BYTES.bytes_per_token == 1.0
  assert statistics.bytes_per_token(BASE_DATA, tokenizer.BYTES) == 1.0
  assert tokenizer.BYTES.save(tmp_path / 'out') == [] and not (tmp_path / 'out').exists()


# Packing.

def test_windows_overlap_by_one_token_and_never_cross_streams():
  windows = pipeline.PackedSequences([np.arange(23), np.arange(100, 104), np.arange(200, 211)], seq_len=5)
  assert len(windows) == 4 + 0 + 2
  assert [w.tolist() for w in (windows[0], windows[3], windows[4], windows[5])] == [
      list(range(0, 6)), list(range(15, 21)), list(range(200, 206)), list(range(205, 211))]
  assert windows[2].dtype == np.int32


def test_targets_are_inputs_shifted_by_one():
  batch = segments.split_inputs_targets(np.arange(12, dtype=np.int32).reshape(2, 6), separators=BYTES)
  assert batch['inputs'].tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]
  assert batch['targets'].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]]


def test_text_documents_are_each_preceded_by_bos(tmp_path):
  docs = write_corpus(tmp_path, n_files=5, size=40)
  cfg = data_cfg(source='text', path=str(tmp_path / '*.txt'), eval_fraction=0.5)
  streams = [s for split in ('train', 'eval') for s in sources.load_split(cfg, tokenizer.BYTES, split)]
  assert all(s[0] == tokenizer.BOS for s in streams)
  pieces = [p for s in streams for p in np.split(s, np.flatnonzero(s == tokenizer.BOS))[1:]]
  assert all(p[0] == tokenizer.BOS for p in pieces)
  assert sorted(p[1:].astype(np.uint8).tobytes() for p in pieces) == sorted(docs)


# Order and split.

def test_split_is_disjoint_covering_and_the_same_from_any_working_directory(tmp_path, monkeypatch):
  write_corpus(tmp_path / 'corpus')
  absolute = data_cfg(source='text', path=str(tmp_path / 'corpus' / '*.txt'), eval_fraction=0.25)
  train, evals = (sources.load_split(absolute, tokenizer.BYTES, s)[0] for s in ('train', 'eval'))
  monkeypatch.chdir(tmp_path)
  relative = dataclasses.replace(absolute, path='corpus/*.txt')
  assert np.array_equal(sources.load_split(relative, tokenizer.BYTES, 'train')[0], train)
  assert np.array_equal(sources.load_split(relative, tokenizer.BYTES, 'eval')[0], evals)
  assert np.sum(train == tokenizer.BOS) + np.sum(evals == tokenizer.BOS) == 24
  assert 0 < np.sum(evals == tokenizer.BOS) < 24


def test_adding_a_file_moves_no_other_file_between_splits(tmp_path):
  write_corpus(tmp_path, n_files=12)
  cfg = data_cfg(source='text', path=str(tmp_path / '*.txt'), eval_fraction=0.3)
  keys = [k for k, _ in sources.glob_files(cfg.path)]
  before = {k: sources.in_eval(k, 0.3) for k in keys}
  (tmp_path / 'extra.txt').write_text('more text')
  after = {k: sources.in_eval(k, 0.3) for k, _ in sources.glob_files(cfg.path)}
  assert set(after) == set(before) | {'extra.txt'}
  assert all(after[k] == v for k, v in before.items())
  assert any(before.values()) and not all(before.values())


def test_train_order_is_a_function_of_the_seed(corpus):
  first = rows(take(train_iter(corpus, seed=3), 5))
  assert first == rows(take(train_iter(corpus, seed=3), 5))
  assert first != rows(take(train_iter(corpus, seed=4), 5))


def test_each_epoch_visits_every_window_once_in_a_new_order(corpus):
  windows = pipeline.PackedSequences(sources.load_split(corpus, tokenizer.BYTES, 'train'), 8)
  n = len(windows)
  everything = [tuple(windows[i]) for i in range(n)]
  assert len(set(everything)) == n
  it = train_iter(corpus, batch=1)
  epoch0, epoch1 = rows(take(it, n)), rows(take(it, n))
  assert sorted(epoch0) == sorted(epoch1) == sorted(everything)
  assert epoch0 != epoch1 and epoch0 != everything


@pytest.mark.parametrize('count', [2, 4])
def test_processes_read_disjoint_rows_that_make_up_the_single_process_batch(corpus, count):
  whole = take(train_iter(corpus, batch=8), 6)
  shards = [take(train_iter(corpus, batch=8, index=p, count=count), 6) for p in range(count)]
  for step, batch in enumerate(whole):
    for key in ('inputs', 'targets'):
      local = [s[step][key] for s in shards]
      assert all(x.shape == (8 // count, 8) and x.dtype == np.int32 for x in local)
      assert np.array_equal(np.concatenate(local), batch[key])
  seen = [r for s in shards for r in rows(s)]
  assert len(set(seen)) == len(seen)


def test_eval_batches_come_in_order_without_shuffling(corpus):
  windows = pipeline.PackedSequences(sources.load_split(corpus, tokenizer.BYTES, 'eval'), 8)
  got = rows(take(train_iter(corpus, batch=4, split='eval', seed=7), 3))
  assert got == [tuple(windows[i % len(windows)]) for i in range(12)]
  assert got == rows(take(train_iter(corpus, batch=4, split='eval', seed=8), 3))


# Checkpointing.

def test_restored_iterator_yields_the_batches_the_uninterrupted_one_would(corpus):
  it = train_iter(corpus)
  take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  expected = take(it, 4)
  restored = train_iter(corpus)
  restored.set_state(state)
  assert rows(take(restored, 4)) == rows(expected)


def test_state_saved_on_one_process_resumes_on_two(corpus):
  it = train_iter(corpus)
  take(it, 5)
  state = it.get_state()
  expected = next(it)
  halves = []
  for p in range(2):
    shard = train_iter(corpus, index=p, count=2)
    shard.set_state(state)
    halves.append(next(shard)['inputs'])
  assert np.array_equal(np.concatenate(halves), expected['inputs'])


# Unigram baseline.

@pytest.mark.parametrize('symbols, bits', [([65, 66], 1.0), ([1, 2, 3, 4], 2.0)])
def test_unigram_bits_per_token_is_the_eval_entropy(tmp_path, symbols, bits):
  tokens = np.concatenate([np.zeros(100, np.uint16), np.tile(np.array(symbols, np.uint16), 50)])
  tokens.tofile(tmp_path / 'c.bin')
  fraction = 50 * len(symbols) / len(tokens)  # The eval tail is exactly the tiled symbols.
  cfg = data_cfg(source='tokens', path=str(tmp_path / '*.bin'), eval_fraction=fraction)
  assert statistics.unigram_bits_per_token(cfg, tokenizer.BYTES) == pytest.approx(bits)


# Token files.

def test_token_files_split_into_a_train_head_and_an_eval_tail(tmp_path):
  np.arange(100, dtype=np.uint32).tofile(tmp_path / 'a.bin')
  np.arange(200, 250, dtype=np.uint32).tofile(tmp_path / 'b.bin')
  cfg = data_cfg(source='tokens', path=str(tmp_path / '*.bin'), token_dtype='uint32', eval_fraction=0.2)
  train, evals = (sources.load_split(cfg, tokenizer.BYTES, split) for split in ('train', 'eval'))
  assert [s.tolist() for s in train] == [list(range(80)), list(range(200, 240))]
  assert [s.tolist() for s in evals] == [list(range(80, 100)), list(range(240, 250))]
  assert isinstance(train[0], np.memmap)


# Bad input: one DataError naming the file or setting.

def test_glob_that_matches_nothing_names_the_pattern(tmp_path):
  with pytest.raises(DataError, match=r"data.path=.*nothing.*matches no files"):
    sources.load_split(data_cfg(source='text', path=str(tmp_path / 'nothing' / '*.txt')), tokenizer.BYTES,
                       'train')
  with pytest.raises(DataError, match='data.path is empty'):
    sources.load_split(data_cfg(source='text'), tokenizer.BYTES, 'train')


@pytest.mark.parametrize('content, problem', [(b'abc\0def', 'binary'), (b'caf\xe9', 'not UTF-8')])
def test_binary_or_non_utf8_file_is_named(tmp_path, content, problem):
  write_corpus(tmp_path, n_files=3)
  (tmp_path / 'bad.txt').write_bytes(content)
  cfg = data_cfg(source='text', path=str(tmp_path / '*.txt'), eval_fraction=0.01)
  split = 'eval' if sources.in_eval('bad.txt', 0.01) else 'train'
  with pytest.raises(DataError, match=f'bad.txt.*{problem}'):
    sources.load_split(cfg, tokenizer.BYTES, split)


def test_unreadable_file_is_named(tmp_path, monkeypatch):
  write_corpus(tmp_path, n_files=2)

  def refuse(self):
    raise PermissionError(13, 'Permission denied', str(self))

  monkeypatch.setattr(pathlib.Path, 'read_bytes', refuse)
  cfg = data_cfg(source='text', path=str(tmp_path / '*.txt'), eval_fraction=1e-9)
  with pytest.raises(DataError, match=r'cannot read .*doc_0\d.txt \(Permission denied\)'):
    sources.load_split(cfg, tokenizer.BYTES, 'train')


def test_token_file_of_partial_tokens_names_the_dtype(tmp_path):
  (tmp_path / 'odd.bin').write_bytes(b'\x01\x00\x02')
  cfg = data_cfg(source='tokens', path=str(tmp_path / '*.bin'), token_dtype='uint16')
  with pytest.raises(DataError, match=r"odd.bin is 3 bytes, not a positive multiple of 2.*token_dtype"):
    sources.load_split(cfg, tokenizer.BYTES, 'train')


def test_token_id_outside_the_vocabulary_names_file_and_position(tmp_path):
  tokens = np.full(64, 65, np.uint16)
  tokens[17] = 300
  tokens.tofile(tmp_path / 'ids.bin')
  cfg = data_cfg(source='tokens', path=str(tmp_path / '*.bin'), eval_fraction=0.1)
  with pytest.raises(DataError, match=r'ids.bin holds token id 300 at token 17 \(byte offset 34\), outside '
                                      r'the vocabulary \[0, 257\) of 257 ids'):
    sources.load_split(cfg, tokenizer.BYTES, 'train')
  assert sources.load_split(cfg, tokenizer.BYTES, 'train', vocab_size=384)[0][17] == 300  # Below the model's.
  with pytest.raises(DataError, match=r'ids.bin holds token id 300 at token 17 .*of 300 ids'):
    pipeline.make_iterator(cfg, tokenizer.BYTES, split='train', seq_len=8, global_batch_size=8,
                           micro_batch_size=8, rows=np.arange(8), seed=0, vocab_size=300)


def test_sequence_longer_than_the_split_names_seq_len(corpus):
  with pytest.raises(DataError, match=r'eval split .* fewer than train.seq_len \+ 1 = 100001'):
    train_iter(corpus, split='eval', seq_len=100_000)


def test_a_small_corpus_still_holds_one_file_out_and_a_single_file_says_what_to_do(tmp_path):
  write_corpus(tmp_path, n_files=3)
  cfg = data_cfg(source='text', path=str(tmp_path / '*.txt'), eval_fraction=1e-9)  # No file hashes below.
  held = sources._split_files(cfg, 'eval')
  assert len(held) == 1 and not set(held) & set(sources._split_files(cfg, 'train'))
  assert len(sources._split_files(cfg, 'train')) == 2
  one = data_cfg(source='text', path=str(tmp_path / 'doc_00.txt'))
  assert len(sources.load_split(one, tokenizer.BYTES, 'train')) == 1  # It trains on its one file.
  says = (r'holds one file: no eval split can be held out of it; give a held-out corpus as '
          r'data.eval_path=GLOB, or turn evaluation off with eval.steps=0')
  with pytest.raises(DataError, match=says):
    sources.load_split(one, tokenizer.BYTES, 'eval')


def test_an_eval_path_is_the_eval_split_and_nothing_is_held_out_of_path(tmp_path):
  write_corpus(tmp_path / 'train', n_files=5)
  write_corpus(tmp_path / 'held', n_files=2)
  cfg = data_cfg(source='text', path=str(tmp_path / 'train' / '*.txt'),
                 eval_path=str(tmp_path / 'held' / '*.txt'))
  assert {p.parent.name for p in sources._split_files(cfg, 'eval')} == {'held'}
  assert len(sources._split_files(cfg, 'train')) == 5


def test_empty_eval_split_names_eval_fraction(tmp_path):
  write_corpus(tmp_path, n_files=3)
  cfg = data_cfg(source='text', path=str(tmp_path / '*.txt'))
  with pytest.raises(DataError, match='eval_fraction=0 leaves the eval split empty'):
    sources.load_split(dataclasses.replace(cfg, eval_fraction=0.0), tokenizer.BYTES, 'eval')
  np.zeros(10, np.uint16).tofile(tmp_path / 't.bin')
  with pytest.raises(DataError, match='eval split .* rounds to no tokens'):
    cfg = data_cfg(source='tokens', path=str(tmp_path / '*.bin'), eval_fraction=0.05)
    sources.load_split(cfg, tokenizer.BYTES, 'eval')


def test_a_source_that_is_no_file_source_names_the_key():
  with pytest.raises(DataError, match="data.source='synthetic' is not a file source"):
    train_iter(data_cfg(source='synthetic'))


@pytest.mark.parametrize('overrides, message', [
    (['data.source=tokens', 'data.path=x', 'data.token_dtype=int8'], "data.token_dtype='int8'"),
    (['data.eval_fraction=1.0'], r'data.eval_fraction=1.0 must be in \[0, 1\)'),
    (['train.global_batch_size=6', 'train.grad_accum_steps=4'], 'train.global_batch_size=6 is not divisible'),
])
def test_bad_settings_name_the_key_once_when_the_config_is_read(overrides, message):
  from helpers import load_config
  with pytest.raises(ConfigError, match=message):
    load_config('single', *overrides)


# The embedded stdlib corpus.

def test_stdlib_files_are_sorted_python_sources_without_tests():
  files = sources.stdlib_files()
  keys = [k for k, _ in files]
  assert len(keys) > 100 and keys == sorted(keys) and files == sources.stdlib_files()
  assert 'os.py' in keys and 'json/__init__.py' in keys
  for key in keys:
    parts = key.split('/')
    assert parts[-1].endswith('.py') and not parts[-1].startswith('test_')
    assert not {'test', 'tests', 'idle_test', 'site-packages'} & set(parts[:-1]), key


def test_stdlib_max_bytes_reads_only_the_leading_files_and_batches_from_them():
  cfg = data_cfg(source='stdlib', max_bytes=100_000, eval_fraction=0.5)
  streams = [s for split in ('train', 'eval') for s in sources.load_split(cfg, tokenizer.BYTES, split)]
  sizes = [p.stat().st_size for _, p in sources.stdlib_files()]
  n_files = int(np.searchsorted(np.cumsum(sizes), 100_000)) + 1
  assert sum(len(s) for s in streams) == sum(sizes[:n_files]) + n_files
  batch = next(train_iter(cfg, batch=4, seq_len=32))
  assert batch['inputs'].shape == batch['targets'].shape == (4, 32)
  assert np.array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])
