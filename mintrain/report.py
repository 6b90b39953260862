"""The sharding report and memory plan, printed by show_sharding.py and at the start of training."""

from __future__ import annotations

import math

from jax.sharding import Mesh

from mintrain import mesh as mesh_lib
from mintrain import partitioning
from mintrain.memory import MemoryPlan
from mintrain.train_state import ParamInfo, TrainState, state_bytes_per_device


def fmt_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if n < 1024 or unit == 'GiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  raise AssertionError


def format_plan(p: MemoryPlan) -> str:
  known = p.device_limit is not None
  limit = f'{fmt_bytes(p.device_limit)} ({p.limit_source})' if known else 'an unknown limit'
  return (f'memory plan per device: parameters {fmt_bytes(p.params)}, gradients {fmt_bytes(p.grads)}, '
          f'optimizer state {fmt_bytes(p.opt_state)}, activations ~{fmt_bytes(p.activations)}; '
          f'total ~{fmt_bytes(p.total)} of {limit}')


def format_report(layout: list[ParamInfo], abstract_state: TrainState, mesh: Mesh,
                  plan: MemoryPlan | None = None) -> str:
  """One row per parameter, then per-device totals and, given one, the memory plan."""
  header = ('parameter', 'global shape', 'logical axes', 'PartitionSpec', 'per-device shape', 'bytes/device')
  rows = [header] + [
      (p.path, str(p.shape), str(p.logical_axes), partitioning.format_spec(p.spec),
       str(p.shard_shape), fmt_bytes(p.bytes_per_device)) for p in layout]
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, '  '.join('-' * w for w in widths))
  n_params = sum(math.prod(p.shape) for p in layout)
  param_bytes = sum(p.bytes_per_device for p in layout)
  opt_bytes = state_bytes_per_device(abstract_state.opt_state)
  lines += ['',
            f'mesh {mesh_lib.describe(mesh.shape)} ({mesh.size} devices), {n_params:,} parameters',
            *filter(None, [mesh_lib.describe_levels(mesh)]),
            f'per device: parameters {fmt_bytes(param_bytes)}, optimizer state {fmt_bytes(opt_bytes)}, '
            f'total {fmt_bytes(param_bytes + opt_bytes)}']
  if plan is not None:
    lines.append(format_plan(plan))
  return '\n'.join(lines)
