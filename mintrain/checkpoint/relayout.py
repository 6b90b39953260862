"""Restores across layer layouts: per-layer arrays (`blocks.<i>.X`) and arrays stacked on a leading `layers`
axis (`model.scan_layers`) read into each other, one array at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from mintrain.models.layers import LAYERS


def _without_index(path: str) -> list[tuple[str, int, int]]:
  """(path without one all-digit component, that index, its position) for each such component."""
  parts = path.split('.')
  return [('.'.join(parts[:k] + parts[k + 1:]), int(p), k) for k, p in enumerate(parts) if p.isdigit()]


@dataclasses.dataclass(frozen=True)
class Relayout:
  """How arrays saved in one layer layout map onto a target in the other, by flat dotted paths.

  A target array whose leading logical axis is `layers` and that the checkpoint lacks is stacked
  from per-layer arrays (`blocks.<i>.X` -> `blocks.X`); a target per-layer array that the checkpoint
  lacks is sliced from a saved array stacked on `layers`. Paths mirror the parameters anywhere in
  the state (Adam's moments too).
  """

  stack: dict[str, tuple[str, ...]]  # Target path (stacked) -> the saved per-layer paths, in layer order.
  unstack: dict[str, tuple[str, ...]]  # Saved path (stacked) -> the target per-layer paths, in layer order.

  @classmethod
  def plan(cls, target: Mapping[str, tuple[tuple[int, ...], tuple[str | None, ...] | None]],
           saved_axes: Mapping[str, tuple[str | None, ...] | None]) -> Relayout:
    """`target`: {path: (shape, logical axes)}; `saved_axes`: {path: logical axes or None (not recorded)}."""
    per_layer: dict[str, tuple[int, dict[int, str]]] = {}  # Stacked name -> (index position, {i: path}).
    for path in saved_axes:
      for stacked, i, k in _without_index(path):
        per_layer.setdefault(stacked, (k, {}))[1][i] = path
    stack, unstack = {}, {}
    for path, (shape, axes) in target.items():
      if path in saved_axes:
        continue
      if axes and axes[0] == LAYERS and path in per_layer:
        k, _ = per_layer[path]
        parts = path.split('.')
        stack[path] = tuple('.'.join(parts[:k] + [str(i)] + parts[k:]) for i in range(shape[0]))
        continue
      for stacked, i, _ in _without_index(path):
        if stacked in saved_axes and (saved_axes[stacked] or (LAYERS,))[0] == LAYERS:
          unstack.setdefault(stacked, {})[i] = path
          break
    return cls(stack, {s: tuple(d[i] for i in sorted(d)) for s, d in unstack.items()})

  def __bool__(self) -> bool:
    return bool(self.stack or self.unstack)

  def saved_layout(self, target: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
    """The arrays to read in the checkpoint's own layout, each sharded as its part of the target."""
    out = {path: x for path, x in target.items() if path not in self.stack
           and not any(path in parts for parts in self.unstack.values())}
    for path, sources in self.stack.items():
      x = target[path]
      for source in sources:
        out[source] = _abstract(x.shape[1:], x.dtype, x.sharding, drop_leading=True)
    for source, parts in self.unstack.items():
      x = target[parts[0]]
      out[source] = _abstract((len(parts), *x.shape), x.dtype, x.sharding, drop_leading=False)
    return out

  def apply(self, saved: dict[str, jax.Array],
            target: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """The target's arrays from arrays read in the saved layout; consumes `saved`.

    One jitted stack or split per array, whose inputs are freed as soon as it is done (a stack's output
    cannot alias its inputs, so donation alone would not free them): the state is never held in both
    layouts, only one array of it at a time.
    """
    out = {}
    for path, sources in self.stack.items():
      inputs = tuple(saved.pop(s) for s in sources)
      out[path] = jax.block_until_ready(_stack_fn(target[path].sharding)(inputs))
      _free(inputs)
    for source, parts in self.unstack.items():
      stacked = saved.pop(source)
      pieces = jax.block_until_ready(_split_fn(tuple(target[p].sharding for p in parts))(stacked))
      _free((stacked,))
      out.update(zip(parts, pieces))
    out.update(saved)
    return out


def _free(arrays: Sequence[jax.Array]) -> None:
  for x in arrays:
    x.delete()


def _abstract(shape: tuple[int, ...], dtype, sharding, *, drop_leading: bool) -> jax.ShapeDtypeStruct:
  """An abstract array of `shape` sharded like its stacked (or per-layer) counterpart."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec)[1:] if drop_leading else (None, *sharding.spec)
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.P(*spec))
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _stack_fn(sharding) -> Callable[[tuple[jax.Array, ...]], jax.Array]:
  return jax.jit(jnp.stack, out_shardings=sharding)


def _split(x: jax.Array) -> tuple[jax.Array, ...]:
  return tuple(x[i] for i in range(x.shape[0]))


def _split_fn(shardings: tuple) -> Callable[[jax.Array], tuple[jax.Array, ...]]:
  return jax.jit(_split, out_shardings=shardings)
