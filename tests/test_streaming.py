"""Streamed sources (JSONL, JSONL.gz, Parquet, ArrayRecord, Hugging Face datasets, map-style or streamed) and
mixtures, on corpora the tests write."""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import logging
import pathlib
import re
from typing import Any

import numpy as np
import pytest

from mintrain import config as config_lib
from mintrain import errors, metrics
from mintrain.data import pipeline, records, splits, statistics, streaming, tokenizer
from mintrain.data.config import DataConfig
from mintrain.errors import DataError

BASE_DATA = config_lib.validate(config_lib.defaults()).data
WORDS = ('alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta', 'eta', 'theta', 'iota', 'kappa')


def data_cfg(**values) -> DataConfig:
  """base.py's data section with `values` set, unchecked, so the data layer's own errors show."""
  return dataclasses.replace(BASE_DATA, **{'prefetch': 0, **values})


def documents(n: int, seed: int = 0, tag: str = 'doc') -> list[str]:
  """Distinct documents of 2-60 words, each naming itself first."""
  rng = np.random.default_rng(seed)
  return [f'<{tag} {i}> ' + ' '.join(rng.choice(WORDS, size=rng.integers(2, 60))) for i in range(n)]


def write_jsonl(root: pathlib.Path, docs: list[str], files: int = 3, gz: bool = False) -> str:
  root.mkdir(parents=True, exist_ok=True)
  for f in range(files):
    lines = ''.join(json.dumps({'id': i, 'text': d}) + '\n' for i, d in enumerate(docs) if i % files == f)
    if gz:
      with gzip.open(root / f'part{f}.jsonl.gz', 'wt') as out:
        out.write(lines)
    else:
      (root / f'part{f}.jsonl').write_text(lines)
  return str(root / ('*.jsonl.gz' if gz else '*.jsonl'))


def write_parquet(root: pathlib.Path, docs: list[str], files: int = 2, row_group: int = 16,
                  column: str = 'text') -> str:
  import pyarrow as pa
  import pyarrow.parquet as pq
  root.mkdir(parents=True, exist_ok=True)
  for f in range(files):
    mine = [d for i, d in enumerate(docs) if i % files == f]
    pq.write_table(pa.table({column: mine, 'n': list(range(len(mine)))}), root / f'part{f}.parquet',
                   row_group_size=row_group)
  return str(root / '*.parquet')


def write_array_records(root: pathlib.Path, docs: list[str], files: int = 2) -> str:
  from array_record.python.array_record_module import ArrayRecordWriter
  root.mkdir(parents=True, exist_ok=True)
  for f in range(files):
    writer = ArrayRecordWriter(str(root / f'part{f}.arrayrecord'), 'group_size:1')
    for i, d in enumerate(docs):
      if i % files == f:
        writer.write(d.encode('utf-8'))
    writer.close()
  return str(root / '*.arrayrecord')


def write_saved_dataset(root: pathlib.Path, docs: list[str]) -> str:
  """A dataset written by `datasets`' save_to_disk, a DatasetDict with the docs as its 'train' split."""
  import datasets
  datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': docs, 'id': list(range(len(docs)))}),
                        'test': datasets.Dataset.from_dict({'text': docs[:2], 'id': [0, 1]})}
                       ).save_to_disk(str(root))
  return str(root)


FORMATS = {
    'jsonl': lambda root, docs: data_cfg(source='jsonl', path=write_jsonl(root, docs), block_bytes=1500),
    'jsonl.gz': lambda root, docs: data_cfg(source='jsonl', path=write_jsonl(root, docs, files=12, gz=True)),
    'parquet': lambda root, docs: data_cfg(source='parquet', path=write_parquet(root, docs)),
    'arrayrecord': lambda root, docs: data_cfg(source='arrayrecord', path=write_array_records(root, docs),
                                               block_bytes=1500),
    'hf_saved': lambda root, docs: data_cfg(source='hf_datasets', path=write_saved_dataset(root, docs),
                                            block_bytes=1500),
    'hf_parquet': lambda root, docs: data_cfg(source='hf_datasets', path=write_parquet(root, docs),
                                              block_bytes=1500),
    # load_dataset(streaming=True): a block per shard, a JSON file or a Parquet row group.
    'hf_stream_json': lambda root, docs: data_cfg(source='hf_datasets', path=write_jsonl(root, docs),
                                                  hf_streaming=True),
    'hf_stream_parquet': lambda root, docs: data_cfg(source='hf_datasets', hf_streaming=True,
                                                     path=write_parquet(root, docs, row_group=8)),
}


def rows_iter(cfg, *, rows=range(8), batch=8, seq_len=16, seed=0, split='train', micro=None):
  return pipeline.make_iterator(cfg, tokenizer.load(cfg.tokenizer), split=split, seq_len=seq_len,
                                global_batch_size=batch, micro_batch_size=micro or batch,
                                rows=np.asarray(list(rows)), seed=seed)


def take(it, n):
  return [next(it) for _ in range(n)]


def stream_text(batches, row=0) -> str:
  """Row `row`'s packed stream as text, each window's shared last token counted once."""
  ids = [b['inputs'][row] for b in batches] + [batches[-1]['targets'][row][-1:]]
  return ''.join(chr(i) if i < 256 else '\x00' for i in np.concatenate(ids))


def docs_of(text: str) -> list[str]:
  return [d for d in text.split('\x00') if d]


@pytest.mark.parametrize('fmt', FORMATS)
def test_every_document_once_per_epoch_then_again_in_a_new_order(tmp_path, fmt):
  docs = documents(60)
  cfg = dataclasses.replace(FORMATS[fmt](tmp_path, docs), eval_fraction=0.0, shuffle_window=1)
  total = sum(len(d) + 1 for d in docs)
  seq_len = 16
  batches = take(rows_iter(cfg, rows=[0], batch=1, seq_len=seq_len), 2 * total // seq_len + 2)
  got = docs_of(stream_text(batches))
  # Row 0 of a 1-row batch reads every block in turn: whole documents, the first epoch all of them once.
  first = got[:len(docs)]
  assert sorted(first) == sorted(docs)
  second = got[len(docs):2 * len(docs)]
  assert second != first and first != docs


def test_formats_hold_the_same_documents_block_by_block(tmp_path):
  docs = documents(50)
  for fmt, make in FORMATS.items():
    cfg = make(tmp_path / fmt.replace('.', '_'), docs)
    reader = records.Reader(cfg, tokenizer.BYTES)
    blocks = reader.all_blocks()
    read = [d for i in range(len(blocks)) for d in reader.read(blocks, i)]
    assert sorted(read) == sorted(docs), fmt
    assert len(blocks) > 1, fmt


def test_jsonl_blocks_split_at_line_starts_whatever_the_block_size(tmp_path):
  docs = documents(40)
  path = write_jsonl(tmp_path, docs, files=1)
  for block_bytes in (1, 7, 100, 1 << 20):
    reader = records.Reader(data_cfg(source='jsonl', path=path, block_bytes=block_bytes), tokenizer.BYTES)
    blocks = reader.all_blocks()
    assert [d for i in range(len(blocks)) for d in reader.read(blocks, i)] == docs


@pytest.mark.parametrize('fmt', ['jsonl', 'parquet', 'hf_stream_parquet'])
def test_processes_holding_some_rows_get_those_rows_of_the_one_process_batch(tmp_path, fmt):
  cfg = FORMATS[fmt](tmp_path, documents(80))
  whole = take(rows_iter(cfg), 5)
  for part in ([0, 1, 2, 3], [4, 5, 6, 7], [1, 6]):
    local = take(rows_iter(cfg, rows=part), 5)
    for a, b in zip(whole, local):
      assert np.array_equal(a['inputs'][part], b['inputs'])
      assert np.array_equal(a['targets'][part], b['targets'])


def test_micro_batches_are_rows_of_the_global_batch(tmp_path):
  cfg = FORMATS['jsonl'](tmp_path, documents(80))
  whole = take(rows_iter(cfg), 3)
  accum = take(rows_iter(cfg, rows=[1, 3], micro=4), 3)  # Rows 1, 3 of micro-batches 0 and 1: 1, 3, 5, 7.
  for a, b in zip(whole, accum):
    assert np.array_equal(a['inputs'][[1, 3, 5, 7]], b['inputs'])


@pytest.mark.parametrize('fmt', ['jsonl', 'hf_stream_parquet'])
def test_a_process_reads_only_the_blocks_of_its_rows(tmp_path, monkeypatch, fmt):
  cfg = data_cfg(source='jsonl', path=write_jsonl(tmp_path, documents(400), files=4), block_bytes=600,
                 eval_fraction=0.0, shuffle_window=1)
  if fmt == 'hf_stream_parquet':  # A shard per row group of 8 documents: 50 shards.
    cfg = dataclasses.replace(cfg, source='hf_datasets', hf_streaming=True,
                              path=write_parquet(tmp_path / 'parquet', documents(400), files=4, row_group=8))
  read = collections.defaultdict(set)
  original = records.Reader.read

  def spy(self, blocks, i):
    read[self.tag].add(i)
    return original(self, blocks, i)

  monkeypatch.setattr(records.Reader, 'read', spy)
  for name, rows in (('low', range(4)), ('high', range(4, 8)), ('all', range(8))):
    monkeypatch.setattr(records.Reader, 'tag', name, raising=False)
    take(rows_iter(cfg, rows=rows), 4)
  assert read['low'] and read['high'] and not read['low'] & read['high']
  assert read['low'] | read['high'] == read['all']
  assert len(read['all']) < len(records.Reader(cfg, tokenizer.BYTES).all_blocks())


@pytest.mark.parametrize('fmt', FORMATS)
def test_state_resumes_exactly_on_any_split_of_the_rows(tmp_path, fmt):
  cfg = FORMATS[fmt](tmp_path, documents(80))
  straight = rows_iter(cfg, rows=range(4))
  take(straight, 7)
  upper = rows_iter(cfg, rows=range(4, 8))
  take(upper, 7)
  saved = json.loads(json.dumps({'step': 7, 'rows': {**straight.get_state()['rows'],
                                                     **upper.get_state()['rows']}}))
  expected = take(rows_iter(cfg), 12)[7:]
  for part in (range(8), [0, 5], [7]):
    resumed = rows_iter(cfg, rows=part)
    resumed.set_state(saved)
    for want, got in zip(expected, take(resumed, 5)):
      assert np.array_equal(want['inputs'][list(part)], got['inputs'])


def test_prefetching_reports_the_position_of_the_batches_handed_out(tmp_path):
  cfg = FORMATS['jsonl'](tmp_path, documents(80))
  plain, ahead = rows_iter(cfg), rows_iter(dataclasses.replace(cfg, prefetch=3))
  for a, b in zip(take(plain, 4), take(ahead, 4)):
    assert np.array_equal(a['inputs'], b['inputs'])
  assert plain.get_state() == ahead.get_state()
  ahead.set_state(rows_iter(cfg).get_state())
  assert np.array_equal(next(ahead)['inputs'], next(rows_iter(cfg))['inputs'])


def test_order_is_a_function_of_the_seed_and_eval_is_in_file_order(tmp_path):
  cfg = dataclasses.replace(FORMATS['jsonl'](tmp_path, documents(200)), eval_fraction=0.3)
  a, b, c = (take(rows_iter(cfg, seed=s), 3) for s in (0, 0, 1))
  assert all(np.array_equal(x['inputs'], y['inputs']) for x, y in zip(a, b))
  assert not np.array_equal(a[0]['inputs'], c[0]['inputs'])
  e0, e1 = (take(rows_iter(cfg, seed=s, split='eval', rows=[0], batch=1), 10) for s in (0, 1))
  assert all(np.array_equal(x['inputs'], y['inputs']) for x, y in zip(e0, e1))
  evaluated = docs_of(stream_text(e0))
  split = splits.Split(cfg, tokenizer.BYTES, 'eval', seed=0)
  blocks = split.split_blocks
  in_file_order = [d for i in range(len(blocks)) for d in split.reader.read(blocks, i)]
  assert evaluated[:-1] == in_file_order[:len(evaluated) - 1]
  train_docs = set(docs_of(stream_text(take(rows_iter(cfg, rows=[0], batch=1), 60))))
  assert not set(evaluated[1:-1]) & train_docs  # Whole blocks go to one split.


def test_token_fractions_follow_the_weights_and_are_the_draws():
  mix = data_cfg(source='mixture', mixture=(((('path', 'a'), ('source', 'jsonl')), 3.0),
                                            ((('path', 'b'), ('source', 'parquet')), 1.0)))
  fractions = streaming.token_fractions(mix, 0, 64, range(200))
  assert abs(fractions['data_fraction_0'] - 0.75) < 0.02 and abs(sum(fractions.values()) - 1) < 1e-9
  draws = streaming.mixture_choices([3.0, 1.0], 0, 5, 64)
  assert streaming.token_fractions(mix, 0, 64, range(5, 6))['data_fraction_1'] == draws.mean()


@pytest.mark.parametrize('second', [{'source': 'parquet'}, {'source': 'hf_datasets', 'hf_streaming': True}])
def test_mixture_rows_come_from_the_drawn_source_and_resume_exactly(tmp_path, second):
  a = write_jsonl(tmp_path / 'a', documents(80, tag='jsonl'))
  b = write_parquet(tmp_path / 'b', documents(80, seed=1, tag='parquet'))
  mix = data_cfg(source='mixture', block_bytes=1500,
                 mixture=(({'path': a, 'source': 'jsonl'}, 1.0), ({'path': b, **second}, 1.0)))
  it = rows_iter(mix)
  first = take(it, 6)
  for step, batch in enumerate(first):
    choice = streaming.mixture_choices([1.0, 1.0], 0, step, 8)
    for row in range(8):
      text = ''.join(chr(i) for i in batch['inputs'][row] if i < 256)
      starts = set(re.findall(r'<([jp])', text))  # A document's start names its source (maybe cut short).
      assert starts <= {'jp'[choice[row]]}, (text, choice[row])
  state = json.loads(json.dumps(it.get_state()))
  assert len(state['rows']['0']) == 6  # A (window, document, token) position per source.
  expected = take(it, 4)
  resumed = rows_iter(mix, rows=[2, 5])
  resumed.set_state(state)
  for want, got in zip(expected, take(resumed, 4)):
    assert np.array_equal(want['inputs'][[2, 5]], got['inputs'])


def test_a_source_that_runs_out_repeats_and_says_so(tmp_path, capsys):
  docs = documents(6)
  cfg = data_cfg(source='jsonl', path=write_jsonl(tmp_path, docs, files=1), eval_fraction=0.0,
                 shuffle_window=1)
  with metrics.console_logging(print):  # As in a run.
    batches = take(rows_iter(cfg, rows=[0], batch=1), sum(len(d) + 1 for d in docs) // 16 + 4)
  assert 'ran out; repeating it (epoch 2)' in capsys.readouterr().out
  assert len(docs_of(stream_text(batches))) > len(docs)


def test_unigram_baseline_of_a_streamed_source_counts_its_eval_split(tmp_path):
  cfg = data_cfg(source='jsonl', path=write_jsonl(tmp_path, ['ab' * 50] * 20, files=1), eval_fraction=0.5,
                 block_bytes=200)
  # Documents of 'a' and 'b' in equal numbers and one BOS per 100: entropy just above 1 bit.
  p = np.array([50, 50, 1]) / 101
  assert statistics.unigram_bits_per_token(cfg, tokenizer.BYTES) == pytest.approx(-(p * np.log2(p)).sum())


# Bad input.

def first_batch(cfg):
  return next(rows_iter(dataclasses.replace(cfg, eval_fraction=0.0), rows=[0], batch=1, seq_len=8))


def bad_jsonl(tmp_path, line: str) -> DataConfig:
  lines = [json.dumps({'text': 'fine'})] * 3 + [line] + [json.dumps({'text': 'fine too'})]
  (tmp_path / 'a.jsonl').write_text('\n'.join(lines) + '\n')
  return data_cfg(source='jsonl', path=str(tmp_path / 'a.jsonl'), block_bytes=20)


@pytest.mark.parametrize('line, says', [
    ('{"text": "cut', 'a.jsonl:4: not valid JSON'),
    ('{"body": "x"}', "a.jsonl:4: no field 'text' (data.text_field)"),
    ('{"text": 3}', "a.jsonl:4: field 'text' (data.text_field) is int, not a string"),
])
def test_a_bad_jsonl_line_names_file_and_line(tmp_path, line, says):
  with pytest.raises(DataError, match=re.escape(says) + '.*data.skip_bad_records=True') as e:
    first_batch(bad_jsonl(tmp_path, line))
  assert '\n' not in str(e.value)


def test_skip_bad_records_leaves_out_only_the_bad_line_and_counts_it(tmp_path, capsys):
  cfg = dataclasses.replace(bad_jsonl(tmp_path, '{"text": "cut'), skip_bad_records=True)
  reader = records.Reader(cfg, tokenizer.BYTES)
  blocks = reader.all_blocks()
  with metrics.console_logging(print):
    assert [d for i in range(len(blocks)) for d in reader.read(blocks, i)] == ['fine'] * 3 + ['fine too']
  assert 'warning: data.skip_bad_records: skipped ' in capsys.readouterr().err and reader.bad.count == 1


def test_skip_bad_records_leaves_out_bad_files_with_a_warning_each(tmp_path, capsys):
  docs = documents(30)
  write_parquet(tmp_path, docs)
  (tmp_path / 'broken.parquet').write_bytes(b'PAR1 not really')
  (tmp_path / 'empty.parquet').write_bytes(b'')
  cfg = data_cfg(source='parquet', path=str(tmp_path / '*.parquet'), skip_bad_records=True)
  reader = records.Reader(cfg, tokenizer.BYTES)
  with metrics.console_logging(print):
    blocks = reader.all_blocks()
    assert sorted(d for i in range(len(blocks)) for d in reader.read(blocks, i)) == sorted(docs)
  err = capsys.readouterr().err
  assert reader.bad.count == 2 and 'broken.parquet is not a readable Parquet file' in err
  assert 'empty.parquet is empty (2 skipped so far)' in err


def test_bad_files_are_named(tmp_path):
  (tmp_path / 'empty.jsonl').write_text('')
  with pytest.raises(DataError, match=r'empty.jsonl is empty'):
    first_batch(data_cfg(source='jsonl', path=str(tmp_path / 'empty.jsonl')))
  (tmp_path / 'bad.parquet').write_bytes(b'PAR1 not really')
  with pytest.raises(DataError, match=r'bad.parquet is not a readable Parquet file'):
    first_batch(data_cfg(source='parquet', path=str(tmp_path / 'bad.parquet')))
  path = write_parquet(tmp_path / 'other', documents(10), column='content')
  with pytest.raises(DataError, match=r"part0.parquet has no column 'text' \(data.text_field; its columns: "
                                      r'content, n\)'):
    first_batch(data_cfg(source='parquet', path=path))
  (tmp_path / 'bad.arrayrecord').write_bytes(b'\0' * 100)
  with pytest.raises(DataError, match=r'bad.arrayrecord is not a readable ArrayRecord file'):
    first_batch(data_cfg(source='arrayrecord', path=str(tmp_path / 'bad.arrayrecord')))
  with gzip.open(tmp_path / 'cut.jsonl.gz', 'wt') as f:
    f.write(json.dumps({'text': 'x' * 5000}) + '\n')
  (tmp_path / 'cut.jsonl.gz').write_bytes((tmp_path / 'cut.jsonl.gz').read_bytes()[:40])
  with pytest.raises(DataError, match=r'cannot read .*cut.jsonl.gz'):
    first_batch(data_cfg(source='jsonl', path=str(tmp_path / 'cut.jsonl.gz')))


def test_token_records_outside_the_vocabulary_are_named(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(str(tmp_path / 'ids.arrayrecord'), 'group_size:1')
  writer.write(np.array([tokenizer.BOS, 65, 66], np.uint16).tobytes())
  writer.write(np.array([tokenizer.BOS, 999], np.uint16).tobytes())
  writer.close()
  cfg = data_cfg(source='arrayrecord', record_format='tokens', path=str(tmp_path / 'ids.arrayrecord'))
  with pytest.raises(DataError, match=r'ids.arrayrecord record 1: token id 999 is outside the vocabulary'):
    first_batch(cfg)


@pytest.mark.parametrize('entry, says', [
    ("({'source': 'jsonl', 'path': 'a'}, 0)", r'data.mixture\[0\]: weight=0 must be a finite number > 0'),
    ("({'source': 'jsonl', 'path': 'a'}, -1.5)", r'weight=-1.5 must be'),
    ("({'source': 'csv', 'path': 'a'}, 1)", r"source='csv' is not a source a mixture can draw from"),
    ("({'source': 'jsonl', 'prefetch': 2}, 1)", r"'prefetch' is not an option a mixture source may set"),
    ("({'source': 'jsonl', 'block_bytes': 0}, 1)", r'data.mixture\[0\].block_bytes=0 must be'),
])
def test_bad_mixture_entries_are_config_errors(entry, says):
  from helpers import load_config
  with pytest.raises(errors.ConfigError, match=says):
    load_config('single', 'data.source=mixture', f'data.mixture=[{entry}]')


def test_mixture_and_source_go_together():
  from helpers import load_config
  with pytest.raises(errors.ConfigError, match="data.source='mixture' and a non-empty data.mixture"):
    load_config('single', 'data.source=mixture')
  with pytest.raises(errors.ConfigError, match="data.source='mixture' and a non-empty data.mixture"):
    load_config('single', "data.mixture=[({'source': 'jsonl', 'path': 'a'}, 1)]")


def test_a_streamed_source_reads_with_the_runs_tokenizer_and_measures_its_bytes_per_token(tmp_path,
                                                                                            bpe_tokenizer):
  from mintrain.data import tokenizer
  docs = documents(40)
  cfg = data_cfg(source='jsonl', path=write_jsonl(tmp_path, docs, files=1), tokenizer=str(bpe_tokenizer),
                 eval_fraction=0.0, block_bytes=1 << 20, shuffle_window=1)
  tok = tokenizer.load(str(bpe_tokenizer))
  first = next(rows_iter(cfg, rows=[0], batch=1, seq_len=32))
  whole = np.concatenate([tok.document(d) for d in docs])
  window = np.concatenate([first['inputs'][0], first['targets'][0][-1:]])
  assert any(np.array_equal(whole[i:i + 33], window) for i in range(len(whole) - 32))  # BPE ids, in order.
  measured = statistics.bytes_per_token(dataclasses.replace(cfg, eval_fraction=0.5), tok)
  assert 1.1 < measured < 6  # A BPE token is often several bytes; a byte token (with BOS) is under 1.


def corpus(tmp_path, **values) -> DataConfig:
  """Three JSONL files of `<doc i>` documents (file i % 3) in blocks of about 300 bytes, all for training."""
  return data_cfg(**{'source': 'jsonl', 'path': write_jsonl(tmp_path / 'corpus', documents(90)),
                     'block_bytes': 300, 'shuffle_window': 1, 'eval_fraction': 0.0, **values})


def saved_after(cfg: DataConfig, steps: int) -> tuple[Any, dict]:
  """(the iterator, its state after `steps` steps as a checkpoint holds it)."""
  it = rows_iter(cfg)
  take(it, steps)
  return it, json.loads(json.dumps(it.get_state()))


def resume(cfg: DataConfig, state: dict, capsys) -> tuple[Any, str]:
  """(an iterator on the corpus as it is now, continuing `state`; what it said, as in a run)."""
  it = rows_iter(cfg)
  with metrics.console_logging(print):
    it.set_state(state)
  said = capsys.readouterr()
  return it, said.out + said.err


def doc_numbers(batches) -> set[int]:
  return {int(n) for row in range(8) for n in re.findall(r'<doc (\d+)>', stream_text(batches, row))}


@pytest.mark.parametrize('prefetch', [0, 3])  # Read ahead before the state is set, as a run does.
def test_an_added_file_joins_at_the_next_epoch_and_the_rows_continue_exactly(tmp_path, capsys, prefetch):
  cfg = corpus(tmp_path, prefetch=prefetch)
  straight, state = saved_after(cfg, 30)
  assert resume(cfg, state, capsys)[1] == ''  # An unchanged corpus: nothing to say.
  new = ''.join(json.dumps({'text': d}) + '\n' for d in documents(30, seed=5, tag='new'))
  (tmp_path / 'corpus' / 'part3.jsonl').write_text(new)
  resumed, said = resume(cfg, state, capsys)
  assert said.count('\n') == 1 and said.startswith("warning: data: jsonl '"), said
  assert ('changed since the checkpoint: 1 file(s) added (part3.jsonl); continuing its order with the files '
          'unchanged until epoch') in said
  old, after = take(straight, 300), take(resumed, 300)
  for a, b in zip(old[:3], after[:3]):
    assert np.array_equal(a['inputs'], b['inputs'])  # Every row continues exactly where it was.
  assert not any('<new' in stream_text(old, row) for row in range(8))
  assert any('<new' in stream_text(after, row) for row in range(8))  # From the next epoch on.


def test_a_removed_file_and_one_cut_short_are_named_and_their_lost_documents_never_read(tmp_path, capsys):
  cfg = corpus(tmp_path)
  _, state = saved_after(cfg, 30)
  (tmp_path / 'corpus' / 'part1.jsonl').unlink()
  part2 = tmp_path / 'corpus' / 'part2.jsonl'
  lines = part2.read_text().splitlines(keepends=True)
  part2.write_text(''.join(lines[:len(lines) // 2]))  # Cut short in place, at a line's end.
  resumed, said = resume(cfg, state, capsys)
  assert '1 file(s) removed (part1.jsonl); 1 file(s) changed (part2.jsonl)' in said, said
  seen = doc_numbers(take(resumed, 300))
  cut = [i for i in range(90) if i % 3 == 2][len(lines) // 2:]
  assert seen and not seen & set(range(1, 90, 3)) and not seen & set(cut)


def test_a_hugging_face_stream_whose_shards_changed_says_so_and_reads_them_next_epoch(tmp_path, capsys):
  cfg = corpus(tmp_path, source='hf_datasets', hf_streaming=True)  # A shard per file: 3.
  straight, state = saved_after(cfg, 30)
  (tmp_path / 'corpus' / 'part3.jsonl').write_text(
      ''.join(json.dumps({'text': d}) + '\n' for d in documents(30, seed=5, tag='new')))
  resumed, said = resume(cfg, state, capsys)
  assert "changed since the checkpoint: 1 file(s) changed (" in said and 'until epoch' in said, said
  after = take(resumed, 300)
  assert any('<new' in stream_text(after, row) for row in range(8))


def test_on_corpus_change_restart_starts_the_new_corpus_order_at_the_checkpoints_step(tmp_path, capsys):
  cfg = corpus(tmp_path, on_corpus_change='restart')
  _, state = saved_after(cfg, 30)
  (tmp_path / 'corpus' / 'part0.jsonl').unlink()
  resumed, said = resume(cfg, state, capsys)
  assert "1 file(s) removed (part0.jsonl); its data order starts anew at the checkpoint's step" in said
  assert resumed.get_state()['step'] == 30
  for a, b in zip(take(rows_iter(cfg), 5), take(resumed, 5)):
    assert np.array_equal(a['inputs'], b['inputs'])


def test_a_state_without_its_corpus_resumes_a_changed_corpus_without_breaking(tmp_path):
  cfg = corpus(tmp_path, block_bytes=1500)
  _, state = saved_after(cfg, 12)
  del state['corpus']  # As a checkpoint from before the corpus was recorded.
  (tmp_path / 'corpus' / 'part1.jsonl').unlink()
  resumed = rows_iter(cfg)
  resumed.set_state(state)
  assert len(take(resumed, 100)) == 100  # Positions into other documents move on to the next one.


def test_a_one_block_corpus_is_split_by_document_and_says_once_that_it_is_small(tmp_path, caplog):
  path = write_jsonl(tmp_path / 'one', documents(40), files=1)
  cfg = data_cfg(source='jsonl', path=path, eval_fraction=0.05)
  train, held = (splits.Split(cfg, tokenizer.BYTES, split, seed=0) for split in ('train', 'eval'))
  assert len(train.split_blocks) == len(held.split_blocks) == 1
  train_docs, eval_docs = (part.read(part.split_blocks, 0) for part in (train, held))
  assert len(train_docs) + len(eval_docs) == 40 and 1 <= len(eval_docs) <= 4
  assert not set(train_docs) & set(eval_docs)
  with caplog.at_level(logging.INFO, logger='mintrain'):
    batches = take(rows_iter(cfg), 30)  # 8 rows of 4 blocks each on one block: it repeats at once.
  said = [r.getMessage() for r in caplog.records]
  assert [m for m in said if 'is small' in m] and not [m for m in said if 'repeating it' in m], said
  seen = set(docs_of(stream_text(batches)))
  assert seen and not seen & set(eval_docs)
  one_doc = write_jsonl(tmp_path / 'single', documents(1), files=1)
  with pytest.raises(DataError, match='holds one document: no eval split can be held out'):
    splits.Split(data_cfg(source='jsonl', path=one_doc), tokenizer.BYTES, 'eval', seed=0)


def test_a_streamed_eval_path_is_read_whole_for_eval(tmp_path):
  train_path = write_jsonl(tmp_path / 'train', documents(30))
  held_path = write_jsonl(tmp_path / 'held', documents(6, seed=3, tag='held'), files=1)
  cfg = data_cfg(source='jsonl', path=train_path, eval_path=held_path, eval_fraction=0.0)
  held = splits.Split(cfg, tokenizer.BYTES, 'eval', seed=0)
  assert [d.split('>')[0] for d in held.read(held.split_blocks, 0)] == [f'<held {i}' for i in range(6)]
  train = splits.Split(cfg, tokenizer.BYTES, 'train', seed=0)
  assert sum(len(train.read(train.split_blocks, i)) for i in range(len(train.split_blocks))) == 30


def test_hf_datasets_reads_a_split_by_name_and_says_what_is_wrong_in_one_line(tmp_path):
  path = write_saved_dataset(tmp_path / 'saved', documents(20))
  held = records.Reader(data_cfg(source='hf_datasets', path=path, hf_split='test'), tokenizer.BYTES)
  blocks = held.all_blocks()
  assert [d for i in range(len(blocks)) for d in held.read(blocks, i)] == documents(20)[:2]
  for cfg, says in ((data_cfg(source='hf_datasets', path=path, hf_split='validation'),
                     "no split 'validation' (data.hf_split); it has train, test"),
                    (data_cfg(source='hf_datasets', path=path, text_field='body'),
                     "no column 'body' (data.text_field; its columns: text, id)"),
                    (data_cfg(source='hf_datasets', path=str(tmp_path / 'absent')),
                     'matches no files and is no save_to_disk directory')):
    with pytest.raises(DataError, match=re.escape(says)):
      records.Reader(cfg, tokenizer.BYTES).all_blocks()


def read_all(cfg: DataConfig) -> tuple[records.Blocks, list[records.Document]]:
  reader = records.Reader(cfg, tokenizer.BYTES)
  blocks = reader.all_blocks()
  return blocks, [d for i in range(len(blocks)) for d in reader.read(blocks, i)]


@pytest.mark.parametrize('files', ['jsonl', 'parquet'])
def test_hf_streaming_reads_the_documents_of_load_dataset_in_its_order_a_shard_per_block(tmp_path, files):
  docs = documents(50)
  path = write_jsonl(tmp_path, docs) if files == 'jsonl' else write_parquet(tmp_path, docs, row_group=8)
  streamed, streamed_docs = read_all(data_cfg(source='hf_datasets', path=path, hf_streaming=True))
  loaded, loaded_docs = read_all(data_cfg(source='hf_datasets', path=path, block_bytes=1500))
  assert streamed_docs == loaded_docs and sorted(streamed_docs) == sorted(docs)
  assert len(streamed) == (3 if files == 'jsonl' else 8)  # A shard per JSON file, per Parquet row group.


def test_hf_streaming_holds_out_whole_shards_for_eval_in_order_and_one_shard_by_document(tmp_path):
  docs = documents(60)
  cfg = data_cfg(source='hf_datasets', path=write_parquet(tmp_path / 'many', docs, row_group=5),
                 hf_streaming=True, eval_fraction=0.3)
  train, held = (splits.Split(cfg, tokenizer.BYTES, split, seed=0) for split in ('train', 'eval'))
  train_docs, eval_docs = ([d for i in range(len(s.split_blocks)) for d in s.read(s.split_blocks, i)]
                           for s in (train, held))
  assert len(held.split_blocks) and len(train.split_blocks) + len(held.split_blocks) == 12
  assert sorted(train_docs + eval_docs) == sorted(docs) and not set(train_docs) & set(eval_docs)
  steps = sum(len(d) + 1 for d in eval_docs) // 16 + 2
  evaluated = docs_of(stream_text(take(rows_iter(cfg, split='eval', rows=[0], batch=1), steps)))
  assert evaluated[:len(eval_docs)] == eval_docs  # Unshuffled, in load_dataset's order.
  one = data_cfg(source='hf_datasets', path=write_jsonl(tmp_path / 'one', docs, files=1), hf_streaming=True,
                 eval_fraction=0.1)
  train, held = (splits.Split(one, tokenizer.BYTES, split, seed=0) for split in ('train', 'eval'))
  train_docs, eval_docs = (s.read(s.split_blocks, 0) for s in (train, held))
  assert len(train_docs) + len(eval_docs) == 60 and eval_docs and not set(train_docs) & set(eval_docs)


def test_hf_streaming_of_a_hub_name_asks_load_dataset_for_a_stream_of_its_split(tmp_path, monkeypatch):
  import datasets
  local, real, asked = write_jsonl(tmp_path, documents(20)), datasets.load_dataset, []

  def load_dataset(path, name=None, split=None, streaming=False):
    asked.append((path, name, split, streaming))
    return real('json', data_files=sorted(glob.glob(local)), split='train', streaming=True)

  monkeypatch.setattr(datasets, 'load_dataset', load_dataset)  # Offline: a local stream stands for the Hub.
  cfg = data_cfg(source='hf_datasets', path='someone/corpus', hf_config='en', hf_split='validation',
                 hf_streaming=True)
  assert sorted(read_all(cfg)[1]) == sorted(documents(20))
  assert asked == [('someone/corpus', 'en', 'validation', True)]


def test_hf_streaming_says_what_is_wrong_in_one_line(tmp_path):
  (tmp_path / 'empty.jsonl').write_text('')
  (tmp_path / 'blank.jsonl').write_text('\n\n')
  for path, values, says in (
      (write_saved_dataset(tmp_path / 'saved', documents(10)), {},
       'is a save_to_disk directory, read a block at a time from the disk already; data.hf_streaming streams '
       'load_dataset sources (files, Hub names): set it to False.'),
      (write_jsonl(tmp_path / 'docs', documents(4)), {'text_field': 'body'},
       "no column 'body' (data.text_field; its columns: id, text)"),
      (str(tmp_path / 'empty.jsonl'), {}, 'the dataset has no rows (its first file is empty)'),
      (str(tmp_path / 'blank.jsonl'), {}, 'the dataset has no rows.')):
    with pytest.raises(DataError, match=re.escape(says)) as e:
      read_all(data_cfg(source='hf_datasets', path=path, hf_streaming=True, **values))
    assert '\n' not in str(e.value)


def test_hf_streaming_names_a_bad_shard_and_a_bad_row_and_can_skip_them(tmp_path, capsys):
  path = write_jsonl(tmp_path, documents(12))
  with open(tmp_path / 'part1.jsonl', 'a') as f:
    f.write('{"text": "cut\n')
  with open(tmp_path / 'part2.jsonl', 'a') as f:
    f.write('{"text": null, "id": 99}\n')
  cfg = data_cfg(source='hf_datasets', path=path, hf_streaming=True)
  reader = records.Reader(cfg, tokenizer.BYTES)
  blocks = reader.all_blocks()
  with pytest.raises(DataError, match=r"data.path='.*' shard 1: cannot be read \(.*\); fix it or set "):
    reader.read(blocks, 1)
  with pytest.raises(DataError, match=r"shard 2 row 4: column 'text' is null, not a string"):
    reader.read(blocks, 2)
  skipping = records.Reader(dataclasses.replace(cfg, skip_bad_records=True), tokenizer.BYTES)
  with metrics.console_logging(print):
    kept = [d for i in range(3) for d in skipping.read(blocks, i)]
  assert sorted(kept) == sorted(d for i, d in enumerate(documents(12)) if i % 3 != 1)
  assert skipping.bad.count == 2 and 'shard 1: cannot be read' in capsys.readouterr().err
