"""Building blocks every family shares: parameters that carry their logical axes, `gather` to the compute
layout inside the layer that uses it (so FSDP's all-gather and reduce-scatter happen there), and
`run_layers`, the one scan/remat/pipeline runner of a stack of layers (stacked on a leading `layers` axis)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mintrain.models import pipeline
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
  shape = tuple(shape)
  if isinstance(rngs, ParamKeys):
    value = rngs.draw(init, shape, dtype, spec)
  else:
    value = init(rngs.params(), shape, dtype, out_sharding=spec)
  decay = len(shape) >= 2 if decay is None else decay
  # The logical names are metadata only: Flax must not map them to mesh axes itself.
  return nnx.Param(value, out_sharding=axes, eager_sharding=False, weight_decay=decay)


class Frozen(nnx.Variable):
  """A weight that does not train (LoRA's base): no gradient, no optimizer state, not checkpointed."""


def gather(p: nnx.Variable | nnx.Module, rules: AxisRules, dtype: jnp.dtype) -> jax.Array:
  """The parameter in its compute layout and dtype; a weight module (a LoRA-adapted or quantized base,
  `mintrain.lora`) computes its own, so every call site gets it alike."""
  if isinstance(p, nnx.Module):
    return p.gather(rules, dtype)
  return rules.reshard(p[...].astype(dtype), p.get_metadata()['out_sharding'])


def gather_split(p: nnx.Variable | nnx.Module, rules: AxisRules, dtype: jnp.dtype, key: jax.Array | None
                 ) -> tuple[jax.Array, Callable[[jax.Array], jax.Array] | None]:
  """(weight, adapter): `gather(p, ...)` and None, except in training (`key` given) for a LoRA weight whose
  adapter's input drops out (PEFT's lora_dropout): its base, and the function of the matmul's input (whose
  trailing axes are the weight's inputs) that gives the adapter's term, for the call site to add."""
  if key is not None and getattr(p, 'dropout', 0.0) > 0:
    return p.gather_base(rules, dtype), functools.partial(p.term, rules=rules, key=key)
  return gather(p, rules, dtype), None


def plus(y: jax.Array, adapter: Callable[[jax.Array], jax.Array] | None, x: jax.Array) -> jax.Array:
  """`y` plus `adapter(x)` where `gather_split` gave one."""
  return y if adapter is None else y + adapter(x).astype(y.dtype)


def fold(key: jax.Array | None, i: int) -> jax.Array | None:
  """`key` folded with `i`, or None for no key (no dropout)."""
  return None if key is None else jax.random.fold_in(key, i)


MATMUL = 'weight_matmul'  # Checkpoint name of `linear`'s outputs, for remat policies.


LINEAR_OPTIONS = ('auto', 'custom_vjp', 'einsum')


def linear_for_platform(option: str, platform: str) -> str:
  """'auto' -> the custom VJP on CPU, where it was measured to help (BENCHMARKS.md), else plain einsum."""
  if option != 'auto':
    return option
  return 'custom_vjp' if platform == 'cpu' else 'einsum'


def matmul(subscripts: str, a: jax.Array, b: jax.Array, out_sharding=None,
           dtype: jnp.dtype | None = None) -> jax.Array:
  """`jnp.einsum(subscripts, a, b)` in `dtype` (the operands' by default), summed in float32 on the CPU.

  Asked for a bfloat16 result, XLA:CPU converts both operands to float32 and multiplies at float32's
  rate; asked for a float32 one, it multiplies the bfloat16 operands as they are, about twice as fast
  (BENCHMARKS.md). Accelerators sum bfloat16 products in float32 whatever the result type, so there the
  einsum asks for `dtype` itself; for float32 operands the two are the same.
  """
  dtype = jnp.result_type(a, b) if dtype is None else jnp.dtype(dtype)
  wide = jnp.float32 if jax.default_backend() == 'cpu' else dtype
  return jnp.einsum(subscripts, a, b, out_sharding=out_sharding, preferred_element_type=wide).astype(dtype)


def linear(subscripts: str, x: jax.Array, w: jax.Array, out_sharding=None, *,
           custom_vjp: bool = True) -> jax.Array:
  """`matmul(subscripts, x, w)` of activations `x` with a weight `w`, output named `MATMUL`.

  Same value and gradients as the einsum; with `custom_vjp` only the weight gradient's operand
  order differs. Autodiff forms it as `einsum(dy, x)` and XLA:CPU's matmul then copies `dy`
  transposed (fused with whatever produced `dy`, e.g. SiLU's backward); the custom VJP transposes
  the smaller of `x` and `dy` instead, and sums its gradients' matmuls in float32 too.
  """
  if not custom_vjp:
    return checkpoint_name(matmul(subscripts, x, w, out_sharding), MATMUL)
  return checkpoint_name(_linear(subscripts, x, w, out_sharding), MATMUL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _linear(subscripts: str, x: jax.Array, w: jax.Array, out_sharding) -> jax.Array:
  return matmul(subscripts, x, w, out_sharding)


def _linear_fwd(subscripts, x, w, out_sharding):
  return _linear(subscripts, x, w, out_sharding), (x, w)


def varying_axes(*xs: jax.Array) -> frozenset:
  """The mesh axes (inside `shard_map`) over which any of `xs` varies."""
  return frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in xs))


def summed_as(grad: jax.Array, primal: jax.Array) -> jax.Array:
  """A cotangent summed over the mesh axes its primal does not vary over (as autodiff's transpose of the
  implicit broadcast there: a weight over the devices of its rows, an expert's matrix over those of its
  tokens), for custom VJPs inside `shard_map`."""
  axes = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
  return jax.lax.psum(grad, axes) if axes else grad


def _linear_bwd(subscripts, out_sharding, residuals, dy):
  x, w = residuals
  x_axes, rest = subscripts.split(',')
  w_axes, y_axes = rest.split('->')
  _, x_vjp = jax.vjp(lambda x: matmul(subscripts, x, w, out_sharding), x)
  # Under a shard_map that splits the rows by hand (the pipeline's), each device holds its rows' share.
  return x_vjp(dy)[0], summed_as(_weight_grad(x_axes, x, y_axes, dy, w_axes, w), w)


def _weight_grad(x_axes: str, x: jax.Array, y_axes: str, dy: jax.Array, w_axes: str,
                 w: jax.Array) -> jax.Array:
  """`x`'s rows against `dy`'s, in `w`'s axes. XLA:CPU's matmul copies its first operand transposed for
  this contraction, so the smaller of `x` and `dy` goes first, and the product is formed with that
  operand's axes first (else XLA puts the other first, to write `w`'s order directly), then transposed."""
  (a_axes, a), (b_axes, b) = sorted([(x_axes, x), (y_axes, dy)], key=lambda pair: pair[1].size)
  order = ''.join(sorted(w_axes, key=lambda axis: axis not in a_axes))
  sharding = jax.typeof(w).sharding
  spec = (*sharding.spec, *(None,) * (len(w_axes) - len(sharding.spec)))
  spec = jax.sharding.PartitionSpec(*(spec[w_axes.index(axis)] for axis in order))
  dw = matmul(f'{a_axes},{b_axes}->{order}', a, b, jax.sharding.NamedSharding(sharding.mesh, spec), w.dtype)
  return dw if order == w_axes else jnp.transpose(dw, [order.index(axis) for axis in w_axes])


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


@dataclasses.dataclass(frozen=True)
class Draw:
  """One parameter's draw: `init(key number index, shape, dtype)`, laid out as `spec`."""

  index: int
  init: Initializer
  shape: tuple[int, ...]
  dtype: jnp.dtype
  spec: jax.sharding.PartitionSpec | None


class ParamKeys:
  """Hands out the keys of a model's parameters in order, where `nnx.Rngs` would: `given` ones (the
  initialiser's arguments), or the n-th `fold_in(base, n)`, as `nnx.Rngs(params=base).params()` does; so a
  seed draws the same parameters either way. `count`: how many were handed out.

  `param` draws through `draw`, which records each draw (`draws`) or returns its value from `drawn` (by key
  number), drawn beforehand in a program of its own (`train_state.Initialiser`)."""

  def __init__(self, base: jax.Array | None = None, given: Sequence[jax.Array] | None = None,
               drawn: Mapping[int, jax.Array] | None = None):
    self._base, self._given, self._drawn, self.count = base, given, drawn or {}, 0
    self.draws: list[Draw] = []

  def params(self) -> jax.Array:
    drawn = jax.random.fold_in(self._base, self.count) if self._given is None else self._given[self.count]
    self.count += 1
    return drawn

  def draw(self, init: Initializer, shape: tuple[int, ...], dtype: jnp.dtype,
           spec: jax.sharding.PartitionSpec | None) -> jax.Array:
    index = self.count
    key = self.params()
    if index in self._drawn:
      return self._drawn[index]
    self.draws.append(Draw(index, init, shape, jnp.dtype(dtype), spec))
    return init(key, shape, dtype, out_sharding=spec)


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs,
                 rules: AxisRules) -> nnx.Module:
  """One module whose parameters are those of n layers `make_layer` builds, stacked on a new leading
  `layers` axis (the layers differ in static settings only, which the first layer's keep).

  The layers take their keys from `rngs` in order, as an unstacked model's layers do, so a seed gives the
  same initial parameters (and the same run) in either layout; each parameter of all layers is one
  vmapped draw, one kernel for XLA instead of n.
  """
  counter = ParamKeys(base=jax.random.key(0))
  graphdef = nnx.split(nnx.eval_shape(lambda: make_layer(counter)))[0]
  keys_PN = [jnp.stack(k) for k in zip(*[[rngs.params() for _ in range(counter.count)] for _ in range(n)])]
  state = jax.vmap(lambda keys_P: nnx.state(make_layer(ParamKeys(given=keys_P))))(keys_PN)

  def stacked(variable: nnx.Variable) -> nnx.Variable:
    axes = (LAYERS, *variable.get_metadata()['out_sharding'])
    value = variable[...]
    if not jax.sharding.get_abstract_mesh().empty:
      value = jax.sharding.reshard(value, rules.param_spec(axes))
    return variable.replace(value, out_sharding=axes)

  return nnx.merge(graphdef, jax.tree.map(stacked, state, is_leaf=_is_variable))


def split_layers(stacked: nnx.Module) -> tuple[Callable[[list[jax.Array]], nnx.Module], list[jax.Array]]:
  """(make_layer, params_N): the stacked parameters as plain arrays with a leading layer dimension,
  and the function that builds one layer's module from one layer's slices of them (for `scan`)."""
  graphdef, state = nnx.split(stacked)
  # One layer's metadata names its own axes only; it travels in the tree structure.
  layer_state = jax.tree.map(lambda v: v.replace(out_sharding=v.get_metadata()['out_sharding'][1:]), state,
                             is_leaf=_is_variable)
  params_N, treedef = jax.tree.flatten(layer_state)
  return lambda params: nnx.merge(graphdef, jax.tree.unflatten(treedef, params)), params_N


def _weights_recomputed(weight_shapes: set[tuple[int, ...]]) -> Callable[..., bool]:
  """A remat policy that saves everything but what is computed from weights alone (an index into the stack,
  the FSDP gather, casts, layouts, the q/k/v and gate/up stacks): the backward pass redoes that from the
  stack rather than keep a copy of the layer's weights. A policy sees only the operands' types, so weights
  are told from activations by shape; recomputing is always right, so a coincidence costs only time."""
  def saveable(prim, *avals, **params) -> bool:
    if prim.name == 'pvary':  # A change of type alone (to vary over manual axes), free to redo.
      return False
    shapes = [a.shape for a in avals if getattr(a, 'shape', ())]
    return not shapes or not all(shape in weight_shapes for shape in shapes)
  return saveable


def run_layers(layers: nnx.Module, x: jax.Array, key: jax.Array | None, *args, scanned: bool,
               policy: Callable | None = None, schedule: pipeline.Schedule | None = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`x` through each layer in turn, `layer(x, key, *args) -> (x, statistics)`, the key folded with the
  layer's index: unrolled over a list of layers, or one `scan` over layers stacked by `stack_layers`, so
  compile time does not grow with depth; stacked layers over several stages run as `schedule`'s pipeline
  (`pipeline.run`). With a remat `policy`, each layer recomputes in the backward pass what the policy does
  not keep. Returns `x` and the non-empty statistics stacked on a leading layer axis ({} if none)."""

  def apply_layer(make_layer, params, x: jax.Array, i: jax.Array | int, key: jax.Array | None, *args):
    return make_layer(params)(x, jax.random.fold_in(key, i) if key is not None else None, *args)

  def rematerialised(policy: Callable | None) -> Callable:
    if policy is None:
      return apply_layer
    # A scan already keeps XLA from merging the recomputation back into the forward pass.
    return jax.checkpoint(apply_layer, policy=policy, prevent_cse=not scanned, static_argnums=(0,))

  run = rematerialised(policy)
  if not scanned:
    stats = []
    for i, layer in enumerate(layers):
      graphdef, params = nnx.split(layer)
      x, layer_stats = run(functools.partial(nnx.merge, graphdef), params, x, i, key, *args)
      stats += [layer_stats] if layer_stats else []
    return x, jax.tree.map(lambda *xs: jnp.stack(xs), *stats) if stats else {}
  make_layer, params_N = split_layers(layers)

  def run_block(params_N: list[jax.Array], x: jax.Array, first: jax.Array | int, key: jax.Array | None,
                *args, whole: Callable[[list[jax.Array]], list[jax.Array]] = list,
                start: jax.Array | None = None, count: int = 0):
    """The layers of `params_N` (or `count` of them from `start`, a traced index: the circular pipeline's
    round) from layer index `first` on; `whole` makes a layer's parameters whole (the pipeline's FSDP
    gather). Both happen inside the remat region (for `start`, one without remat too), so autodiff keeps
    `params_N` once, not the slices of each call."""
    if start is None:
      def body(x: jax.Array, layer: tuple[list[jax.Array], jax.Array]):
        params, i = layer
        return run(lambda params: make_layer(whole(params)), params, x, i, key, *args)
      return jax.lax.scan(body, x, (params_N, first + jnp.arange(params_N[0].shape[0])))

    def selected(params_N: list[jax.Array], j: jax.Array) -> list[jax.Array]:
      return whole([jax.lax.dynamic_index_in_dim(p, j, keepdims=False) for p in params_N])

    def layer_at(at: tuple[list[jax.Array], jax.Array]) -> nnx.Module:
      return make_layer(selected(*at))

    indexed_run = run
    if policy is None:
      # Without remat too, each layer selects and lays out its round's weights again in the backward pass
      # rather than keep them for every step of the schedule. A weight's shapes: its stage's stack, one
      # layer's slice (before and after the index drops its dimension) and that slice gathered whole.
      shapes = {w.shape for w in jax.eval_shape(selected, params_N, start)}
      shapes |= {shape for p in params_N for shape in (p.shape, (1, *p.shape[1:]), p.shape[1:])}
      indexed_run = rematerialised(_weights_recomputed(shapes))

    def indexed(x: jax.Array, j: jax.Array):
      return indexed_run(layer_at, (params_N, start + j), x, first + j, key, *args)
    return jax.lax.scan(indexed, x, jnp.arange(count))

  if schedule is None or schedule.stages == 1:
    # A scan reads its layers whole (`stage` is of size 1 here, or they run without the pipeline).
    return run_block([whole_layers(p) for p in params_N], x, 0, key, *args)

  def run_stage_block(*block_args, **block_kwargs) -> jax.Array:
    x, stats = run_block(*block_args, **block_kwargs)
    if stats:
      raise ValueError('Pipelined layers return no statistics; the family must refuse mesh.stage > 1.')
    return x

  return pipeline.run(schedule, run_stage_block, params_N, x, key, args), {}


def whole_layers(p_N: jax.Array) -> jax.Array:
  """Stacked parameters with their `layers` dimension whole on every device: for a scan, or to index one
  layer, without the pipeline (a gather over `stage` where it splits them)."""
  spec = jax.typeof(p_N).sharding.spec
  if jax.sharding.get_abstract_mesh().empty or not spec or spec[0] is None:
    return p_N
  return jax.sharding.reshard(p_N, jax.sharding.PartitionSpec(None, *spec[1:]))


def on_params_mesh(function: Callable) -> Callable:
  """`function(module, ...)` run under the mesh the module's parameters live on when no mesh is current,
  so a model made on its own (`hf.from_pretrained`) is callable as it is; under a mesh, as it is."""

  @functools.wraps(function)
  def wrapped(module: nnx.Module, *args, **kwargs):
    if jax.sharding.get_abstract_mesh().empty:
      leaf = jax.tree.leaves(nnx.state(module, (nnx.Param, Frozen)))[0]
      mesh = getattr(getattr(leaf, 'sharding', None), 'mesh', None)
      if isinstance(mesh, jax.sharding.Mesh):
        with jax.set_mesh(mesh):
          return function(module, *args, **kwargs)
    return function(module, *args, **kwargs)

  return wrapped


def merge(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None) -> nnx.Module:
  """The model of `graphdef` with its trainable and (None: no) `Frozen` variables."""
  return nnx.merge(graphdef, params, *([] if frozen is None else [frozen]))
