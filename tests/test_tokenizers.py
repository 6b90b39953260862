"""Real tokenizers through `data.tokenizer`: a byte-level BPE (Hugging Face `tokenizers`) and a SentencePiece
model, both trained in conftest.py on the stdlib corpus. Loading, documents, the model's vocabulary, the
Grain pipeline (exact resume, per-process rows), bytes per token, and bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from helpers import TINY, TOKENIZER_VOCAB, load_config, stdlib_texts

from mintrain import config as config_lib
from mintrain.data import pipeline, sources, statistics, tokenizer
from mintrain.data.config import DataConfig
from mintrain.errors import ConfigError, DataError

BASE_DATA = config_lib.validate(config_lib.defaults()).data
UNSEEN = 'naïve café ☕ 日本語 🎉\n\tdef f(x):\n    return x  # ok\n'  # Beside unseen stdlib text.


@pytest.fixture(params=['bpe', 'sentencepiece'])
def spec(request, bpe_tokenizer, sentencepiece_model) -> str:
  """data.tokenizer for a Hugging Face directory (BPE) or a SentencePiece .model file."""
  return str(bpe_tokenizer if request.param == 'bpe' else sentencepiece_model)


def data_cfg(**values) -> DataConfig:
  return dataclasses.replace(BASE_DATA, **values)


def write_texts(root, n: int = 12) -> list[str]:
  """n stdlib files (past the tokenizers' training text) as doc_XX.txt."""
  texts = stdlib_texts(2 << 20)[-n:]
  root.mkdir(parents=True, exist_ok=True)
  for i, text in enumerate(texts):
    (root / f'doc_{i:02d}.txt').write_text(text, encoding='utf-8')
  return texts


def test_text_round_trips_and_saved_files_give_transformers_the_same_ids(spec, tmp_path):
  import transformers

  tok = tokenizer.load(spec)
  text = stdlib_texts(2 << 20)[-1] + UNSEEN
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < tok.vocab_size == TOKENIZER_VOCAB
  assert len(ids) < 0.7 * len(text.encode('utf-8'))  # It merges; not one token per byte.
  assert tok.decode(ids) == text
  assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.vocab_size + 3]])) == text
  names = tok.save(tmp_path / 'saved')
  assert tokenizer.load(str(tmp_path / 'saved')).encode(text).tolist() == ids.tolist()
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / 'saved')
  assert theirs(text, add_special_tokens=False).input_ids == ids.tolist(), names
  assert (theirs.bos_token_id, theirs.eos_token_id) == (tok.bos_id, tok.eos_id)


def test_a_document_is_bos_its_ids_and_eos_in_the_stream_dtype(spec):
  tok = tokenizer.load(spec)
  doc = tok.document('x = 1\n')
  assert doc.dtype == np.uint16
  assert doc.tolist() == [tok.bos_id, *tok.encode('x = 1\n').tolist(), tok.eos_id]
  assert tok.bos_id != tok.eos_id and {tok.bos_id, tok.eos_id} <= set(range(3))


@pytest.mark.parametrize('config, bos, eos', [
    ({'bos_token': '<s>', 'eos_token': '</s>'}, None, 1),  # Qwen2, GPT-2: no BOS prepended, EOS ends.
    ({'bos_token': '<s>', 'eos_token': '</s>', 'add_bos_token': True}, 0, 1),  # Older Llama configs.
    ({'bos_token': '</s>', 'eos_token': '</s>', 'add_bos_token': True}, 1, 1),  # One token for both: once.
    ({}, None, None),
])
def test_hugging_face_bos_and_eos_follow_the_post_processor_and_tokenizer_config(bpe_tokenizer, tmp_path,
                                                                                  config, bos, eos):
  plain = json.loads((bpe_tokenizer / 'tokenizer.json').read_text())
  plain['post_processor'] = None  # No template: tokenizer_config.json alone says.
  (tmp_path / 'tokenizer.json').write_text(json.dumps(plain))
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
  tok = tokenizer.load(str(tmp_path))
  assert (tok.bos_id, tok.eos_id) == (bos, eos)
  ids = tok.encode('x = 1').tolist()
  expected = ([bos] if bos is not None else []) + ids + ([eos] if eos not in (None, bos) else [])
  assert tok.document('x = 1').tolist() == expected
  if not config:  # Documents would run into each other.
    (tmp_path / 'corpus.txt').write_text('x = 1\n')
    cfg = data_cfg(source='text', path=str(tmp_path / '*.txt'), tokenizer=str(tmp_path), eval_fraction=1e-9)
    with pytest.raises(DataError, match='has neither a BOS nor an EOS token to separate documents; name one'):
      sources.load_split(cfg, tokenizer.load(cfg.tokenizer), 'train')


def test_model_vocab_size_0_follows_the_tokenizer_and_a_set_one_stays(spec):
  assert load_config('dp4_tp2', f'data.tokenizer={spec}').model.vocab_size == TOKENIZER_VOCAB
  assert load_config('tp8', f'data.tokenizer={spec}', 'model.vocab_size=1024').model.vocab_size == 1024


def test_a_hugging_face_directory_brings_its_tokenizer_unless_told_otherwise(bpe_tokenizer, tmp_path):
  import transformers

  hf_dir = tmp_path / 'hf'
  transformers.LlamaConfig(vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=1, num_attention_heads=8).save_pretrained(hf_dir)
  with pytest.raises(ConfigError, match=rf"^init.hf_checkpoint='{hf_dir}' holds neither tokenizer.json nor "
                                        r'tokenizer.model: pass data.tokenizer=byte to train on bytes, or '
                                        r'add the tokenizer files to the directory.$'):
    load_config('single', f'init.hf_checkpoint={hf_dir}')  # It has none: bytes only when asked for.
  assert load_config('single', f'init.hf_checkpoint={hf_dir}', 'data.tokenizer=byte').data.tokenizer == 'byte'
  for name in tokenizer.HF_FILES[:2]:
    (hf_dir / name).write_bytes((bpe_tokenizer / name).read_bytes())
  assert load_config('single', f'init.hf_checkpoint={hf_dir}').data.tokenizer == str(hf_dir)
  assert load_config('single', f'init.hf_checkpoint={hf_dir}', 'data.tokenizer=byte').data.tokenizer == 'byte'


def test_the_console_line_names_the_tokenizer_and_where_it_comes_from(bpe_tokenizer, sentencepiece_model):
  def line(*overrides):
    config = load_config('single', *overrides)
    return tokenizer.describe(tokenizer.load(config.data.tokenizer), config.data.tokenizer,
                              config.init.hf_checkpoint)

  assert line() == 'tokenizer: byte-level, 257 ids, from data.tokenizer=byte'
  assert line(f'data.tokenizer={sentencepiece_model}') == (
      f'tokenizer: SentencePiece model, {TOKENIZER_VOCAB} ids, from data.tokenizer={sentencepiece_model}')
  assert line(f'data.tokenizer={bpe_tokenizer}').startswith('tokenizer: Hugging Face tokenizer.json, ')


def test_text_sources_are_their_split_documents_tokenized_in_order(spec, tmp_path):
  texts = write_texts(tmp_path / 'corpus')
  tok = tokenizer.load(spec)
  cfg = data_cfg(source='text', path=str(tmp_path / 'corpus' / '*.txt'), tokenizer=spec, eval_fraction=0.3)
  for split in ('train', 'eval'):
    mine = [t for i, t in enumerate(texts) if sources.in_eval(f'doc_{i:02d}.txt', 0.3) == (split == 'eval')]
    [stream] = sources.load_split(cfg, tok, split)
    assert stream.tolist() == np.concatenate([tok.document(t) for t in mine]).tolist()
    measured = sum(len(t.encode('utf-8')) for t in mine) / len(stream)
    assert statistics.bytes_per_token(cfg, tok, split=split) == pytest.approx(measured) and 1.5 < measured < 4


def test_token_files_measure_bytes_per_token_by_decoding(spec, tmp_path):
  tok = tokenizer.load(spec)
  ids = np.concatenate([tok.document(t) for t in stdlib_texts(2 << 20)[-4:]])
  ids.astype(np.uint16).tofile(tmp_path / 'ids.bin')
  cfg = data_cfg(source='tokens', path=str(tmp_path / '*.bin'), tokenizer=spec, eval_fraction=0.5)
  tail = ids[len(ids) - int(len(ids) * 0.5):]
  decoded = len(tok.decode(tail).encode('utf-8'))
  assert statistics.bytes_per_token(cfg, tok) == pytest.approx(decoded / len(tail))


def test_batches_resume_exactly_and_two_processes_read_the_single_process_batch(bpe_tokenizer, tmp_path):
  write_texts(tmp_path / 'corpus')
  cfg = data_cfg(source='text', path=str(tmp_path / 'corpus' / '*.txt'), tokenizer=str(bpe_tokenizer))

  def iterator(rows):
    return pipeline.make_iterator(cfg, tokenizer.load(cfg.tokenizer), split='train', seq_len=16,
                                  global_batch_size=8, micro_batch_size=8, rows=np.asarray(rows), seed=3,
                                  vocab_size=TOKENIZER_VOCAB)

  whole = iterator(range(8))
  first = [next(whole) for _ in range(3)]
  state = whole.get_state()
  later = [next(whole)['inputs'] for _ in range(2)]
  resumed = iterator(range(8))
  resumed.set_state(json.loads(json.dumps(state)))
  assert all(np.array_equal(a, next(resumed)['inputs']) for a in later)
  halves = [iterator(range(4)), iterator(range(4, 8))]
  for batch in first:
    assert np.array_equal(np.concatenate([next(h)['inputs'] for h in halves]), batch['inputs'])
  assert max(b['inputs'].max() for b in first) < TOKENIZER_VOCAB


def test_a_tokenizer_with_more_ids_than_the_model_names_both(bpe_tokenizer, tmp_path):
  write_texts(tmp_path / 'corpus', n=3)
  cfg = data_cfg(source='text', path=str(tmp_path / 'corpus' / '*.txt'), tokenizer=str(bpe_tokenizer),
                 eval_fraction=0.01)
  with pytest.raises(DataError, match=r"has 512 ids, more than the model's vocabulary \(384\); set "
                                      r'model.vocab_size=0 \(from the tokenizer\) or at least 512'):
    sources.load_split(cfg, tokenizer.load(cfg.tokenizer), 'train', vocab_size=384)


def test_eval_bits_per_byte_divide_bits_per_token_by_the_measured_bytes_per_token(bpe_tokenizer, tmp_path):
  import jax
  from helpers import build

  from mintrain import actions

  write_texts(tmp_path / 'corpus')
  config = load_config('single', 'data.source=text', f'data.path={tmp_path / "corpus" / "*.txt"}',
                       f'data.tokenizer={bpe_tokenizer}', 'data.eval_fraction=0.3', 'eval.steps=1',
                       *TINY)
  run = build(config)
  bytes_per_token = statistics.bytes_per_token(config.data, tokenizer.load(config.data.tokenizer))
  with jax.set_mesh(run.mesh):
    batches = run.batches(tokenizer.load(config.data.tokenizer), 'eval')
    metrics = actions.evaluate(run, run.init().params, batches, batches.get_state(), bytes_per_token)
  assert metrics['eval_bits_per_token'] == pytest.approx(metrics['eval_loss'] / math.log(2))
  assert metrics['eval_bits_per_byte'] == pytest.approx(metrics['eval_bits_per_token'] / bytes_per_token)
  assert 1.5 < bytes_per_token < 4


@pytest.mark.parametrize('make, says', [
    (lambda tmp: tmp / 'nope.json', r"data.tokenizer='.*nope.json' does not exist; give 'byte', a Hugging"),
    (lambda tmp: tmp, r"data.tokenizer='.*': the directory holds neither tokenizer.json nor tokenizer.model"),
    (lambda tmp: (tmp / 'vocab.txt', (tmp / 'vocab.txt').write_text('a\n'))[0],
     r"data.tokenizer='.*vocab.txt' is not a tokenizer; give 'byte'"),
    (lambda tmp: (tmp / 't.json', (tmp / 't.json').write_text('{"model": 3}'))[0],
     r'data.tokenizer=.* is not a Hugging Face tokenizer.json \(.+\)\.$'),
    (lambda tmp: (tmp / 't.model', (tmp / 't.model').write_bytes(b'\x01\x02garbage'))[0],
     r'data.tokenizer=.* is not a SentencePiece model \(.+\)\.$'),
])
def test_a_path_that_is_not_a_tokenizer_is_a_one_line_config_error(tmp_path, make, says):
  path = str(make(tmp_path))
  with pytest.raises(ConfigError, match=says) as raised:
    load_config('single', f'data.tokenizer={path}')
  assert '\n' not in str(raised.value)


def test_the_data_layer_reads_with_the_tokenizer_it_is_given_and_loads_none_itself(spec, tmp_path,
                                                                                     monkeypatch):
  write_texts(tmp_path / 'corpus', n=6)
  cfg = data_cfg(source='text', path=str(tmp_path / 'corpus' / '*.txt'), tokenizer=spec, eval_fraction=0.3)
  tok = tokenizer.load(spec)
  monkeypatch.setattr(tokenizer, 'load', lambda spec: pytest.fail(f'the data layer loaded {spec!r}'))
  batch = next(pipeline.make_iterator(cfg, tok, split='train', seq_len=16, global_batch_size=2,
                                      micro_batch_size=2, rows=np.arange(2), seed=0))
  assert batch['inputs'].max() < tok.vocab_size
  assert statistics.bytes_per_token(cfg, tok) > 1 and statistics.unigram_bits_per_token(cfg, tok) > 1
