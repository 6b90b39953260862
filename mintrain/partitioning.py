"""Logical axis names -> mesh axes: the one place where the two meet. Rules are an ordered list of
`(logical_name, mesh_axes)` resolved as `flax.linen.logical_to_mesh_axes` does (priority order, a taken mesh
axis skipped), but a named dimension no rule binds is an error, not silently replicated. Parameters resolve
twice: `param_rules + rules` for storage at rest (FSDP), `rules` alone for the compute layout."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from mintrain.errors import ConfigError, PartitioningError
from mintrain.fields import option

MeshAxes = str | tuple[str, ...] | None
Rule = tuple[str, MeshAxes]


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
  if mesh_axes is None:
    return ()
  if isinstance(mesh_axes, str):
    return (mesh_axes,)
  return tuple(mesh_axes)


def without_axes(spec: P, axes: Iterable[str]) -> P:
  """`spec` less the mesh axes `axes` (a dimension they alone split becomes whole)."""
  def entry_without(entry: MeshAxes) -> MeshAxes:
    kept = tuple(a for a in _as_tuple(entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept
  return P(*(entry_without(entry) for entry in spec))


def _is_mesh_axes(mesh_axes: Any) -> bool:
  """Flax also accepts a list of names (a config may turn tuples into lists)."""
  return (mesh_axes is None or isinstance(mesh_axes, str)
          or isinstance(mesh_axes, (tuple, list)) and all(isinstance(a, str) for a in mesh_axes))


def normalize_rules(rules: Iterable[Sequence[Any]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """Rules as hashable `(name, (mesh_axis, ...))` pairs; `()` means replicated."""
  out = []
  for rule in rules:
    if (not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str)
        or not _is_mesh_axes(rule[1])):
      raise PartitioningError(
          f'Bad partitioning rule {rule!r}: expected (logical_name, mesh_axes) with '
          'mesh_axes a mesh axis name, a tuple (or list) of names, or None.')
    name, mesh_axes = rule
    axes = _as_tuple(mesh_axes)
    if len(set(axes)) != len(axes):
      raise PartitioningError(
          f'Partitioning rule ({name!r}, {mesh_axes!r}) names a mesh axis twice; '
          'a dimension can be split over each mesh axis at most once.')
    out.append((name, axes))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class PartitioningConfig:
  """The `partitioning` section: activation and parameter rules, checked as `normalize_rules` reads them."""

  rules: tuple = option()
  param_rules: tuple = option()

  def __post_init__(self):
    for key in ('rules', 'param_rules'):
      try:
        normalize_rules(getattr(self, key))
      except PartitioningError as e:
        raise ConfigError(f'partitioning.{key}: {e}') from None


def resolve(logical_axes: Sequence[str | None], rules: Sequence[tuple[str, tuple[str, ...]]],
            *, what: str = 'array') -> P:
  """PartitionSpec for one array, with rules in priority order as `flax.linen.logical_to_mesh_axes`.

  A name used by two dimensions (which Flax rejects) is resolved as two names: each rule binds every
  still-unbound dimension of its name, left to right, while its mesh axes are free.
  """
  for dim, name in enumerate(logical_axes):
    if name is not None and all(rule_name != name for rule_name, _ in rules):
      raise PartitioningError(
          f'Logical axis `{name}` (dim {dim} of `{what}`) has no partitioning rule. '
          f"Add ('{name}', None) to partitioning.rules to replicate it, or map it to a mesh axis.")
  bound: list[tuple[str, ...] | None] = [None] * len(logical_axes)
  used: dict[str, int] = {}
  for rule_name, axes in rules:
    for dim, name in enumerate(logical_axes):
      if name == rule_name and bound[dim] is None and not any(a in used for a in axes):
        bound[dim] = axes
        used.update(dict.fromkeys(axes, dim))
  for dim, name in enumerate(logical_axes):
    if name is not None and bound[dim] is None:
      taken = ', '.join(f'`{a}` (by dim {used[a]})' for rule_name, axes in rules if rule_name == name
                        for a in axes if a in used)
      raise PartitioningError(
          f'Logical axis `{name}` (dim {dim} of `{what}`): every rule for it names a mesh axis '
          f'already used in this spec: {taken}. A mesh axis can shard one dimension only. '
          f"Add a fallback rule ('{name}', None) after the others.")
  return P(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in bound))


def spec_axes(entry: MeshAxes) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry."""
  return _as_tuple(entry)


@dataclasses.dataclass(frozen=True)
class AxisRules:
  """The rule set of a run; hashable, so models can hold it as static data.

  `rules` lay out activations and the compute form of parameters;
  `param_rules` are tried first for parameters at rest (storage).
  """

  rules: tuple[tuple[str, tuple[str, ...]], ...]
  param_rules: tuple[tuple[str, tuple[str, ...]], ...] = ()

  @classmethod
  def from_config(cls, partitioning: Any) -> AxisRules:
    """From the `partitioning` section (`PartitioningConfig`)."""
    return cls(normalize_rules(partitioning.rules), normalize_rules(partitioning.param_rules))

  def activation_spec(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
                      what: str = 'activation') -> P:
    """Layout of an activation. Given its `shape` (or its leading dimensions), a dimension of size 1
    stays whole where the current mesh would split it (one decode token over `context`); any other size
    must divide, which `check_divisible` and the type check of `reshard` enforce. Inside a `shard_map`
    (the pipeline's), the axes it splits by hand are left out: the body sees its own share already; so
    are axes made automatic there (`jax.sharding.auto_axes`), which the partitioner lays out itself."""
    spec = resolve(logical_axes, self.rules, what=what)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return spec
    if mesh.manual_axes or mesh.auto_axes:
      spec = without_axes(spec, (*mesh.manual_axes, *mesh.auto_axes))
    if shape is None:
      return spec

    def split(entry: MeshAxes) -> bool:
      return math.prod(mesh.shape[a] for a in _as_tuple(entry)) > 1
    return P(*(None if dim < len(shape) and shape[dim] == 1 and split(entry) else entry
               for dim, entry in enumerate(spec)))

  def param_spec(self, logical_axes: Sequence[str | None], what: str = 'parameter') -> P:
    """Storage layout of a parameter."""
    return resolve(logical_axes, self.param_rules + self.rules, what=what)

  def ways(self, name: str, mesh_shape: Mapping[str, int]) -> int:
    """How many devices activations are split over along the logical axis `name`."""
    return math.prod(mesh_shape[a] for a in _as_tuple(self.activation_spec((name,))[0]))

  def reshard(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Move `x` to the layout of its logical axes (a no-op when already there)."""
    return jax.sharding.reshard(x, self.activation_spec(logical_axes, x.shape))

  def check_mesh_axes(self, mesh_axis_names: Sequence[str]) -> None:
    for name, axes in self.param_rules + self.rules:
      unknown = [a for a in axes if a not in mesh_axis_names]
      if unknown:
        raise PartitioningError(
            f"Partitioning rule ('{name}', {axes}) names mesh axis {unknown[0]!r}, which is not "
            f'in the mesh {tuple(mesh_axis_names)}. Use one of those names.')


def check_divisible(path: str, shape: Sequence[int], logical_axes: Sequence[str | None], spec: P,
                    mesh_shape: Mapping[str, int]) -> None:
  """Raises if a sharded dimension is not a multiple of its mesh axes' product."""
  for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
    axes = spec_axes(entry)
    ways = math.prod(mesh_shape[a] for a in axes)
    if ways > 1 and size % ways:
      name = logical_axes[dim]
      split = ' x '.join(f'`{a}` of size {mesh_shape[a]}' for a in axes)
      raise PartitioningError(
          f'`{name}` (dim {dim} of `{path}`, size {size}) is split over mesh axis {split}; '
          f'{size} % {ways} != 0. Use a size that is a multiple of {ways}, change the mesh, '
          f"or map `{name}` to None in partitioning.rules.")


def shard_shape(shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
  """Per-device shape of an array of `shape` laid out as `spec`."""
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  return tuple(size // math.prod(mesh_shape[a] for a in spec_axes(e)) for size, e in zip(shape, entries))


def format_spec(spec: P) -> str:
  """`P('fsdp', 'model')` as `(fsdp, model)`; replicated dims as `-`."""
  def entry(e: MeshAxes) -> str:
    axes = spec_axes(e)
    return '-' if not axes else axes[0] if len(axes) == 1 else '(' + ' '.join(axes) + ')'
  return '(' + ', '.join(entry(e) for e in spec) + ')'
