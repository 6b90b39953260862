"""The train state, its layout (by abstract evaluation outside the mesh, checked before anything is traced)
and its compiled initialisation (`Initialiser`), each parameter drawn directly in its storage sharding."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.extend import random as jax_random
from jax.sharding import Mesh, PartitionSpec

from mintrain import partitioning
from mintrain.models.layers import Draw, Frozen, ParamKeys
from mintrain.objectives import objective
from mintrain.partitioning import AxisRules

_THREEFRY = jax_random.threefry_prng_impl
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry_hash(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32 (20 rounds) as JAX computes it, unrolled: JAX lowers it for the CPU as a loop, which
  XLA:CPU runs slowly and compiles once per draw."""
  ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x1 = x1 + x2
      x2 = ((x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r))) ^ x1
    x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x1, x2


def _counts(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(high, low) 32 bits of each element's row-major index, from iotas the SPMD partitioner splits (as
  JAX's own `iota_2x32_shape`); for fewer than 2**32 elements."""
  lo = jnp.zeros(shape, jnp.uint32)
  for d, n in enumerate(shape):
    if n > 1:
      lo = lo + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(math.prod(shape[d + 1:]))
  return jnp.zeros(shape, jnp.uint32), lo


def _random_bits(key_data: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
  if math.prod(shape) >= 2 ** 32 or not jax.config.jax_threefry_partitionable:
    return _THREEFRY.random_bits(key_data, bit_width, shape)
  bits1, bits2 = _threefry_hash(key_data[0], key_data[1], *_counts(shape))
  if bit_width == 64:
    return (bits1.astype(jnp.uint64) << np.uint64(32)) | bits2.astype(jnp.uint64)
  return (bits1 ^ bits2).astype({8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width])


def _split(key_data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  if math.prod(shape) >= 2 ** 32 or not jax.config.jax_threefry_partitionable:
    return _THREEFRY.split(key_data, shape)
  bits1, bits2 = _threefry_hash(key_data[0], key_data[1], *_counts(shape))
  return jnp.stack([bits1, bits2], axis=bits1.ndim)


def _fold_in(key_data: jax.Array, data: jax.Array) -> jax.Array:
  bits1, bits2 = _threefry_hash(key_data[0], key_data[1], jnp.zeros((1,), jnp.uint32),
                                jnp.asarray(data, jnp.uint32).reshape(1))
  return jnp.concatenate([bits1, bits2])


# Keys are drawn and wrapped with this implementation whatever `jax_default_prng_impl` says: a saved key's
# data (uint32[2]) means nothing under another. It gives JAX's `threefry2x32` bits exactly (same keys, splits,
# fold-ins and draws), computed without loops.
PRNG_IMPL = jax_random.define_prng_impl(key_shape=(2,), seed=_THREEFRY.seed, split=_split,
                                        random_bits=_random_bits, fold_in=_fold_in,
                                        name='threefry2x32_unrolled', tag='fryu')


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


def draw_keys(seed: int, n: int) -> list[np.ndarray]:
  """The data (uint32[2]) of the first n keys `nnx.Rngs(params=key(seed))` gives (`fold_in(key(seed), i)`),
  computed on the host. The initialiser takes them as arguments (`layers.ParamKeys`): a key folded inside
  the program is a constant of its draw's kernel, which XLA:CPU compiles 2-3x slower (BENCHMARKS.md)."""
  base = np.asarray(jax.random.key_data(key(seed)))
  with np.errstate(over='ignore'):
    bits1, bits2 = _threefry_hash(base[0], base[1], np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32))
  return list(np.stack([bits1, bits2], axis=1))


def abstract_model(make: Callable[[nnx.Rngs], nnx.Module], seed: int) -> tuple[nnx.Module, int]:
  """The model `make` builds, with ShapeDtypeStructs for parameters, found outside any mesh (allocates
  nothing), and how many keys its parameters draw."""
  keys = ParamKeys(base=key(seed))
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    return nnx.eval_shape(lambda: make(keys)), keys.count


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
              ) -> tuple[Callable[[Sequence[jax.Array]], TrainState], Callable[[nnx.State], TrainState]]:
  """(init, from_params): the whole state drawn from the data of the parameters' keys (`draw_keys`; those
  in `drawn`, by key number, drawn already; the model's own draws appended to `record`), or built around
  given parameters (and frozen ones; a fresh optimizer state, step 0, and with `keeps_reference` a frozen
  copy of the trained parameters). Call them under `jit` on the mesh."""

  def from_params(params: nnx.State, frozen: nnx.State | None = None) -> TrainState:
    rng = jax.random.key_data(key(seed + 1))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                      frozen=frozen if frozen is not None else nnx.State({}),
                      reference=objective.reference(keeps_reference, params))

  def init(keys: Sequence[jax.Array], drawn: dict[int, jax.Array] | None = None,
           record: list[Draw] | None = None) -> TrainState:
    param_keys = ParamKeys(given=[jax.random.wrap_key_data(k, impl=PRNG_IMPL) for k in keys], drawn=drawn)
    _, params, frozen = nnx.split(make(param_keys), nnx.Param, Frozen)
    if record is not None:
      record.extend(param_keys.draws)
    return from_params(params, frozen)

  return init, from_params


def _same_draw(draw: Draw) -> tuple:
  """What makes two draws one program: the initializer's code and closure (each `param` call makes its own
  closure), shape, dtype and layout; an initializer that cannot be compared is its own."""
  init = draw.init
  try:
    what = (init.__code__, tuple(c.cell_contents for c in init.__closure__ or ()), init.__defaults__)
    hash(what)
  except (AttributeError, TypeError, ValueError):
    what = (id(init),)
  return what + (draw.shape, draw.dtype, draw.spec)


def _draw_program(draw: Draw) -> Callable[[jax.Array], jax.Array]:
  def drawn(key_data: jax.Array) -> jax.Array:
    key = jax.random.wrap_key_data(key_data, impl=PRNG_IMPL)
    return draw.init(key, draw.shape, draw.dtype, out_sharding=draw.spec)
  return jax.jit(drawn)


# The fewest draws of a kind that are drawn apart: a program of its own costs about what compiling one small
# draw's kernel does, so a kind of fewer is left to the state's program.
APART = 3


@dataclasses.dataclass(frozen=True)
class CompiledInit:
  """`Initialiser.compile`'s programs; calling it draws the state."""

  kinds: list[list[Draw]]  # The draws made apart, by the program that makes them.
  draws: list[jax.stages.Compiled]  # One per kind.
  build: jax.stages.Compiled
  keys: tuple[np.ndarray, ...]

  def __call__(self) -> TrainState:
    drawn = {d.index: program(self.keys[d.index]) for program, kind in zip(self.draws, self.kinds)
             for d in kind}
    return self.build(self.keys, drawn)

  def as_text(self) -> str:
    return '\n'.join(program.as_text() for program in (*self.draws, self.build))


@dataclasses.dataclass(frozen=True)
class Initialiser:
  """The state the seed draws, in two steps: the parameters the model draws itself, by one compiled program
  per kind of random draw (initializer, shape, dtype, layout) of at least `APART`, run once per parameter
  of that kind; then one program that builds the state around them (the other draws, stacked layers'
  vmapped ones, adapters, the optimizer state).
  XLA:CPU compiles each kernel of a program on its own, so an unrolled model's n like-shaped parameters in
  one program were n kernels to compile; here they are one. The values are those one program draws."""

  build: Any  # jax.jit of `make_init`'s init, the drawn parameters donated.
  keys: tuple[np.ndarray, ...]
  draws: tuple[Draw, ...]
  _compiled: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # By mesh.

  def compile(self) -> CompiledInit:
    """Compiles both steps once per mesh, the draws' programs side by side on the host's cores; call under
    the mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh not in self._compiled:
      self._compiled[mesh] = self._compile()
    return self._compiled[mesh]

  def _compile(self) -> CompiledInit:
    by_kind: dict[tuple, list[Draw]] = {}
    for d in self.draws:
      by_kind.setdefault(_same_draw(d), []).append(d)
    kinds = {what: kind for what, kind in by_kind.items() if len(kind) >= APART and self._random(kind[0])}
    lowered = [_draw_program(kind[0]).lower(self.keys[kind[0].index]) for kind in kinds.values()]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
      programs = list(pool.map(lambda program: program.compile(), lowered))
    abstract = {d.index: jax.ShapeDtypeStruct(d.shape, d.dtype, sharding=program.output_shardings)
                for program, kind in zip(programs, kinds.values()) for d in kind}
    return CompiledInit(list(kinds.values()), programs, self.build.lower(self.keys, abstract).compile(),
                        self.keys)

  def _random(self, draw: Draw) -> bool:
    """Whether the draw reads its key: a constant (zeros, ones) compiles to next to nothing anywhere."""
    key_ = jax.random.wrap_key_data(self.keys[draw.index], impl=PRNG_IMPL)
    jaxpr = jax.make_jaxpr(lambda k: draw.init(k, draw.shape, draw.dtype))(key_).jaxpr
    return any(jaxpr.invars[0] in eqn.invars for eqn in jaxpr.eqns)

  def __call__(self) -> TrainState:
    return self.compile()()


def state_bytes_per_device(tree) -> int:
  """Bytes per device of a tree of arrays or ShapeDtypeStructs with shardings."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, 'sharding', None) is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total
