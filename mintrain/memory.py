"""Memory plan per device: what training will hold, known before anything is compiled.

Parameters, gradients and optimizer state are exact (their resolved layouts);
activations are the model family's estimate of what the backward pass keeps for
one micro-batch (`Family.activation_bytes`). XLA may keep less (it fuses) or
more (temporaries); the compiled step's own memory analysis is the final word,
and the benchmarks print it.
"""

from __future__ import annotations

import dataclasses

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
  device_limit: int | None  # What the device reports it can hold; None where it reports nothing.

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


def device_memory_limit(device: jax.Device) -> int | None:
  try:
    stats = device.memory_stats()
  except Exception:  # Some backends (CPU) do not implement it.
    return None
  return int(stats['bytes_limit']) if stats and 'bytes_limit' in stats else None


def plan(config: Config, rules: AxisRules, mesh: Mesh, layout: list[ParamInfo],
         abstract_state: TrainState) -> MemoryPlan:
  params = sum(p.bytes_per_device for p in layout)
  grads = params * (2 if config.train.grad_accum_steps > 1 else 1)  # Plus the accumulation buffer.
  return MemoryPlan(params=params, grads=grads,
                    opt_state=state_bytes_per_device(abstract_state.opt_state),
                    activations=activation_bytes(config, rules, mesh),
                    device_limit=device_memory_limit(mesh.devices.flat[0]))
