"""The train state, its layout (by abstract evaluation outside the mesh, checked before anything is traced)
and its initialisation inside `jit`, each parameter drawn directly in its storage sharding."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, PartitionSpec

from mintrain import partitioning
from mintrain.models.layers import Frozen
from mintrain.objectives import objective
from mintrain.partitioning import AxisRules

# Keys are drawn and wrapped with this implementation whatever `jax_default_prng_impl` says: a saved key's
# data (uint32[2]) means nothing under another.
PRNG_IMPL = 'threefry2x32'


def key(seed: int) -> jax.Array:
  return jax.random.key(seed, impl=PRNG_IMPL)


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken.
  params: nnx.State  # nnx.Param variables, in their storage sharding.
  opt_state: optax.OptState  # Same sharding as the params they track.
  rng: jax.Array  # uint32[2] base key; per-step keys are folded from it.
  # `layers.Frozen` variables (LoRA's base): no gradients, no optimizer state, never checkpointed. None or
  # empty without LoRA.
  frozen: nnx.State | None = None
  # The objective's frozen reference model (`objectives.objective.reference`): the initial parameters, laid
  # out as `params`, never trained; None for objectives without one.
  reference: nnx.State | None = None


@dataclasses.dataclass(frozen=True)
class ParamInfo:
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  logical_axes: tuple[str | None, ...]
  spec: PartitionSpec  # Storage layout.
  compute_spec: PartitionSpec  # Layout inside the layer.
  shard_shape: tuple[int, ...]
  trainable: bool = True  # False for `layers.Frozen` ones (LoRA's base).

  @property
  def bytes_per_device(self) -> int:
    return math.prod(self.shard_shape) * np.dtype(self.dtype).itemsize


def path_str(path: tuple) -> str:
  """A pytree key path as `a.b.0.c`, the naming Orbax uses for saved arrays."""
  def name(k) -> str:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return '.'.join(name(k) for k in path)


def flat_logical_axes(tree: Any) -> dict[str, tuple[str | None, ...] | None]:
  """{path: logical axes} of every array leaf of a state, named as a full flatten names it
  (`path_str`); None for leaves that are not parameters (or mirror none, like Adam's count)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]:
    axes = tuple(leaf.get_metadata()['out_sharding']) if _is_variable(leaf) else None
    for sub, _ in jax.tree_util.tree_flatten_with_path(leaf)[0]:
      out[path_str(path + sub)] = axes
  return out


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def abstract_model(make: Callable[[nnx.Rngs], nnx.Module], seed: int) -> nnx.Module:
  """The model `make` builds, with ShapeDtypeStructs for parameters, found outside any mesh: allocates
  nothing."""
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    return nnx.eval_shape(lambda: make(nnx.Rngs(params=key(seed))))


def param_layout(abstract: nnx.Module, rules: AxisRules, mesh: Mesh) -> list[ParamInfo]:
  """Every parameter's shape, logical axes and layout, the trainable ones first; raises on any layout error
  (the rules' mesh axes are checked first, by `build`)."""
  rows = []
  _, params, frozen = nnx.split(abstract, nnx.Param, Frozen)
  for path, var in [*nnx.to_flat_state(params), *nnx.to_flat_state(frozen)]:
    name, axes = path_str(path), var.get_metadata()['out_sharding']
    spec = rules.param_spec(axes, what=name)
    partitioning.check_divisible(name, var.shape, axes, spec, mesh.shape)
    compute_spec = rules.activation_spec(axes, what=name)
    partitioning.check_divisible(name, var.shape, axes, compute_spec, mesh.shape)
    rows.append(ParamInfo(name, tuple(var.shape), np.dtype(var.dtype), tuple(axes), spec,
                          compute_spec, partitioning.shard_shape(var.shape, spec, mesh.shape),
                          isinstance(var, nnx.Param)))
  return rows


def make_init(make: Callable[[nnx.Rngs], nnx.Module], tx: optax.GradientTransformation, seed: int,
              keeps_reference: bool = False
              ) -> tuple[Callable[[], TrainState], Callable[[nnx.State], TrainState]]:
  """(init, from_params): the whole state drawn from the seed, or built around given parameters (and
  frozen ones; a fresh optimizer state, step 0, and with `keeps_reference` a frozen copy of the trained
  parameters). Call them under `jit` on the mesh."""

  def from_params(params: nnx.State, frozen: nnx.State | None = None) -> TrainState:
    rng = jax.random.key_data(key(seed + 1))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                      frozen=frozen if frozen is not None else nnx.State({}),
                      reference=objective.reference(keeps_reference, params))

  def init() -> TrainState:
    _, params, frozen = nnx.split(make(nnx.Rngs(params=key(seed))), nnx.Param, Frozen)
    return from_params(params, frozen)

  return init, from_params


def state_bytes_per_device(tree) -> int:
  """Bytes per device of a tree of arrays or ShapeDtypeStructs with shardings."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, 'sharding', None) is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total
