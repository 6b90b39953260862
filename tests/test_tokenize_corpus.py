"""scripts/tokenize_corpus.py: a corpus pre-tokenized in parallel reads back as the same documents."""

from __future__ import annotations

import dataclasses
import gzip
import json

import numpy as np
from helpers import run_script
from test_streaming import data_cfg, documents, rows_iter, take, write_jsonl

from mintrain.data import records, tokenizer


def test_arrayrecord_output_holds_each_document_as_bos_and_its_ids_and_trains(tmp_path):
  docs = documents(90)
  path = write_jsonl(tmp_path / 'in', docs, files=3, gz=True)
  proc = run_script('scripts/tokenize_corpus.py', '--config.data.source=jsonl', f'--config.data.path={path}',
                    '--out', str(tmp_path / 'out'), '--workers', '2', timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert '3/3 files, 90 documents' in proc.stderr and '#' * 30 in proc.stderr  # The progress bar's end.
  assert 'data.source=arrayrecord --config.data.record_format=tokens' in proc.stdout
  tokens = data_cfg(source='arrayrecord', record_format='tokens',
                    path=str(tmp_path / 'out' / '*.arrayrecord'))
  reader = records.Reader(tokens, tokenizer.load(tokens.tokenizer))
  blocks = reader.all_blocks()
  read = [d for i in range(len(blocks)) for d in reader.read(blocks, i)]
  assert sorted(tuple(ids) for ids in read) == sorted(tuple(tokenizer.BYTES.document(d)) for d in docs)
  # Training reads the same documents from either: each once in the first epoch of a 1-row stream.
  steps = sum(len(d) + 1 for d in docs) // 16 + 2
  whole = dict(eval_fraction=0.0, shuffle_window=1)
  for cfg in (dataclasses.replace(tokens, **whole), data_cfg(source='jsonl', path=path, **whole)):
    text = ''.join(chr(i) if i < 256 else '\0' for b in take(rows_iter(cfg, rows=[0], batch=1), steps)
                   for i in b['inputs'][0])
    assert sorted(text.split('\0')[1:len(docs) + 1]) == sorted(docs)


def test_flat_token_output_is_the_documents_end_to_end(tmp_path):
  docs = documents(20)
  path = write_jsonl(tmp_path / 'in', docs, files=1)
  proc = run_script('scripts/tokenize_corpus.py', '--config.data.source=jsonl', f'--config.data.path={path}',
                    '--out', str(tmp_path / 'out'), '--format', 'tokens', '--workers', '1', timeout=120)
  assert proc.returncode == 0, proc.stderr
  flat = np.fromfile(tmp_path / 'out' / 'part0.bin', np.uint16)
  assert np.array_equal(flat, np.concatenate([tokenizer.BYTES.document(d) for d in docs]))


def test_a_bad_line_is_one_line_exit_2_and_leaves_no_partial_file(tmp_path):
  (tmp_path / 'in').mkdir()
  with gzip.open(tmp_path / 'in' / 'a.jsonl.gz', 'wt') as f:
    f.write(json.dumps({'text': 'fine'}) + '\n{"text": broken\n')
  proc = run_script('scripts/tokenize_corpus.py', '--config.data.source=jsonl',
                    f'--config.data.path={tmp_path}/in/*.jsonl.gz', '--out', str(tmp_path / 'out'),
                    timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr
  assert lines[-1].startswith('error: ') and f'{tmp_path}/in/a.jsonl.gz:2: not valid JSON' in lines[-1]
  assert not list((tmp_path / 'out').rglob('*'))
