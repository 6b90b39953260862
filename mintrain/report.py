"""What a run costs before it runs: a step's FLOPs (MaxText's convention: matmuls only, backward twice the
forward, causal scores halved; each family counts its own), the memory plan, the sharding report."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh

from mintrain import mesh as mesh_lib
from mintrain import partitioning
from mintrain.errors import MemoryPlanError
from mintrain.models.layers import LAYERS
from mintrain.models.pipeline import UNPIPELINED, Schedule
from mintrain.partitioning import AxisRules
from mintrain.train_state import ParamInfo, TrainState, state_bytes_per_device

if TYPE_CHECKING:  # Only for annotations: mintrain.config imports the sections' owners.
  from mintrain.config import Config


def tokens_per_step(config: Config) -> int:
  """Tokens (or examples, for a model whose rows are examples) per optimizer step, over all micro-batches and
  every sequence of a row (the objective's `sequences_per_row`)."""
  rows = config.train.global_batch_size * config.objective.sequences_per_row(config)
  return rows * config.model.tokens_per_row(config.train.seq_len)


def train_flops_per_step(config: Config, *, causal_half: bool = True) -> float:
  """Model FLOPs of one optimizer step over the whole global batch; divide by devices for per device.

  `causal_half=False` counts the attention scores the model computes (the whole matrix, or its blocks of
  queries'), as XLA does (and `cost_analysis()` reports). The objective's `flops_factor` counts what a
  row holds beyond one sequence trained (DPO's pair and its reference's forward passes).
  """
  per_row = config.model.train_flops_per_row(config.train.seq_len, causal_half)
  return per_row * config.objective.flops_factor(config) * config.train.global_batch_size


def param_count(config: Config) -> int:
  """Number of parameters of `config.model`, embedding (and unembedding) included."""
  return config.model.param_count()


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  params: int
  grads: int
  opt_state: int
  activations: int
  device_limit: int | None  # What one device can hold; None where that is unknown.
  limit_source: str = 'device memory'
  reference: int = 0  # The objective's frozen reference model in the state (DPO's), if it keeps one.
  pipeline: Schedule = UNPIPELINED  # The stages' schedule: parameters are one stage's, activations in flight.

  @property
  def total(self) -> int:
    return self.params + self.grads + self.opt_state + self.activations + self.reference

  @property
  def fits(self) -> bool:
    return self.device_limit is None or self.total <= self.device_limit


def activation_bytes(config: Config, rules: AxisRules, mesh: Mesh, pipeline: Schedule = UNPIPELINED) -> int:
  """Estimated activations kept for the backward pass of one micro-batch, per device (every sequence of a
  row: the objective's `sequences_per_row`). Pipelined, the model counts what the schedule's steps keep
  (a transformer's `activation_bytes`)."""
  rows = config.train.micro_batch_size // rules.ways('batch', mesh.shape)
  rows *= config.objective.sequences_per_row(config)
  staged = {'schedule': pipeline} if pipeline.stages > 1 else {}  # Only a family that pipelines takes it.
  return config.model.activation_bytes(rows, config.train.seq_len, lambda name: rules.ways(name, mesh.shape),
                                       **staged)


def device_memory_limit(device: jax.Device) -> tuple[int | None, str]:
  """(bytes one device can hold, what that is). CPU devices share the host's available memory."""
  if device.platform == 'cpu':
    available = host_available_bytes()
    local = sum(d.process_index == device.process_index for d in jax.devices('cpu'))
    return (None if available is None else available // local,
            f'host memory available ({available / 2**30:.1f} GiB) / {local} CPU devices' if available else '')
  try:
    stats = device.memory_stats()
  except Exception:  # Some backends do not implement it.
    return None, ''
  return (int(stats['bytes_limit']), 'device memory') if stats and 'bytes_limit' in stats else (None, '')


def host_available_bytes() -> int | None:
  """MemAvailable of /proc/meminfo, or the cgroup's memory limit if lower; None where neither is known."""
  try:
    with open('/proc/meminfo') as f:
      available = next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:'))
  except (OSError, StopIteration, ValueError):
    return None
  for path in ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes'):
    if os.path.exists(path):
      try:
        limit = pathlib.Path(path).read_text().strip()
      except OSError:
        continue
      if limit.isdigit():
        available = min(available, int(limit))
  return available


def check(p: MemoryPlan) -> None:
  """Raises `MemoryPlanError` when the plan exceeds the limit: a clear refusal instead of an OOM later."""
  if not p.fits:
    raise MemoryPlanError(
        f'the memory plan needs {fmt_bytes(p.total)} per device (parameters {fmt_bytes(p.params)}, '
        f'gradients {fmt_bytes(p.grads)}, optimizer {fmt_bytes(p.opt_state)}, activations '
        f'{fmt_bytes(p.activations)}{_reference(p)}) but a device holds {fmt_bytes(p.device_limit)} '
        f'({p.limit_source}). '
        'Lower train.global_batch_size, raise train.grad_accum_steps, or shard more (mesh.fsdp, mesh.model).')


def plan(config: Config, rules: AxisRules, mesh: Mesh, layout: list[ParamInfo],
         abstract_state: TrainState, pipeline: Schedule = UNPIPELINED) -> MemoryPlan:
  params = sum(p.bytes_per_device for p in layout)  # Frozen ones (LoRA's base) at their stored size.
  trainable = sum(p.bytes_per_device for p in layout if p.trainable)
  grads = trainable * (2 if config.train.grad_accum_steps > 1 else 1)  # Plus the accumulation buffer.
  limit, source = device_memory_limit(mesh.devices.flat[0])
  return MemoryPlan(params=params, grads=grads,
                    opt_state=state_bytes_per_device(abstract_state.opt_state),
                    activations=activation_bytes(config, rules, mesh, pipeline), device_limit=limit,
                    limit_source=source, reference=state_bytes_per_device(abstract_state.reference),
                    pipeline=pipeline)


def _reference(p: MemoryPlan) -> str:
  return f', reference model {fmt_bytes(p.reference)}' if p.reference else ''


def kv_cache_bytes(model: Any, batch: int, max_len: int, dtype: Any) -> int:
  """Bytes per device of the cache a sampler keeps (`model.init_cache`, under the current mesh) for `batch`
  rows of `max_len` positions: a local layer's window buffer at its own length. 0 for a model without one."""
  if not hasattr(model, 'init_cache'):
    return 0
  shapes = jax.eval_shape(lambda: model.init_cache(batch, max_len, dtype))
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def format_sampling_plan(params: int, cache_bytes: int, batch: int, max_len: int, device: jax.Device) -> str:
  """`sampling memory per device: parameters ..., KV cache ... (batch B, S positions); total ~... of ...`,
  from the bytes per device of the parameters and of the cache (`kv_cache_bytes`)."""
  limit, source = device_memory_limit(device)
  of = f'{fmt_bytes(limit)} ({source})' if limit is not None else 'an unknown limit'
  return (f'sampling memory per device: parameters {fmt_bytes(params)}, KV cache {fmt_bytes(cache_bytes)} '
          f'(batch {batch}, {max_len} positions); total ~{fmt_bytes(params + cache_bytes)} of {of}')


def fmt_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if n < 1024 or unit == 'GiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  raise AssertionError


def format_plan(p: MemoryPlan) -> str:
  known = p.device_limit is not None
  limit = f'{fmt_bytes(p.device_limit)} ({p.limit_source})' if known else 'an unknown limit'
  s = p.pipeline
  staged = ('' if s.stages == 1 else f' (one stage\'s layers; activations of the schedule\'s {s.iterations} '
            f'steps and one more, each a block of its layers on 1/{s.microbatches} of the rows)')
  return (f'memory plan per device{staged}: parameters {fmt_bytes(p.params)}, gradients '
          f'{fmt_bytes(p.grads)}, optimizer state {fmt_bytes(p.opt_state)}, activations '
          f'~{fmt_bytes(p.activations)}{_reference(p)}; total ~{fmt_bytes(p.total)} of {limit}')


def format_stages(layout: list[ParamInfo], pipeline: Schedule) -> str:
  """`pipeline: 2 stages x 2 repeats, 4 microbatches, bubble 20.0%; stage 0: layers 0-1, 4-5; ...`: which
  stage runs each stacked layer; '' without a pipeline."""
  s = pipeline
  stacked = [p.shape[0] for p in layout if p.logical_axes[:1] == (LAYERS,)]
  if s.stages == 1 or not stacked:
    return ''
  block = stacked[0] // (s.stages * s.repeats)
  blocks = {stage: [f'{b * block}-{(b + 1) * block - 1}' if block > 1 else str(b * block)
                    for b in range(stage, s.stages * s.repeats, s.stages)] for stage in range(s.stages)}
  repeats = f' x {s.repeats} repeats' if s.repeats > 1 else ''
  return (f'pipeline: {s.stages} stages{repeats}, {s.microbatches} microbatches, bubble {s.bubble:.1%}; '
          + '; '.join(f'stage {stage}: layers {", ".join(b)}' for stage, b in blocks.items()))


def format_activations(rules: partitioning.AxisRules, mesh: Mesh) -> str:
  """`activations split: batch over data (4 ways); mlp, heads over model (2 ways)`: the logical axes of
  activations that this mesh splits, grouped by their mesh axes; '' when none is."""
  groups: dict[tuple[str, ...], list[str]] = {}
  for name in dict.fromkeys(name for name, _ in rules.rules):
    axes = partitioning.spec_axes(rules.activation_spec((name,))[0])
    if rules.ways(name, mesh.shape) > 1:
      groups.setdefault(axes, []).append(name)
  parts = [f'{", ".join(names)} over {" x ".join(axes)} ({math.prod(mesh.shape[a] for a in axes)} ways)'
           for axes, names in groups.items()]
  return 'activations split: ' + '; '.join(parts) if parts else ''


def trainable_counts(layout: list[ParamInfo]) -> tuple[int, int]:
  """(trainable, all) parameter elements; a quantized base counts its codes (NF4's two a byte), not its
  block scales."""
  def elements(p: ParamInfo) -> int:
    return math.prod(p.shape) * (2 if p.path.endswith('.base') and str(p.dtype) == 'uint8' else 1)

  counted = [p for p in layout if not p.path.endswith('.absmax')]
  return sum(elements(p) for p in counted if p.trainable), sum(elements(p) for p in counted)


def trainable_summary(layout: list[ParamInfo]) -> str:
  """`trainable: N of M parameters (x%); frozen: ... per device (no gradients, no optimizer state)`."""
  trainable, total = trainable_counts(layout)
  frozen_bytes = sum(p.bytes_per_device for p in layout if not p.trainable)
  dtypes = ', '.join(sorted({str(p.dtype) for p in layout if not p.trainable}))
  return (f'trainable: {trainable:,} of {total:,} parameters ({trainable / total:.3%}); frozen: '
          f'{total - trainable:,}, {fmt_bytes(frozen_bytes)} per device as stored ({dtypes}), with no '
          'gradients and no optimizer state')


def format_report(layout: list[ParamInfo], abstract_state: TrainState, mesh: Mesh,
                  plan: MemoryPlan | None = None, rules: partitioning.AxisRules | None = None, *,
                  table: bool = True) -> str:
  """One row per parameter (with `table`), then per-device totals, and, given them, how activations are
  split and the memory plan."""
  lines = []
  if table:
    header = ('parameter', 'global shape', 'logical axes', 'PartitionSpec', 'per-device shape',
              'bytes/device')
    rows = [header] + [
        (p.path, str(p.shape), str(p.logical_axes), partitioning.format_spec(p.spec),
         str(p.shard_shape), fmt_bytes(p.bytes_per_device)) for p in layout]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines[1:1] = ['  '.join('-' * w for w in widths)]
    lines.append('')
  n_params = trainable_counts(layout)[1]
  param_bytes = sum(p.bytes_per_device for p in layout)
  opt_bytes = state_bytes_per_device(abstract_state.opt_state)
  frozen = [p for p in layout if not p.trainable]
  lines += [f'mesh {mesh_lib.describe(mesh.shape)} ({mesh.size} devices), {n_params:,} parameters',
            *([trainable_summary(layout)] if frozen else []),
            *filter(None, [mesh_lib.describe_levels(mesh), rules and format_activations(rules, mesh),
                           plan and format_stages(layout, plan.pipeline)]),
            f'per device: parameters {fmt_bytes(param_bytes)}, optimizer state {fmt_bytes(opt_bytes)}, '
            f'total {fmt_bytes(param_bytes + opt_bytes)}']
  if plan is not None:
    lines.append(format_plan(plan))
  return '\n'.join(lines)
