"""The run's config: ml_collections files and `key.path=value` overrides, parsed once into frozen sections.

`load` reads a config file by path; `validate` turns the ConfigDict into a `Config` whose sections
(mesh, partitioning, model, data, train, optimizer, eval, checkpoint, metrics, profile) are frozen
dataclasses, every option checked against its meaning before any device is touched. Each module
receives only its own section. Defaults live in `mintrain/configs/base.py` alone; a config saved by an older
mintrain goes through `upgrade`, which fills the keys added since from there.
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

from mintrain import configs, errors, fields, models, partitioning
from mintrain import mesh as mesh_lib
from mintrain.data import tokenizer
from mintrain.errors import ConfigError
from mintrain.fields import option

BASE = configs.path('base')
STREAMED_SOURCES = ('jsonl', 'parquet', 'arrayrecord')  # Read a block at a time (mintrain.data.records).


def _mesh_size(value: int) -> str | None:
  return None if value >= 1 or value == -1 else 'must be a positive integer, or -1 for all remaining devices'


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = option(check=_mesh_size)
  fsdp: int = option(check=_mesh_size)
  expert: int = option(check=_mesh_size)
  context: int = option(check=_mesh_size)
  model: int = option(check=_mesh_size)
  # Of those ways, how many go across slices (multi-slice); only the axes in mesh.SPANS_SLICES have one.
  dcn_data: int = option(at_least=1)
  dcn_fsdp: int = option(at_least=1)

  def __post_init__(self):
    if list(self.sizes.values()).count(-1) > 1:
      raise ConfigError(f'mesh sizes may have one -1 (all remaining devices), not several; got '
                        f'{", ".join(f"mesh.{k}={v}" for k, v in self.sizes.items())}.')
    for axis, ways in self.slices.items():
      size = self.sizes[axis]
      if size != -1 and size % ways:
        raise ConfigError(f'mesh.dcn_{axis}={ways} must divide mesh.{axis}={size}: of its {size} ways, that '
                          'many go across slices and the rest stay within each.')

  @property
  def sizes(self) -> dict[str, int]:
    return {axis: getattr(self, axis) for axis in mesh_lib.AXES}

  @property
  def slices(self) -> dict[str, int]:
    """Ways of each axis across slices (`mesh.make_mesh`)."""
    return {axis: getattr(self, f'dcn_{axis}') for axis in mesh_lib.SPANS_SLICES}


@dataclasses.dataclass(frozen=True)
class PartitioningConfig:
  rules: tuple = option()
  param_rules: tuple = option()

  def __post_init__(self):
    for key in ('rules', 'param_rules'):
      try:
        partitioning.normalize_rules(getattr(self, key))
      except errors.PartitioningError as e:
        raise ConfigError(f'partitioning.{key}: {e}') from None


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = option(choices=('stdlib', 'text', 'tokens', 'synthetic', *STREAMED_SOURCES, 'mixture'))
  path: str = option()
  tokenizer: str = option()  # 'byte', a tokenizer file or directory; '' resolved by `validate`.
  eval_fraction: float = option(at_least=0, below=1)
  token_dtype: str = option(choices=('uint16', 'uint32'))
  max_bytes: int = option(at_least=0)
  packing: str = option(choices=('pack', 'pad'))
  num_threads: int = option(at_least=0)
  prefetch: int = option(at_least=0)
  device_prefetch: int = option(at_least=0)
  text_field: str = option()
  record_format: str = option(choices=('text', 'tokens'))
  block_bytes: int = option(at_least=1)
  shuffle_window: int = option(at_least=1)
  skip_bad_records: bool = option()
  mixture: tuple = option()  # ((settings as sorted (key, value) pairs, weight), ...), from (dict, weight)s.

  def __post_init__(self):
    entries = tuple(_mixture_entry(i, entry) for i, entry in enumerate(self.mixture))
    object.__setattr__(self, 'mixture', entries)
    if (self.source == 'mixture') != bool(entries):
      raise ConfigError("data.source='mixture' and a non-empty data.mixture go together: set both (a list of "
                        "({'source': 'jsonl', 'path': ...}, weight)) or neither.")


# What each source of a mixture may set; the rest (threads, prefetch) belongs to the whole mixture.
MIXTURE_KEYS = ('source', 'path', 'eval_fraction', 'token_dtype', 'text_field', 'record_format',
                'block_bytes', 'shuffle_window', 'skip_bad_records')


def _mixture_entry(i: int, entry: Any) -> tuple[tuple[tuple[str, Any], ...], float]:
  """A mixture entry as ((key, value), ...) and its weight, checked; ConfigError names the entry."""
  where = f'data.mixture[{i}]'
  if not isinstance(entry, (list, tuple)) or len(entry) != 2:
    raise ConfigError(f"{where}={entry!r} must be a pair (settings, weight), e.g. "
                      f"({{'source': 'jsonl', 'path': 'a/*.jsonl'}}, 0.5).")
  settings, weight = entry
  if isinstance(settings, (list, tuple)):  # As saved in a checkpoint's config.
    settings = dict(settings)
  if not isinstance(settings, Mapping):
    raise ConfigError(f'{where}: settings {settings!r} must be a dict of data options.')
  for key in settings:
    if key not in MIXTURE_KEYS:
      raise ConfigError(f'{where}: {key!r} is not an option a mixture source may set; choose from '
                        f'{MIXTURE_KEYS}.')
  source = settings.get('source')
  if source not in STREAMED_SOURCES:
    raise ConfigError(f"{where}: source={source!r} is not a source a mixture can draw from; choose one of "
                      f'{STREAMED_SOURCES}.')
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float('inf'):
    raise ConfigError(f'{where}: weight={weight!r} must be a finite number > 0.')
  probe = {**defaults().to_dict()['data'], 'mixture': (), **settings}
  checked = fields.build(DataConfig, probe, where)  # Each value's own check.
  return tuple(sorted((k, getattr(checked, k)) for k in settings)), float(weight)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every_steps: int = option(at_least=0)
  steps: int = option(at_least=0)  # 0: no evaluation.


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = option(at_least=1)
  global_batch_size: int = option(at_least=1)
  seq_len: int = option(at_least=1)
  grad_accum_steps: int = option(at_least=1)
  log_every: int = option(at_least=1)

  def __post_init__(self):
    if self.global_batch_size % self.grad_accum_steps:
      raise ConfigError(
          f'train.global_batch_size={self.global_batch_size} is not divisible by '
          f'train.grad_accum_steps={self.grad_accum_steps}; every micro-batch must have the same size.')

  @property
  def micro_batch_size(self) -> int:
    return self.global_batch_size // self.grad_accum_steps


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  peak_tflops: float = option(at_least=0)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  start_step: int = option(at_least=-1)
  num_steps: int = option(at_least=1)


@dataclasses.dataclass(frozen=True)
class InitConfig:
  hf_checkpoint: str = option()  # '' or a Hugging Face model directory.


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every_steps: int = option(at_least=0)
  keep: int = option(at_least=0)
  fallback_to_previous: bool = option()


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = option(above=0)
  warmup_steps: int = option(at_least=0)
  end_lr_fraction: float = option(at_least=0, at_most=1)
  b1: float = option(at_least=0, below=1)
  b2: float = option(at_least=0, below=1)
  eps: float = option(above=0)
  weight_decay: float = option(at_least=0)
  grad_clip_norm: float = option(at_least=0)


SECTIONS = {'mesh': MeshConfig, 'partitioning': PartitioningConfig, 'data': DataConfig, 'eval': EvalConfig,
            'train': TrainConfig, 'metrics': MetricsConfig, 'profile': ProfileConfig,
            'checkpoint': CheckpointConfig, 'optimizer': OptimizerConfig, 'init': InitConfig}


@dataclasses.dataclass(frozen=True)
class Config:
  """A validated run config; `model` is the typed config of the family `model_name`."""

  seed: int
  model_name: str
  model: Any
  mesh: MeshConfig
  partitioning: PartitioningConfig
  data: DataConfig
  train: TrainConfig
  optimizer: OptimizerConfig
  eval: EvalConfig
  checkpoint: CheckpointConfig
  metrics: MetricsConfig
  profile: ProfileConfig
  init: InitConfig

  @property
  def family(self) -> models.Family:
    return models.family(self.model_name)

  def to_dict(self) -> dict[str, Any]:
    """The options as plain values: what a checkpoint saves and `validate` reads back."""
    out = {'seed': self.seed, 'model': {'name': self.model_name, **fields.to_dict(self.model)}}
    out.update({name: fields.to_dict(getattr(self, name)) for name in SECTIONS})
    return out

  def replace(self, **sections: Any) -> Config:
    return dataclasses.replace(self, **sections)


def validate(config: ml_collections.ConfigDict | Mapping[str, Any]) -> Config:
  """The typed config; a ConfigError names the first key whose value cannot work, and what can."""
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
  hf_checkpoint = sections['init'].hf_checkpoint
  if hf_checkpoint:  # Its config.json sets the model; other model options stay.
    model.update(models.hf_model_options(hf_checkpoint))
  spec = tokenizer.resolve(sections['data'].tokenizer, hf_checkpoint)
  sections['data'] = dataclasses.replace(sections['data'], tokenizer=spec)
  name = model.pop('name', None)
  family = models.family(name)
  model_cfg = fields.build(family.config, model, 'model')
  model_cfg = model_cfg.for_tokenizer(lambda: tokenizer.load(spec).vocab_size)
  model_cfg.check(sections['train'].seq_len)
  return Config(seed=seed, model_name=name, model=model_cfg, **sections)


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
  """A config file's `get_config()` with `key.path=value` overrides applied.

  The file is loaded by path as a module of its folder's package, so it can import its neighbours
  (`from . import base`) wherever it lives; nothing is added to `sys.path`. A file that does not load is
  a one-line ConfigError naming the file and line (`mintrain/configs/x.py:3: SyntaxError: ...`).
  """
  path = pathlib.Path(path).expanduser()
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
