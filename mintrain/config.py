"""The run's config: ml_collections files and `key.path=value` overrides, parsed once into frozen sections.

`load` reads a config file by path; `validate` turns the ConfigDict into a `Config` whose sections
are frozen dataclasses, every option checked against its meaning before any device is touched. Each
section is defined by the module that owns it (`SECTIONS`), which receives only that section. Defaults
live in `mintrain/configs/base.py` alone; a config saved by an older mintrain goes through `upgrade`,
which fills the keys added since from there.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import importlib.util
import pathlib
import sys
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from mintrain import configs, fields, models, objectives
from mintrain import mesh as mesh_lib
from mintrain.actions import EvalConfig, ProfileConfig
from mintrain.checkpoint.checkpoints import CheckpointConfig
from mintrain.data import tokenizer
from mintrain.data.config import DataConfig
from mintrain.errors import ConfigError
from mintrain.fields import option
from mintrain.lora import LoraConfig
from mintrain.mesh import MeshConfig
from mintrain.metrics import MetricsConfig
from mintrain.models.pipeline import PipelineConfig
from mintrain.objectives.dpo import DPOConfig
from mintrain.objectives.grpo import GRPOConfig
from mintrain.optimizer import OptimizerConfig
from mintrain.partitioning import PartitioningConfig
from mintrain.train_step import TrainConfig

BASE = configs.path('base')


@dataclasses.dataclass(frozen=True)
class InitConfig:
  hf_checkpoint: str = option()  # '' or a Hugging Face model directory.
  hf_strict: bool = option()  # A checkpoint tensor the model does not use is an error (else a warning).
  lora_adapter: str = option()  # '' or a PEFT LoRA adapter directory: the adapters' initial values.


SECTIONS = {'mesh': MeshConfig, 'partitioning': PartitioningConfig, 'pipeline': PipelineConfig,
            'data': DataConfig, 'eval': EvalConfig,
            'train': TrainConfig, 'metrics': MetricsConfig, 'profile': ProfileConfig,
            'checkpoint': CheckpointConfig, 'optimizer': OptimizerConfig, 'init': InitConfig,
            'lora': LoraConfig, 'dpo': DPOConfig, 'grpo': GRPOConfig}


@dataclasses.dataclass(frozen=True)
class Config:
  """A validated run config; `model` is the typed config of the family `model_name`."""

  seed: int
  model_name: str
  model: Any
  mesh: MeshConfig
  partitioning: PartitioningConfig
  pipeline: PipelineConfig
  data: DataConfig
  train: TrainConfig
  optimizer: OptimizerConfig
  eval: EvalConfig
  checkpoint: CheckpointConfig
  metrics: MetricsConfig
  profile: ProfileConfig
  init: InitConfig
  lora: LoraConfig
  dpo: DPOConfig
  grpo: GRPOConfig

  @property
  def family(self) -> models.Family:
    return models.family(self.model_name)

  @property
  def objective(self) -> objectives.Objective:
    return objectives.OBJECTIVES[self.train.objective]

  def to_dict(self) -> dict[str, Any]:
    """The options as plain values: what a checkpoint saves and `validate` reads back."""
    out = {'seed': self.seed, 'model': {'name': self.model_name, **fields.to_dict(self.model)}}
    out.update({name: fields.to_dict(getattr(self, name)) for name in SECTIONS})
    return out

  def replace(self, **sections: Any) -> Config:
    return dataclasses.replace(self, **sections)


def validate(config: ml_collections.ConfigDict | Mapping[str, Any]) -> Config:
  """The typed config; a ConfigError names the first key whose value cannot work, and what can.

  Reads no files: what init.hf_checkpoint and data.tokenizer name is read by `resolve`.
  """
  values = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
  expected = {'seed', 'model', *SECTIONS}
  for key in values:
    if key not in expected:
      raise ConfigError(f'Unknown config key {key!r} at the top level; keys there: '
                        f'{", ".join(sorted(expected))}.')
  for key in expected - set(values):
    raise ConfigError(f'Config key {key!r} is missing; mintrain/configs/base.py has its default.')
  seed = fields.build(_Seed, {'seed': values['seed']}, 'config').seed
  if not isinstance(values['model'], Mapping):
    raise ConfigError(f"model must be a section of keys (a ConfigDict), not {values['model']!r}.")
  model = dict(values['model'])
  sections = {key: fields.build(cls, values[key], key) for key, cls in SECTIONS.items()}
  name = model.pop('name', None)
  family = models.family(name)
  sections['lora'].check(family.lora_targets, name)
  config = Config(seed=seed, model_name=name, model=fields.build(family.config, model, 'model'), **sections)
  config.objective.check(config)
  return config


def resolve(config: Config) -> tuple[Config, tokenizer.Tokenizer]:
  """The config the run uses and its tokenizer, each input read once: init.hf_checkpoint's config.json
  sets the model (its other options stay), data.tokenizer is loaded (its ids give model.vocab_size=0;
  for chat data it must have a chat template), and the model is checked against the train section."""
  hf_checkpoint, name, model = config.init.hf_checkpoint, config.model_name, config.model
  if hf_checkpoint:
    options = models.hf_model_options(hf_checkpoint)
    name = options.pop('name')
    model = fields.build(models.family(name).config, {**fields.to_dict(model), **options}, 'model')
  spec = tokenizer.resolve(config.data.tokenizer, hf_checkpoint)
  tok = tokenizer.load(spec)
  if config.data.chat:
    from mintrain.data import chat  # jinja2 only for chat data.
    chat.run_template(tok, config.data.chat_template)
  model = model.for_tokenizer(lambda: tok.vocab_size)
  model.check(config.train.seq_len)
  config.lora.check(models.family(name).lora_targets, name)
  data = dataclasses.replace(config.data, tokenizer=spec)
  return config.replace(model_name=name, model=model, data=data), tok


@dataclasses.dataclass(frozen=True)
class _Seed:
  seed: int = option(at_least=0)


def defaults() -> ml_collections.ConfigDict:
  """mintrain/configs/base.py: every default, in one place."""
  return load(BASE)


def one_device_mesh() -> ml_collections.ConfigDict:
  """The `mesh` section of a single-device run: every axis of size 1, within one slice."""
  mesh = defaults().mesh
  mesh.update(dict.fromkeys(mesh_lib.AXES, 1))
  return mesh


def upgrade(saved: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A config saved by any mintrain version (a checkpoint's), with the keys added since then filled in
  from mintrain/configs/base.py. A model of another family than base's keeps its own section whole."""
  merged = defaults().to_dict()
  for key, value in saved.items():
    if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping) and not (
        key == 'model' and value.get('name') != merged['model']['name']):
      merged[key] = {**merged[key], **value}
    else:
      merged[key] = value
  return ml_collections.ConfigDict(merged)


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """`key old -> new` for every option whose value differs between two configs' dicts (a checkpoint's,
  upgraded first, and the run's), in key order: what a resume changes."""
  old, new = _flat(upgrade(saved).to_dict()), _flat(dict(current))
  keys = sorted(k for k in old.keys() | new.keys() if _comparable(old.get(k)) != _comparable(new.get(k)))
  return [f'{key} {old.get(key, "(absent)")!r} -> {new.get(key, "(absent)")!r}' for key in keys]


def _flat(tree: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(_flat(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def _comparable(value: Any) -> Any:
  """Tuples and lists alike (JSON gives lists back), recursively."""
  return [_comparable(v) for v in value] if isinstance(value, (list, tuple)) else value


def load(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """A config file's (or a shipped config's, by name) `get_config()` with `key.path=value` overrides.

  The file is loaded by path as a module of its folder's package, so it can import its neighbours
  (`from . import base`) wherever it lives; nothing is added to `sys.path`. A file that does not load is
  a one-line ConfigError naming the file and line (`mintrain/configs/x.py:3: SyntaxError: ...`).
  """
  path = pathlib.Path(path).expanduser()
  if not path.exists() and path.parent == pathlib.Path() and configs.path(path.stem).is_file():
    path = configs.path(path.stem)  # A shipped one by name (`--config dp4_tp2`), as after pip install.
  if path.is_dir():
    raise ConfigError(f'Config file {path} is a directory; give a file such as mintrain/configs/dp4_tp2.py.')
  if not path.is_file():
    raise ConfigError(f'Config file {path} does not exist; see mintrain/configs/ for the available ones.')
  if path.suffix != '.py':
    raise ConfigError(f'Config file {path} is not a Python file (.py) with a get_config() function.')
  try:
    module = _load_module(path.resolve())
  except ConfigError:
    raise
  except SyntaxError as e:
    raise ConfigError(f'Config file {_shown(e.filename, path)}:{e.lineno}: {type(e).__name__}: '
                      f'{e.msg}.') from None
  except (Exception, SystemExit) as e:
    raise ConfigError(f'Config file {path} does not load: {_raised(e, path)}') from None
  get_config = getattr(module, 'get_config', None)
  if not callable(get_config):
    raise ConfigError(f'Config file {path} has no get_config() function; define one that returns an '
                      'ml_collections.ConfigDict.')
  try:
    config = get_config()
  except ConfigError:
    raise
  except (Exception, SystemExit) as e:
    raise ConfigError(f'Config file {path}: get_config() raised {_raised(e, path)}') from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'Config file {path}: get_config() returned a {type(config).__name__}, '
                      'not a ConfigDict.')
  apply_overrides(config, overrides)
  return config


def _shown(filename: str | None, path: pathlib.Path) -> str:
  """A file of the traceback as the user named it, if it is the config file itself."""
  if not filename or pathlib.Path(filename) == path.resolve():
    return str(path)
  return filename


def _raised(e: BaseException, path: pathlib.Path) -> str:
  """`Type: first line of the message (file:line)`, at the deepest frame in the config's folder."""
  message = str(e).strip().splitlines()
  text = f'{type(e).__name__}: {message[0][:200]}' if message else type(e).__name__
  folder = path.resolve().parent
  frames = [f for f in traceback.extract_tb(e.__traceback__) if pathlib.Path(f.filename).parent == folder]
  if frames:
    text += f' ({_shown(frames[-1].filename, path)}:{frames[-1].lineno})'
  return text + '.'


def _load_module(path: pathlib.Path) -> types.ModuleType:
  """`path` as module `<package>.<stem>`, its package the folder it is in (registered once, by folder)."""
  folder = path.parent
  package = f'_mintrain_configs_{hashlib.sha1(str(folder).encode()).hexdigest()[:12]}'
  if package not in sys.modules:
    spec = importlib.util.spec_from_loader(package, loader=None, is_package=True)
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(folder)]
    sys.modules[package] = module
  name = f'{package}.{path.stem}'
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # So the file's own relative imports of it find it.
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  return module


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
  """Sets each `key.path=value` override."""
  for item in overrides:
    key, sep, value = item.partition('=')
    if not sep or not key:
      raise ConfigError(f'Override {item!r} must look like key.path=value (e.g. train.steps=100).')
    set_value(config, key, value)


def set_value(config: ml_collections.ConfigDict, key: str, value: str) -> None:
  """Sets `key` (dotted) from its string form, parsed as the type of the current value."""
  *parents, leaf = key.split('.')
  node = config
  for i, name in enumerate(parents + [leaf]):
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      where = '.'.join(parents[:i]) or 'the top level'
      options = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      close = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
      hint = f' Did you mean {", ".join(close)}?' if close else f' Keys there: {", ".join(options)}.'
      raise ConfigError(f'Unknown config key {key!r}: no {name!r} under {where}.{hint}')
    if i < len(parents):
      node = node[name]
  try:
    node[leaf] = _parse(value, node[leaf], key)
  except TypeError as e:  # A typed field (a FieldReference) that refuses the value.
    raise ConfigError(f'{key}={value!r}: {e}') from None


_NOT_A_LITERAL = object()


def _parse(text: str, current: Any, key: str) -> Any:
  """`text` as a Python literal of the current value's type (where that is None: any literal, or the text)."""
  if isinstance(current, ml_collections.ConfigDict):
    raise ConfigError(f'{key} is a section, not a value; override its keys ({key}.{next(iter(current), "x")}'
                      '=...).')
  if isinstance(current, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    if current is None:
      return text
    value = _NOT_A_LITERAL
  if current is None:
    return value
  if value is _NOT_A_LITERAL or not _same_kind(value, current):
    kind = {bool: 'True or False', int: 'an integer', float: 'a number', list: 'a list', tuple: 'a list'}
    expected = kind.get(type(current), f'a {type(current).__name__}')
    raise ConfigError(f'{key} expects {expected}, got {text!r} (the value it overrides is {current!r}).')
  return float(value) if isinstance(current, float) else value


def _same_kind(value: Any, current: Any) -> bool:
  """Whether an override may replace `current` with `value`: an int for a float, a tuple for a list."""
  if isinstance(current, bool) or isinstance(value, bool):
    return isinstance(current, bool) and isinstance(value, bool)
  if isinstance(current, float):
    return isinstance(value, (int, float))
  if isinstance(current, (list, tuple)):
    return isinstance(value, (list, tuple))
  return isinstance(value, type(current))
