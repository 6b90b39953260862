"""The config is parsed once: typed, frozen sections, every option checked against its meaning."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from helpers import SMALL, load_config, run_script

from mintrain import config as config_lib
from mintrain import configs
from mintrain.errors import ConfigError


@pytest.mark.parametrize('override, message', [
    ('optimizer.learning_rate=-1', r'optimizer.learning_rate=-1.0 must be > 0'),
    ('optimizer.b2=1.0', r'optimizer.b2=1.0 must be in \[0, 1\)'),
    ('optimizer.warmup_steps=-3', r'optimizer.warmup_steps=-3 must be an integer >= 0'),
    ('mesh.data=0', r'mesh.data=0: must be a positive integer, or -1 for all remaining devices'),
    ('train.steps=0', r'train.steps=0 must be an integer >= 1'),
    ('train.grad_accum_steps=3', r'train.global_batch_size=32 is not divisible by train.grad_accum_steps=3'),
    ('data.source=csv', r"data.source='csv'; choose one of \('stdlib', 'text', 'tokens', 'synthetic', "
     r"'jsonl', 'parquet', 'arrayrecord', 'hf_datasets', 'mixture'\)"),
    ('data.eval_fraction=1.0', r'data.eval_fraction=1.0 must be in \[0, 1\)'),
    ('data.device_prefetch=-1', r'data.device_prefetch=-1 must be an integer >= 0'),
    ('eval.steps=-1', r'eval.steps=-1 must be an integer >= 0'),
    ('checkpoint.keep=-1', r'checkpoint.keep=-1 must be an integer >= 0'),
    ('metrics.peak_tflops=-2.0', r'metrics.peak_tflops=-2.0 must be >= 0'),
    ('profile.num_steps=0', r'profile.num_steps=0 must be an integer >= 1'),
    ('model.dropout_rate=1.0', r'model.dropout_rate=1.0 must be in \[0, 1\)'),
    ('model.head_dim=15', r'model.head_dim=15: must be even for rotary embeddings'),
    ('model.param_dtype=float16', r"model.param_dtype='float16'; choose one of \('float32', 'bfloat16'\)"),
    ('model.linear=fast', r"model.linear='fast'; choose one of \('auto', 'custom_vjp', 'einsum'\)"),
    ("partitioning.rules=[('batch', 3)]", r"partitioning.rules: Bad partitioning rule \('batch', 3\)"),
    ('seed=-1', r'config.seed=-1 must be an integer >= 0'),
])
def test_a_value_outside_its_meaning_is_an_error_naming_key_value_and_what_is_allowed(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config('dp4_tp2', override)


def test_two_minus_ones_in_the_mesh_are_an_error():
  with pytest.raises(ConfigError, match='mesh sizes may have one -1'):
    load_config('dp4_tp2', 'mesh.data=-1', 'mesh.model=-1')


def test_a_key_the_sections_do_not_have_is_an_error_with_close_matches():
  config = config_lib.load(configs.DIR / 'dp4_tp2.py')
  with config.unlocked():
    config.train.stesp = 3
  with pytest.raises(ConfigError, match=r'Unknown config key train.stesp. Did you mean steps\?'):
    config_lib.validate(config)


def test_sections_are_frozen_and_round_trip_through_their_saved_form():
  config = load_config('fsdp4_tp2')
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.train.steps = 5
  assert config_lib.validate(config.to_dict()) == config
  assert config_lib.validate(config_lib.upgrade(config.to_dict())) == config


def test_a_config_saved_before_an_option_existed_is_upgraded_with_its_default():
  saved = load_config('dp4_tp2').to_dict()
  for section, key in (('model', 'loss_chunks'), ('model', 'linear'), ('data', 'device_prefetch'),
                       ('data', 'packing')):
    del saved[section][key]
  saved['train']['steps'] = 77
  with pytest.raises(ConfigError,
                     match=r'Config key \w+\.\w+ is missing; mintrain/configs/base.py has its default'):
    config_lib.validate(saved)
  upgraded = config_lib.validate(config_lib.upgrade(saved))
  assert (upgraded.model.loss_chunks, upgraded.model.linear, upgraded.data.device_prefetch) == (-1, 'auto', 1)
  assert upgraded.data.packing == 'pack'
  assert upgraded.train.steps == 77


def test_an_upgraded_model_of_another_family_keeps_its_own_section():
  saved = load_config('mlp_dp4_tp2').to_dict()
  upgraded = config_lib.validate(config_lib.upgrade(saved))
  assert upgraded.model_name == 'mlp' and upgraded.model == load_config('mlp_dp4_tp2').model


def test_a_config_file_anywhere_loads_by_path_with_its_neighbours_and_no_sys_path_change(tmp_path):
  (tmp_path / 'mine').mkdir()
  (tmp_path / 'mine' / 'common.py').write_text(
      'import ml_collections\n\ndef get_config():\n  return ml_collections.ConfigDict({"a": 1, "b": 2})\n')
  (tmp_path / 'mine' / 'child.py').write_text(
      'from . import common\n\ndef get_config():\n  c = common.get_config()\n  c.b = 5\n  return c\n')
  before = list(sys.path)
  config = config_lib.load(tmp_path / 'mine' / 'child.py', ['a=3'])
  assert (config.a, config.b) == (3, 5)
  assert sys.path == before


@pytest.mark.parametrize('text, message', [
    ('import ml_collections\n\ndef get_config(:\n', r'bad.py:3: SyntaxError: invalid syntax\.$'),
    ('def get_config():\n  if True:\n  return 1\n', r'bad.py:3: IndentationError: expected an indented'),
    ('x = 1\nraise RuntimeError("boom\\nline 2")\n', r'does not load: RuntimeError: boom \(\S*bad.py:2\)\.$'),
    ('def get_config():\n  return {}["x"]\n', r"get_config\(\) raised KeyError: 'x' \(\S*bad.py:2\)\.$"),
    ('import sys\nsys.exit(3)\n', r'does not load: SystemExit: 3 \(\S*bad.py:2\)'),
    ('x = 1\n', r'has no get_config\(\) function; define one that returns an ml_collections.ConfigDict'),
    ('get_config = 3\n', r'has no get_config\(\) function'),
    ('def get_config():\n  return {"a": 1}\n', r'get_config\(\) returned a dict, not a ConfigDict'),
])
def test_a_config_file_that_does_not_load_is_a_one_line_error_naming_file_and_line(tmp_path, text, message):
  (tmp_path / 'bad.py').write_text(text)
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.load(tmp_path / 'bad.py')
  assert '\n' not in str(e.value) and str(tmp_path / 'bad.py') in str(e.value)


def test_an_error_in_a_neighbour_the_config_imports_names_the_neighbour(tmp_path):
  (tmp_path / 'common.py').write_text('def get_config():\n  return 1 / 0\n')
  (tmp_path / 'child.py').write_text(
      'from . import common\n\ndef get_config():\n  return common.get_config()\n')
  with pytest.raises(ConfigError, match=rf'child.py: get_config\(\) raised ZeroDivisionError: division by '
                     rf'zero \({tmp_path / "common.py"}:2\)'):
    config_lib.load(tmp_path / 'child.py')


@pytest.mark.parametrize('name, message', [
    ('nope.py', r'nope.py does not exist; see mintrain/configs/'),
    ('.', r'is a directory; give a file'),
    ('base.yaml', r'base.yaml is not a Python file \(.py\)'),
])
def test_a_config_path_that_is_no_config_file_is_a_one_line_error(tmp_path, name, message):
  (tmp_path / 'base.yaml').write_text('train: {steps: 3}\n')
  with pytest.raises(ConfigError, match=message):
    config_lib.load(tmp_path / name)


@pytest.mark.parametrize('override, message', [
    ('train.steps', r"Override 'train.steps' must look like key.path=value"),
    ('=3', r"Override '=3' must look like key.path=value"),
    ('no.such.key=1', r"Unknown config key 'no.such.key': no 'no' under the top level. Keys there: check"),
    ('train.stesp=1', r"Unknown config key 'train.stesp': no 'stesp' under train. Did you mean steps\?"),
    ('train.steps.x=1', r"Unknown config key 'train.steps.x': no 'x' under train.steps"),
    ('train.steps=abc', r"train.steps expects an integer, got 'abc' \(the value it overrides is 300\)"),
    ('train.steps=1.5', r"train.steps expects an integer, got '1.5'"),
    ('train.steps=', r"train.steps expects an integer, got ''"),
    ('train.steps=True', r"train.steps expects an integer, got 'True'"),
    ('optimizer.learning_rate=fast', r"optimizer.learning_rate expects a number, got 'fast' \(the value it"),
    ('model.tie_embeddings=1', r"model.tie_embeddings expects True or False, got '1'"),
    ('model.tie_embeddings=true', r"model.tie_embeddings expects True or False, got 'true'"),
    ('partitioning.rules=batch', r"partitioning.rules expects a list, got 'batch'"),
    ('partitioning.rules={[1]: 2}', r"partitioning.rules expects a list, got '\{\[1\]: 2\}'"),
    ('train=3', r'train is a section, not a value; override its keys \(train\.\w+=...\)'),
])
def test_a_malformed_override_is_a_one_line_error(override, message):
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.load(configs.DIR / 'base.py', [override])
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('override, value', [
    ('optimizer.learning_rate=1', 1.0),
    ('train.steps=1_000', 1000),
    ("partitioning.param_rules=(('embed', None),)", [('embed', None)]),  # The type of the value it replaces.
    ('data.path=data/*.txt', 'data/*.txt'),
    ('model.tie_embeddings=False', False),
])
def test_an_override_is_parsed_as_the_type_of_the_value_it_replaces(override, value):
  section, leaf = override.split('=')[0].split('.')
  parsed = config_lib.load(configs.DIR / 'base.py', [override])[section][leaf]
  assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize('override, message', [
    ('optimizer.learning_rate=1e999', r'optimizer.learning_rate=inf must be a finite number'),
    ('model.rope_base=-1e999', r'model.rope_base=-inf must be a finite number'),
])
def test_a_number_that_is_not_finite_is_an_error(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config('dp4_tp2', override)


@pytest.mark.parametrize('section', ['train', 'model'])
def test_a_section_that_a_config_file_replaced_by_a_value_is_an_error(section):
  values = {**load_config('dp4_tp2').to_dict(), section: 5}
  with pytest.raises(ConfigError, match=rf'{section} must be a section of keys \(a ConfigDict\), not 5'):
    config_lib.validate(values)


def test_train_py_rejects_a_bad_value_before_touching_any_device():
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py',
                    '--config.optimizer.learning_rate=-1', timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip() == 'error: optimizer.learning_rate=-1.0 must be > 0.'
  assert 'simulating' not in proc.stdout + proc.stderr and 'Traceback' not in proc.stderr


def test_differences_name_each_changed_key_with_both_values():
  saved = load_config('dp4_tp2').to_dict()
  changed = load_config('dp4_tp2', 'optimizer.learning_rate=0.1', 'train.steps=900').to_dict()
  assert config_lib.differences(saved, changed) == ['optimizer.learning_rate 0.003 -> 0.1',
                                                    'train.steps 300 -> 900']
  assert config_lib.differences(saved, load_config('dp4_tp2').to_dict()) == []


def test_a_resume_with_a_changed_config_lists_the_changes_before_training(tmp_path):
  from helpers import mesh_devices

  from mintrain import loop as train_loop
  small = (*SMALL, 'model.embed_dim=32', 'model.mlp_dim=64', 'data.source=synthetic', 'eval.every_steps=0')
  first = load_config('single', *small, 'train.steps=2')
  train_loop.run(first, tmp_path, devices=mesh_devices(first), print_fn=lambda _: None)
  second = load_config('single', *small, 'train.steps=3', 'optimizer.learning_rate=0.1')
  lines = []
  train_loop.run(second, tmp_path, devices=mesh_devices(second), print_fn=lines.append)
  resumed = next(i for i, line in enumerate(lines) if line.startswith('Resuming from step 2'))
  assert lines[resumed + 1] == ("The config differs from the checkpoint's: optimizer.learning_rate 0.003 -> "
                                "0.1, train.steps 2 -> 3.")
  assert any(line.startswith('compiled') for line in lines[resumed + 1:])


def test_a_shipped_config_loads_by_name_from_anywhere(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # Where no mintrain/configs/ is: as after a pip install.
  by_name = config_lib.load('dp4_tp2', ['train.steps=3'])
  assert by_name.to_dict() == config_lib.load(configs.path('dp4_tp2'), ['train.steps=3']).to_dict()
  with pytest.raises(ConfigError, match='does not exist'):
    config_lib.load('no_such_config')
