"""An export replaces its directory whole or not at all, and the loader refuses directories that mix two."""

import json
import shutil

import numpy as np
import pytest
from helpers import run_script
from test_hf import TOKENS, mintrain_logits, on_mesh, random_model

from mintrain import hf
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
