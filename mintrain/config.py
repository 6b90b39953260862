"""Loading and validating ml_collections configs, before anything touches a device."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from collections.abc import Sequence

import ml_collections

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = ('float32', 'bfloat16')


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key and what to change."""


def load(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads a config file (`get_config()`) and applies `key.path=value` overrides."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f'Config file {path} does not exist; see configs/ for the available ones.')
  if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # Config files import `configs.base`.
  spec = importlib.util.spec_from_file_location(f'_mintrain_config_{path.stem}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  apply_overrides(config, overrides)
  return config


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
  """Sets each `key.path=value` override."""
  for item in overrides:
    key, sep, value = item.partition('=')
    if not sep:
      raise ConfigError(f'Override {item!r} must look like key.path=value.')
    set_value(config, key, value)


def set_value(config: ml_collections.ConfigDict, key: str, value: str) -> None:
  """Sets `key` (dotted) from its string form, parsed as the type of the current value."""
  *parents, leaf = key.split('.')
  node = config
  for i, name in enumerate(parents + [leaf]):
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      where = '.'.join(parents[:i]) or 'the top level'
      options = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      close = [o for o in options if _close(o, name)]
      hint = f' Did you mean {", ".join(close)}?' if close else f' Keys there: {", ".join(options)}.'
      raise ConfigError(f'Unknown config key {key!r}: no {name!r} under {where}.{hint}')
    if name != leaf or i < len(parents):
      node = node[name]
  current = node[leaf]
  node[leaf] = _parse(value, current, key)


def _close(a: str, b: str) -> bool:
  import difflib
  return difflib.SequenceMatcher(None, a, b).ratio() >= 0.6 or a.startswith(b) or b.startswith(a)


def _parse(text: str, current, key: str):
  import ast
  if isinstance(current, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError) as e:
    raise ConfigError(f'Cannot parse {key}={text!r} as a {type(current).__name__}.') from e
  if isinstance(current, bool) and not isinstance(value, bool):
    raise ConfigError(f'{key} expects True or False, got {text!r}.')
  if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if current is not None and not isinstance(value, type(current)) and not (
      isinstance(current, (list, tuple)) and isinstance(value, (list, tuple))):
    raise ConfigError(f'{key} expects a {type(current).__name__}, got {text!r}.')
  return value


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks values that are wrong on any mesh. Mesh-dependent checks live in `mesh`/`partitioning`."""
  sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.model]
  if any(not isinstance(s, int) or (s < 1 and s != -1) for s in sizes) or sizes.count(-1) > 1:
    raise ConfigError(f'mesh sizes must be positive integers with at most one -1 '
                      f'(all remaining devices); got data={sizes[0]}, fsdp={sizes[1]}, model={sizes[2]}.')
  t = config.train
  for key in ('steps', 'global_batch_size', 'seq_len', 'grad_accum_steps', 'log_every'):
    if not isinstance(t[key], int) or t[key] < 1:
      raise ConfigError(f'train.{key} must be a positive integer; got {t[key]!r}.')
  if t.global_batch_size % t.grad_accum_steps:
    raise ConfigError(
        f'train.global_batch_size={t.global_batch_size} is not divisible by '
        f'train.grad_accum_steps={t.grad_accum_steps}; every micro-batch must have the same size.')
  m = config.model
  for key in ('param_dtype', 'compute_dtype'):
    if m[key] not in DTYPES:
      raise ConfigError(f'model.{key}={m[key]!r}; choose one of {DTYPES}.')
  if not 0.0 <= m.dropout_rate < 1.0:
    raise ConfigError(f'model.dropout_rate={m.dropout_rate} must be in [0, 1).')
  if m.name == 'transformer' and m.head_dim % 2:
    raise ConfigError(f'model.head_dim={m.head_dim} must be even for rotary embeddings.')
  if m.name == 'transformer':
    from mintrain.models.transformer import ATTENTION_OPTIONS, REMAT_OPTIONS
    for key, options in (('remat', REMAT_OPTIONS), ('attention', ATTENTION_OPTIONS)):
      if m.get(key, options[0]) not in options:  # Configs saved before the option existed lack it.
        raise ConfigError(f'model.{key}={m[key]!r}; choose one of {options}.')
    chunks = m.get('loss_chunks', 1)
    if not isinstance(chunks, int) or chunks < 0 or (chunks and t.seq_len % chunks):
      raise ConfigError(f'model.loss_chunks={chunks!r} must be 0 (logits, then the loss) or a positive '
                        f'divisor of train.seq_len={t.seq_len} (the fused loss over that many chunks).')


def micro_batch_size(config: ml_collections.ConfigDict) -> int:
  return config.train.global_batch_size // config.train.grad_accum_steps


def check_batch_divisible(config: ml_collections.ConfigDict, batch_ways: int, batch_axes: str) -> None:
  """The micro-batch must split evenly over the mesh axes that `batch` maps to."""
  micro = micro_batch_size(config)
  if micro % batch_ways:
    ok = batch_ways * config.train.grad_accum_steps
    raise ConfigError(
        f'`batch` (micro-batch of {micro} = train.global_batch_size {config.train.global_batch_size} '
        f'/ train.grad_accum_steps {config.train.grad_accum_steps}) is split over {batch_axes} '
        f'= {batch_ways} devices; {micro} % {batch_ways} != 0. Use a global batch that is a '
        f'multiple of {ok}.')
