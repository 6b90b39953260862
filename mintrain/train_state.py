"""The train state, its layout on the mesh, and its sharded initialisation.

Order matters: the parameter layout is found by abstract evaluation outside the
mesh and validated (divisibility, rules) before anything is traced on the
mesh; then the state is initialised inside `jit`, each parameter drawn
directly in its storage sharding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mintrain import partitioning
from mintrain.config import check_batch_divisible
from mintrain.models import make_model
from mintrain.optimizer import make_optimizer
from mintrain.partitioning import AxisRules


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken.
  params: nnx.State  # nnx.Param variables, in their storage sharding.
  opt_state: optax.OptState  # Same sharding as the params they track.
  rng: jax.Array  # uint32[2] base key; per-step keys are folded from it.


@dataclasses.dataclass(frozen=True)
class ParamInfo:
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  logical_axes: tuple[str | None, ...]
  spec: PartitionSpec  # Storage layout.
  compute_spec: PartitionSpec  # Layout inside the layer.
  shard_shape: tuple[int, ...]

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


def param_layout(config: ml_collections.ConfigDict, rules: AxisRules, mesh: Mesh) -> list[ParamInfo]:
  """Every parameter's shape, logical axes and layout; raises on any layout error.

  Abstract evaluation only: no parameter is allocated.
  """
  rules.check_mesh_axes(mesh.axis_names)
  batch_axes = partitioning.spec_axes(rules.activation_spec(('batch',))[0])
  check_batch_divisible(config, rules.ways('batch', mesh.shape),
                        ' x '.join(f'`{a}`' for a in batch_axes) or 'no mesh axes')
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    abstract = nnx.eval_shape(lambda: make_model(config.model, rules, config.seed))
  rows = []
  for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    name, axes = path_str(path), var.get_metadata()['out_sharding']
    spec = rules.param_spec(axes, what=name)
    partitioning.check_divisible(name, var.shape, axes, spec, mesh.shape)
    compute_spec = rules.activation_spec(axes, what=name)
    partitioning.check_divisible(name, var.shape, axes, compute_spec, mesh.shape)
    rows.append(ParamInfo(name, tuple(var.shape), np.dtype(var.dtype), tuple(axes), spec,
                          compute_spec, partitioning.shard_shape(var.shape, spec, mesh.shape)))
  return rows


def make_init(config: ml_collections.ConfigDict, rules: AxisRules,
              tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, Callable[[], TrainState]]:
  """The model's graph definition and a function that builds the state (call it under `jit`)."""
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make_model(config.model, rules, config.seed)),
                            nnx.Param)

  def init() -> TrainState:
    _, params = nnx.split(make_model(config.model, rules, config.seed), nnx.Param)
    rng = jax.random.key_data(jax.random.key(config.seed + 1))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=rng)

  return graphdef, init


@dataclasses.dataclass
class Setup:
  """Everything a run needs that follows from the config and the mesh."""

  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  layout: list[ParamInfo]
  init: Callable[[], TrainState]  # jitted; call under the mesh.
  abstract_state: TrainState  # ShapeDtypeStructs with concrete NamedShardings.


def setup(config: ml_collections.ConfigDict, rules: AxisRules, mesh: Mesh) -> Setup:
  """Validates the layout, then traces (but does not run) the sharded init."""
  layout = param_layout(config, rules, mesh)
  tx = make_optimizer(config.optimizer, config.train.steps)
  graphdef, init = make_init(config, rules, tx)
  init = jax.jit(init)
  with jax.set_mesh(mesh):
    abstract_state = jax.eval_shape(init)
  # eval_shape gives shardings on an AbstractMesh; restore targets need this mesh's devices.
  def concrete(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    spec = x.sharding.spec if x.sharding is not None else PartitionSpec()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  abstract_state = jax.tree.map(concrete, abstract_state)
  return Setup(graphdef, tx, layout, init, abstract_state)


def state_bytes_per_device(tree) -> int:
  """Bytes per device of a tree of arrays or ShapeDtypeStructs with shardings."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, 'sharding', None) is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total
