"""An export replaces its directory whole or not at all, and the loader refuses directories that mix two."""

import json
import shutil

import numpy as np
import pytest
import test_hf
import test_sliding_window
from helpers import run_script
from test_hf import TOKENS, mintrain_logits, on_mesh, random_model

from mintrain import hf
from mintrain.data import tokenizer
from mintrain.errors import ConfigError, StorageError


@pytest.fixture(scope='module')
def llama(tmp_path_factory):
  directory = tmp_path_factory.mktemp('llama')
  random_model('llama3', directory)
  with on_mesh('single'):
    model = hf.from_pretrained(directory)
    return model, mintrain_logits(model, TOKENS)


def listing(directory):
  return sorted(p.name for p in directory.iterdir())


def test_exporting_again_into_the_same_directory_replaces_the_earlier_export_whole(llama, tmp_path):
  model, logits = llama
  out = tmp_path / 'out'
  with on_mesh('single'):
    sharded = hf.save_pretrained(model, out, max_shard_size=100_000)
    assert len(sharded) > 3 and hf.INDEX in listing(out)
    single = hf.save_pretrained(model, out)
    assert listing(out) == sorted(single) == ['config.json', 'model.safetensors']
    assert listing(tmp_path) == ['out']  # Nothing staged or replaced is left beside it.
    np.testing.assert_array_equal(mintrain_logits(hf.from_pretrained(out), TOKENS), logits)


def test_a_failed_export_leaves_the_earlier_one_as_it_was(llama, tmp_path):
  class Broken:
    def save(self, directory):
      raise OSError('disk gone')

  model, _ = llama
  out = tmp_path / 'out'
  with on_mesh('single'):
    hf.save_pretrained(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(OSError, match='disk gone'):
      hf.save_pretrained(model, out, max_shard_size=100_000, tokenizer=Broken())
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  assert listing(tmp_path) == ['out']


def test_a_directory_with_other_files_is_refused_unless_overwritten(llama, tmp_path):
  model, _ = llama
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'notes.txt').write_text('mine')
  with on_mesh('single'):
    with pytest.raises(StorageError, match=r'out holds notes.txt, which no export writes; .* --overwrite'):
      hf.save_pretrained(model, out)
    assert listing(out) == ['notes.txt']
    hf.save_pretrained(model, out, overwrite=True)
  assert listing(out) == ['config.json', 'model.safetensors']


@pytest.mark.parametrize('setup, says', [
    (lambda out: out.write_text('a file'), 'is a file; give a directory'),
    (lambda out: (out.mkdir(), (out / 'train.log').write_text('x')),
     'holds train.log, which no export writes'),
])
def test_the_export_script_refuses_a_bad_out_in_one_line_before_reading_anything(setup, says, tmp_path):
  out = tmp_path / 'out'
  setup(out)
  before = listing(tmp_path)
  proc = run_script('scripts/export_hf.py', '--workdir', str(tmp_path / 'no_run'), '--out', str(out))
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.count('\n') == 1 and says in proc.stderr, proc.stderr
  assert listing(tmp_path) == before


def test_a_directory_that_mixes_two_exports_or_has_a_damaged_index_is_a_one_line_error(llama, tmp_path):
  model, _ = llama
  with on_mesh('single'):
    hf.save_pretrained(model, tmp_path / 'sharded', max_shard_size=100_000)
    hf.save_pretrained(model, tmp_path / 'single')
    mixed = tmp_path / 'mixed'
    shutil.copytree(tmp_path / 'sharded', mixed)
    shutil.copy(tmp_path / 'single' / 'model.safetensors', mixed)
    with pytest.raises(ConfigError, match='index.json that names other files: two exports mixed'):
      hf.from_pretrained(mixed)
    index = tmp_path / 'sharded' / hf.INDEX
    weight_map = json.loads(index.read_text())['weight_map']
    for text, says in (('{"weight_map": ', 'is not a JSON object'), ('[1, 2]', 'is not a JSON object'),
                       ('{"metadata": {}}', 'has no weight_map'),
                       (json.dumps({'weight_map': dict.fromkeys(weight_map, '.')}),
                        "lists '.', which is not a file")):
      index.write_text(text)
      with pytest.raises(ConfigError, match=says) as e:
        hf.from_pretrained(tmp_path / 'sharded')
      assert '\n' not in str(e.value)


# Every family of both parity tables: (name, its random_model). The default suite checks two.
EXPORTED_FAMILIES = {**{f: test_hf.random_model for f in test_hf.FAMILIES},
                     **{f'windowed_{f}': test_sliding_window.random_model
                        for f in test_sliding_window.FAMILIES}}
EXPORT_FAST = ('llama3', 'windowed_gemma3')


@pytest.mark.parametrize('family', [
    pytest.param(f, marks=[] if f in EXPORT_FAST else [pytest.mark.slow]) for f in EXPORTED_FAMILIES])
def test_an_export_carries_the_special_ids_and_generate_stops_at_eos(family, tmp_path):
  """The source's eos_token_id is the token greedy decoding picks first, so `generate` on the export stops
  after one token exactly when the export carried it (config.json and generation_config.json alike)."""
  import torch
  import transformers

  source = EXPORTED_FAMILIES[family](family.removeprefix('windowed_'), tmp_path / 'source', bos_token_id=1,
                                     pad_token_id=0, max_position_embeddings=96)
  prompt = torch.tensor(TOKENS[:1, :6].astype(np.int64))
  with torch.no_grad():
    first = int(source(prompt).logits[0, -1].argmax())
  config = json.loads((tmp_path / 'source' / 'config.json').read_text())
  (tmp_path / 'source' / 'config.json').write_text(json.dumps({**config, 'eos_token_id': first}))
  (tmp_path / 'source' / 'generation_config.json').write_text(json.dumps(
      {'bos_token_id': 1, 'eos_token_id': first, 'pad_token_id': 0}))
  with on_mesh('single'):
    model = hf.from_pretrained(tmp_path / 'source')
    files = hf.save_pretrained(model, tmp_path / 'out', source=tmp_path / 'source')
  assert 'generation_config.json' in files
  exported = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert (exported['bos_token_id'], exported['eos_token_id'], exported['pad_token_id'],
          exported['max_position_embeddings']) == (1, first, 0, 96)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'out', dtype=torch.float32)
  with torch.no_grad():
    generated = loaded.generate(prompt, max_new_tokens=8, do_sample=False)
  assert generated.shape[1] == prompt.shape[1] + 1 and int(generated[0, -1]) == first


def test_an_export_without_a_source_takes_the_tokenizers_ids_and_the_context_length(llama, tmp_path):
  model, _ = llama
  hf.save_pretrained(model, tmp_path / 'out', tokenizer=tokenizer.BYTES, context_length=64)
  config = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert (config['bos_token_id'], config['max_position_embeddings']) == (tokenizer.BYTES.bos_id, 64)
  assert json.loads((tmp_path / 'out' / 'generation_config.json').read_text()) == {
      'bos_token_id': tokenizer.BYTES.bos_id}
