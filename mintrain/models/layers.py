"""Building blocks shared by the models.

Shape letters: B batch, L length, D embed, F mlp, H heads, K head dim, V vocab.

Every parameter is created with its logical axes as `out_sharding` metadata.
Parameters are stored in their storage layout (e.g. FSDP-sharded on `embed`);
`gather` brings one to its compute layout and dtype right before use, so the
all-gather (and, in the backward pass, the reduce-scatter) happens inside the
layer that needs it.

A stack of identical layers can also hold its parameters stacked on a leading
`layers` axis (`stack_layers`), so a `scan` runs one compiled layer N times. A checkpoint
saved in one layout restores into the other (`Relayout`), keyed on that axis.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mintrain.partitioning import AxisRules

Initializer = Callable[..., jax.Array]
LAYERS = 'layers'  # Logical name of the leading dimension of stacked per-layer parameters.


def param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str | None],
          dtype: jnp.dtype, rules: AxisRules, *, decay: bool | None = None) -> nnx.Param:
  """A parameter with its logical axes declared next to it.

  Under a mesh it is drawn directly in its storage sharding, so no device ever
  holds the whole of a sharded parameter. Without one (shape discovery before
  validation) it is created unsharded. `decay`: whether the optimizer's weight
  decay applies (metadata `weight_decay`); by default matrices take it, vectors
  (norm scales, biases) do not.
  """
  axes = tuple(axes)
  spec = None if jax.sharding.get_abstract_mesh().empty else rules.param_spec(axes)
  value = init(rngs.params(), tuple(shape), dtype, out_sharding=spec)
  decay = len(shape) >= 2 if decay is None else decay
  # The logical names are metadata only: Flax must not map them to mesh axes itself.
  return nnx.Param(value, out_sharding=axes, eager_sharding=False, weight_decay=decay)


def gather(p: nnx.Param, rules: AxisRules, dtype: jnp.dtype) -> jax.Array:
  """The parameter in its compute layout and dtype."""
  return rules.reshard(p[...].astype(dtype), p.get_metadata()['out_sharding'])


MATMUL = 'weight_matmul'  # Checkpoint name of `linear`'s outputs, for remat policies.


LINEAR_OPTIONS = ('auto', 'custom_vjp', 'einsum')


def linear_for_platform(option: str, platform: str) -> str:
  """'auto' -> the custom VJP on CPU, where it was measured to help (BENCHMARKS.md), else plain einsum."""
  if option != 'auto':
    return option
  return 'custom_vjp' if platform == 'cpu' else 'einsum'


def linear(subscripts: str, x: jax.Array, w: jax.Array, out_sharding=None, *,
           custom_vjp: bool = True) -> jax.Array:
  """`jnp.einsum(subscripts, x, w)` of activations `x` with a weight `w`, output named `MATMUL`.

  Same value and gradients as the einsum; with `custom_vjp` only the weight gradient's operand
  order differs. Autodiff forms it as `einsum(dy, x)` and XLA:CPU's matmul then copies `dy`
  transposed (fused with whatever produced `dy`, e.g. SiLU's backward); the custom VJP transposes
  the smaller of `x` and `dy` instead.
  """
  if not custom_vjp:
    return checkpoint_name(jnp.einsum(subscripts, x, w, out_sharding=out_sharding), MATMUL)
  return checkpoint_name(_linear(subscripts, x, w, out_sharding), MATMUL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _linear(subscripts: str, x: jax.Array, w: jax.Array, out_sharding) -> jax.Array:
  return jnp.einsum(subscripts, x, w, out_sharding=out_sharding)


def _linear_fwd(subscripts, x, w, out_sharding):
  return _linear(subscripts, x, w, out_sharding), (x, w)


def _linear_bwd(subscripts, out_sharding, residuals, dy):
  x, w = residuals
  x_axes, rest = subscripts.split(',')
  w_axes, y_axes = rest.split('->')
  _, x_vjp = jax.vjp(lambda x: jnp.einsum(subscripts, x, w, out_sharding=out_sharding), x)
  w_sharding = jax.typeof(w).sharding
  if x.size <= dy.size:
    dw = jnp.einsum(f'{x_axes},{y_axes}->{w_axes}', x, dy, out_sharding=w_sharding)
  else:
    dw = jnp.einsum(f'{y_axes},{x_axes}->{w_axes}', dy, x, out_sharding=w_sharding)
  return x_vjp(dy)[0], dw.astype(w.dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout with a mask drawn in `x`'s sharding, so it is the same on every mesh."""
  if rate == 0.0 or key is None:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape, out_sharding=jax.typeof(x).sharding)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square norm over `embed`, computed in float32. With `plus_one` (Gemma) the stored scale
  is an offset from 1, drawn as zeros."""

  def __init__(self, dim: int, *, rules: AxisRules, param_dtype: jnp.dtype, rngs: nnx.Rngs,
               eps: float = 1e-6, plus_one: bool = False):
    init = nnx.initializers.zeros if plus_one else nnx.initializers.ones
    self.scale = param(rngs, init, (dim,), ('embed',), param_dtype, rules)
    self.rules, self.eps, self.plus_one = rules, eps, plus_one

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    scale = gather(self.scale, self.rules, jnp.float32)
    return (x * (1.0 + scale if self.plus_one else scale)).astype(x_BLD.dtype)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def stack_layers(modules: Sequence[nnx.Module], rules: AxisRules) -> nnx.Module:
  """One module whose parameters are those of `modules` stacked on a new leading `layers` axis.

  The layers are drawn one by one first, exactly as an unstacked model draws them, so a
  seed gives the same initial parameters (and the same run) in either layout.
  """
  graphdef, _ = nnx.split(modules[0])

  def stack(*variables: nnx.Variable) -> nnx.Variable:
    axes = (LAYERS, *variables[0].get_metadata()['out_sharding'])
    value = jnp.stack([v[...] for v in variables])
    if not jax.sharding.get_abstract_mesh().empty:
      value = jax.sharding.reshard(value, rules.param_spec(axes))
    return variables[0].replace(value, out_sharding=axes)

  states = [nnx.state(m) for m in modules]
  return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_variable))


def split_layers(stacked: nnx.Module) -> tuple[Callable[[list[jax.Array]], nnx.Module], list[jax.Array]]:
  """(make_layer, params_N): the stacked parameters as plain arrays with a leading layer dimension,
  and the function that builds one layer's module from one layer's slices of them (for `scan`)."""
  graphdef, state = nnx.split(stacked)
  # One layer's metadata names its own axes only; it travels in the tree structure.
  layer_state = jax.tree.map(lambda v: v.replace(out_sharding=v.get_metadata()['out_sharding'][1:]), state,
                             is_leaf=_is_variable)
  params_N, treedef = jax.tree.flatten(layer_state)
  return lambda params: nnx.merge(graphdef, jax.tree.unflatten(treedef, params)), params_N


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


@functools.cache
def _stack_fn(sharding) -> Callable[[tuple[jax.Array, ...]], jax.Array]:
  return jax.jit(jnp.stack, out_shardings=sharding)


@functools.cache
def _split_fn(shardings: tuple) -> Callable[[jax.Array], tuple[jax.Array, ...]]:
  return jax.jit(lambda x: tuple(x[i] for i in range(len(shardings))), out_shardings=shardings)
