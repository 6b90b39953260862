"""Typed, checked config sections: frozen dataclasses built once from the ml_collections config.

A section declares each option as a dataclass field with its type and meaning (`option(...)`: a
range, choices); `build` checks a ConfigDict section against it and says, for a wrong value, the
key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mintrain.errors import ConfigError


def option(*, choices: Sequence[Any] | None = None, at_least: float | None = None,
           above: float | None = None, below: float | None = None, at_most: float | None = None,
           check: Callable[[Any], str | None] | None = None, default: Any = dataclasses.MISSING) -> Any:
  """A dataclass field with its allowed values; `check(value)` returns what is wrong, or None."""
  meta = {'choices': tuple(choices) if choices is not None else None, 'at_least': at_least, 'above': above,
          'below': below, 'at_most': at_most, 'check': check}
  return dataclasses.field(default=default, metadata=meta)


def _allowed(meta: Mapping[str, Any]) -> str:
  """The allowed range as words: `> 0`, `in [0, 1)`, `>= 1`."""
  lo = ('[', meta['at_least']) if meta['at_least'] is not None else ('(', meta['above'])
  hi = (']', meta['at_most']) if meta['at_most'] is not None else (')', meta['below'])
  if lo[1] is not None and hi[1] is not None:
    return f'in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}'
  if lo[1] is not None:
    return f'{">=" if lo[0] == "[" else ">"} {lo[1]}'
  return f'{"<=" if hi[0] == "]" else "<"} {hi[1]}'


def _in_range(value: float, meta: Mapping[str, Any]) -> bool:
  bounds = {'at_least': operator.ge, 'above': operator.gt, 'below': operator.lt, 'at_most': operator.le}
  return all(meta[key] is None or holds(value, meta[key]) for key, holds in bounds.items())


def _type_name(kind: Any) -> str:
  return getattr(kind, '__name__', str(kind))


def _coerce(value: Any, kind: Any, key: str) -> Any:
  """`value` as `kind` (int, float, bool, str, tuple[...], X | None), or a ConfigError."""
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    kinds = [a for a in args if a is not type(None)]
    errors = []
    for k in kinds:
      try:
        return _coerce(value, k, key)
      except ConfigError as e:
        errors.append(e)
    raise errors[0]
  if origin is tuple or kind is tuple:
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f'{key}={value!r} must be a tuple (or list).')
    if args and args[-1] is Ellipsis:
      return tuple(_coerce(v, args[0], f'{key}[{i}]') for i, v in enumerate(value))
    return tuple(_freeze(v) for v in value)
  if kind is bool:
    if not isinstance(value, bool):
      raise ConfigError(f'{key}={value!r} must be True or False.')
    return value
  if kind is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f'{key}={value!r} must be an integer.')
    return value
  if kind is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f'{key}={value!r} must be a number.')
    if not math.isfinite(value):  # `1e999` parses as inf; no option means anything by it.
      raise ConfigError(f'{key}={value!r} must be a finite number.')
    return float(value)
  if kind is str:
    if not isinstance(value, str):
      raise ConfigError(f'{key}={value!r} must be a string.')
    return value
  if kind is Any:
    return _freeze(value)
  raise TypeError(f'{key}: unsupported field type {_type_name(kind)}')


def _freeze(value: Any) -> Any:
  """Lists (e.g. from a saved JSON config) as tuples, so sections stay hashable."""
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


def build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
  """The dataclass `cls` from the ConfigDict section `values` (named `prefix`), every value checked."""
  if not isinstance(values, Mapping):
    raise ConfigError(f'{prefix} must be a section of keys (a ConfigDict), not {values!r}.')
  kwargs = check(cls, values, prefix)
  for f in dataclasses.fields(cls):
    if f.name not in values and f.default is dataclasses.MISSING:
      raise ConfigError(f'Config key {prefix}.{f.name} is missing; mintrain/configs/base.py has its default '
                        'and meaning.')
  return cls(**kwargs)


def check(cls: type, values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
  """Some of the options of `cls`, each checked and coerced: what a section's part (a mixture entry) sets."""
  hints = typing.get_type_hints(cls)
  fields = dataclasses.fields(cls)
  names = [f.name for f in fields]
  for key in values:
    if key not in names:
      close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
      hint = f' Did you mean {", ".join(close)}?' if close else f' Keys there: {", ".join(names)}.'
      raise ConfigError(f'Unknown config key {prefix}.{key}.{hint}')
  kwargs = {}
  for f in fields:
    key = f'{prefix}.{f.name}'
    if f.name not in values:
      continue
    value = _coerce(values[f.name], hints[f.name], key)
    meta = f.metadata
    if meta.get('choices') is not None and value not in meta['choices']:
      raise ConfigError(f'{key}={value!r}; choose one of {meta["choices"]}.')
    if any(meta.get(k) is not None for k in ('at_least', 'above', 'below', 'at_most')):
      if not _in_range(value, meta):
        kind = 'an integer ' if hints[f.name] is int else ''
        raise ConfigError(f'{key}={value!r} must be {kind}{_allowed(meta)}.')
    if meta.get('check') is not None:
      problem = meta['check'](value)
      if problem:
        raise ConfigError(f'{key}={value!r}: {problem}.')
    kwargs[f.name] = value
  return kwargs


def to_dict(section: Any) -> dict[str, Any]:
  """The options of a section as plain values, for JSON and hparams."""
  return {f.name: _thaw(getattr(section, f.name)) for f in dataclasses.fields(section)}


def _thaw(value: Any) -> Any:
  if isinstance(value, tuple):
    return [_thaw(v) for v in value]
  return value
