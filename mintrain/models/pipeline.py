"""Pipeline parallelism over the mesh axis `stage`: the stacked layers, whose `layers` axis the rules map to
`stage`, run as a schedule of microbatches inside `jax.shard_map` over `stage` and the rows' axes, each stage
handing its output to the next with `ppermute`. The other axes (`model`) are left to the partitioner inside
(`jax.sharding.auto_axes`), so tensor parallelism works within a stage as without a pipeline.

GPipe when `repeats` is 1: stage s holds the s-th contiguous block of layers. With `repeats` R > 1, the
circular schedule (MaxText's): the layers form R * S blocks, stage s runs blocks s, s + S, s + 2S, ..., and a
microbatch goes round the ring of stages R times, which shrinks the bubble R-fold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mintrain.fields import option
from mintrain.partitioning import spec_axes

STAGE = 'stage'  # The mesh axis of pipeline stages.


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """The `pipeline` section: how the stacked layers run over mesh.stage (unused at mesh.stage=1)."""

  microbatches: int = option(at_least=1)
  repeats: int = option(at_least=1)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The pipeline a model runs its stacked layers with: `stages` from the mesh, the rest from the config."""

  stages: int = 1
  microbatches: int = 1
  repeats: int = 1

  @property
  def iterations(self) -> int:
    """Steps of the schedule: each stage works R * M of them, and the last starts S - 1 after the first."""
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The share of the stages' steps spent idle: (S - 1) / (R * M + S - 1)."""
    return (self.stages - 1) / self.iterations


UNPIPELINED = Schedule()


# (params of layers with a leading layer dimension, x, index of the first layer it runs, key, *args,
# whole=the function that makes one layer's parameters whole, and optionally start=, count=: run `count`
# of them from the traced index `start`) -> x.
RunBlock = Callable[..., jax.Array]


def run(schedule: Schedule, run_block: RunBlock, params_N: Sequence[jax.Array], x_BLD: jax.Array,
        key: jax.Array | None, args: Sequence[jax.Array | None]) -> jax.Array:
  """`x_BLD` through all layers (`params_N` stacked on a leading layer dimension split over `stage`), the
  batch in `schedule.microbatches` microbatches; an arg whose leading dimension is the batch's is split too.

  Each row computes what it would without the pipeline: the layers see the same rows, weights and layer
  indices (so the same dropout keys, though a microbatch draws masks of its own shape); only how many rows
  one matmul holds changes.
  """
  stages, m, repeats = schedule.stages, schedule.microbatches, schedule.repeats
  rows = x_BLD.shape[0]
  params_N = [_circular(p, stages, repeats) for p in params_N] if repeats > 1 else list(params_N)
  split = [a is not None and a.shape[0] == rows and rows > 1 for a in args]
  x_MbLD = _microbatches(x_BLD, m)
  args_M = [_microbatches(a, m) if s else a for a, s in zip(args, split)]
  block = params_N[0].shape[0] // (stages * repeats)
  # The rows' mesh axes are split by hand too: over an explicit `data`, by the known cost above, every
  # device would keep all of the rows' residuals.
  rows_axes = _axes(jax.typeof(x_MbLD).sharding.spec, 1)
  by_hand = (STAGE, *rows_axes)
  rows_spec = P(None, rows_axes or None)
  # A weight split over the rows' axes (FSDP) enters split, and each layer gathers its own inside the block,
  # as without the pipeline: gathered before the schedule, a device would hold its stage's every layer whole.
  params_specs = [_by_hand(p, by_hand) for p in params_N]
  def whole(params: list[jax.Array]) -> list[jax.Array]:
    return [_gathered(p, spec) for p, spec in zip(params, params_specs)]

  def stage_body(params_local: list[jax.Array], x_MbLD: jax.Array, key: jax.Array | None,
                 args_M: list[jax.Array | None]):
    s = jax.lax.axis_index(STAGE)
    ring = [(i, (i + 1) % stages) for i in range(stages)]

    def tick(carry, t):
      prev_BLD, waiting_MbLD, out_MbLD = carry
      received_BLD = jax.lax.ppermute(prev_BLD, STAGE, ring)
      if repeats > 1:  # The last stage's output of work item t - S waits on stage 0 for its next round.
        done = t - stages
        slot = jnp.mod(done, m)
        keep = (done >= 0) & (done < (repeats - 1) * m)
        waiting_MbLD = waiting_MbLD.at[slot].set(jnp.where(keep, received_BLD, waiting_MbLD[slot]))
      fresh_BLD = x_MbLD[jnp.minimum(t, m - 1)]
      if repeats > 1:
        fresh_BLD = jnp.where(t < m, fresh_BLD, waiting_MbLD[jnp.mod(t, m)])
      in_BLD = jnp.where(s == 0, fresh_BLD, received_BLD)
      k = t - s  # This stage's work item: microbatch k mod M on its round k // M; out of range, idle.
      r, mb = jnp.clip(k // m, 0, repeats - 1), jnp.mod(k, m)
      # Round r's block of the local layers: each layer selects its weights inside a remat region (one
      # that saves all else without model.remat), so autodiff keeps the stack once, not each step's slice.
      rounds = {} if repeats == 1 else {'start': r * block, 'count': block}
      args_b = [a[mb] if sp else a for a, sp in zip(args_M, split)]
      y_BLD = run_block(params_local, in_BLD, (r * stages + s) * block, key, *args_b, whole=whole, **rounds)
      y_BLD = jax.sharding.reshard(y_BLD, jax.typeof(in_BLD).sharding.spec)
      last = (s == stages - 1) & (k >= (repeats - 1) * m) & (k < repeats * m)
      out_MbLD = out_MbLD.at[mb].set(jnp.where(last, y_BLD, out_MbLD[mb]))
      return (y_BLD, waiting_MbLD, out_MbLD), None

    zeros_MbLD = jnp.zeros_like(x_MbLD)
    unvaried = tuple(a for a in by_hand if a not in jax.typeof(zeros_MbLD).manual_axis_type.varying)
    zeros_MbLD = jax.lax.pcast(zeros_MbLD, unvaried, to='varying')  # Each stage's (and rows') own.
    carry = (zeros_MbLD[0], zeros_MbLD if repeats > 1 else None, zeros_MbLD)
    (_, _, out_MbLD), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.iterations))
    return jax.lax.psum(out_MbLD, STAGE)  # Only the last stage's are not zeros.

  staged = jax.shard_map(stage_body, in_specs=(params_specs, rows_spec, P(),
                                               [_by_hand(a, by_hand) for a in args_M]),
                         out_specs=rows_spec, axis_names=set(by_hand))
  # JAX 0.10 lowers a partially manual shard_map's outputs replicated over the explicit axes its out_specs
  # do not name, the residuals autodiff saves of the schedule among them: over an explicit `model`, every
  # device would keep (and gather at every step) its activations whole over tensor parallelism. Over auto
  # axes the partitioner keeps them split; inside, the rules' layouts leave those axes out
  # (`AxisRules.activation_spec`).
  mesh = jax.sharding.get_abstract_mesh()
  if auto := tuple(a for a in mesh.axis_names if a not in by_hand and mesh.shape[a] > 1):
    staged = jax.sharding.auto_axes(staged, axes=auto, out_sharding=jax.typeof(x_MbLD).sharding.spec)
  return _whole(staged(params_N, x_MbLD, key, args_M), rows)


def _axes(spec: P, dim: int) -> tuple[str, ...]:
  """The mesh axes that split dimension `dim` of an array laid out as `spec`."""
  return spec_axes(tuple(spec)[dim]) if dim < len(spec) else ()


def _gathered(p: jax.Array, spec: P) -> jax.Array:
  """One layer's slice `p` of a stacked parameter laid out as `spec` (by hand), whole over its manual axes
  but `stage`."""
  sizes = jax.sharding.get_abstract_mesh().shape
  for dim in range(1, len(spec)):
    if axes := tuple(a for a in _axes(spec, dim) if sizes[a] > 1):
      p = _all_gather(p, axes, dim - 1)
  return p


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _all_gather(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
  """`all_gather(x, axes, axis=dim, tiled=True)`, whose gradient is summed over `axes` and sliced: its own
  transpose, `psum_scatter`, does not lower for an operand split over explicit axes (`model`) in JAX 0.10."""
  return jax.lax.all_gather(x, axes, axis=dim, tiled=True)


def _all_gather_fwd(x: jax.Array, axes: tuple[str, ...], dim: int) -> tuple[jax.Array, None]:
  return _all_gather(x, axes, dim), None


def _all_gather_bwd(axes: tuple[str, ...], dim: int, _, dy: jax.Array) -> tuple[jax.Array]:
  size = dy.shape[dim] // jax.lax.axis_size(axes)
  return (jax.lax.dynamic_slice_in_dim(jax.lax.psum(dy, axes), jax.lax.axis_index(axes) * size, size, dim),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


def _by_hand(a: jax.Array | None, axes: Sequence[str]) -> P:
  """The layout of `a` on the mesh axes `axes` alone: its in_spec for a shard_map over them."""
  if a is None:
    return P()
  spec = jax.typeof(a).sharding.spec
  return P(*(tuple(x for x in _axes(spec, d) if x in axes) or None for d in range(a.ndim)))


def _circular(p_N: jax.Array, stages: int, repeats: int) -> jax.Array:
  """Stacked layers reordered so that the s-th contiguous stage block holds blocks s, s + S, ... (round
  r's block of stage s is layer block r * S + s): the weights move between stages for it at every step."""
  rest = jax.typeof(p_N).sharding.spec[1:]
  whole = jax.sharding.reshard(p_N, P(None, *rest))
  n = p_N.shape[0]
  blocks = whole.reshape(repeats, stages, n // (repeats * stages), *p_N.shape[1:]).swapaxes(0, 1)
  return jax.sharding.reshard(blocks.reshape(p_N.shape), P(STAGE, *rest))


def _microbatches(x_B: jax.Array, m: int) -> jax.Array:
  """(B, ...) -> (M, B / M, ...): microbatch i holds rows i, i + M, ..., so each device keeps its rows."""
  spec = tuple(jax.typeof(x_B).sharding.spec) + (None,) * x_B.ndim
  split = jnp.reshape(x_B, (x_B.shape[0] // m, m, *x_B.shape[1:]),
                      out_sharding=P(spec[0], None, *spec[1:x_B.ndim]))
  return jnp.swapaxes(split, 0, 1)


def _whole(x_MB: jax.Array, rows: int) -> jax.Array:
  """The inverse of `_microbatches`."""
  x_BM = jnp.swapaxes(x_MB, 0, 1)
  spec = tuple(jax.typeof(x_BM).sharding.spec) + (None,) * x_BM.ndim
  return jnp.reshape(x_BM, (rows, *x_BM.shape[2:]), out_sharding=P(spec[0], *spec[2:x_BM.ndim]))
