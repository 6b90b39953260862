"""Memory plan per device: what training will hold, known before anything is compiled.

Parameters, gradients and optimizer state are exact (their resolved layouts);
activations are the model family's estimate of what the backward pass keeps for
one micro-batch (`Family.activation_bytes`). XLA may keep less (it fuses) or
more (temporaries); the compiled step's own memory analysis is the final word,
and the benchmarks print it.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax.sharding import Mesh

from mintrain.config import Config
from mintrain.partitioning import AxisRules
from mintrain.train_state import ParamInfo, TrainState, state_bytes_per_device


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  params: int
  grads: int
  opt_state: int
  activations: int
  device_limit: int | None  # What one device can hold; None where that is unknown.
  limit_source: str = 'device memory'

  @property
  def total(self) -> int:
    return self.params + self.grads + self.opt_state + self.activations

  @property
  def fits(self) -> bool:
    return self.device_limit is None or self.total <= self.device_limit


def activation_bytes(config: Config, rules: AxisRules, mesh: Mesh) -> int:
  """Estimated activations kept for the backward pass of one micro-batch, per device."""
  rows = config.train.micro_batch_size // rules.ways('batch', mesh.shape)
  return config.family.activation_bytes(config.model, rows, config.train.seq_len,
                                        lambda name: rules.ways(name, mesh.shape))


class MemoryPlanError(ValueError):
  """A memory plan larger than the devices hold: refused before anything is allocated."""


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
        limit = open(path).read().strip()
      except OSError:
        continue
      if limit.isdigit():
        available = min(available, int(limit))
  return available


def check(p: MemoryPlan) -> None:
  """Raises `MemoryPlanError` when the plan exceeds the limit: a clear refusal instead of an OOM later."""
  if not p.fits:
    from mintrain.report import fmt_bytes
    raise MemoryPlanError(
        f'the memory plan needs {fmt_bytes(p.total)} per device (parameters {fmt_bytes(p.params)}, '
        f'gradients {fmt_bytes(p.grads)}, optimizer {fmt_bytes(p.opt_state)}, activations '
        f'{fmt_bytes(p.activations)}) but a device holds {fmt_bytes(p.device_limit)} ({p.limit_source}). '
        'Lower train.global_batch_size, raise train.grad_accum_steps, or shard more (mesh.fsdp, mesh.model).')


def plan(config: Config, rules: AxisRules, mesh: Mesh, layout: list[ParamInfo],
         abstract_state: TrainState) -> MemoryPlan:
  params = sum(p.bytes_per_device for p in layout)
  grads = params * (2 if config.train.grad_accum_steps > 1 else 1)  # Plus the accumulation buffer.
  limit, source = device_memory_limit(mesh.devices.flat[0])
  return MemoryPlan(params=params, grads=grads,
                    opt_state=state_bytes_per_device(abstract_state.opt_state),
                    activations=activation_bytes(config, rules, mesh), device_limit=limit,
                    limit_source=source)
