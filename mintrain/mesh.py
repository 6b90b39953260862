"""The device mesh: axes `stage`, `data`, `fsdp`, `expert`, `context`, `model`, all Explicit, so a sharding
mismatch is a trace-time error. `model` is innermost (it talks every layer), then `context` and `expert`;
`stage` (pipeline stages) is outermost, as it talks least: one activation per microbatch to its neighbour.
Only the axes in SPANS_SLICES may cross slices (`slices`, MaxText's `dcn_*`): their collectives are few a
step."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from mintrain.errors import ConfigError, MeshError
from mintrain.fields import option
from mintrain.runtime import host_allocator

AXES = ('stage', 'data', 'fsdp', 'expert', 'context', 'model')
NAMED_IF_SPLIT = ('stage', 'expert', 'context')  # Axes that `describe` leaves out at size 1.
SPANS_SLICES = ('stage', 'data', 'fsdp')  # Axes whose ways may go across slices (`slices` of make_mesh).


def _mesh_size(value: int) -> str | None:
  return None if value >= 1 or value == -1 else 'must be a positive integer, or -1 for all remaining devices'


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The `mesh` section: ways of each axis."""

  stage: int = option(check=_mesh_size)
  data: int = option(check=_mesh_size)
  fsdp: int = option(check=_mesh_size)
  expert: int = option(check=_mesh_size)
  context: int = option(check=_mesh_size)
  model: int = option(check=_mesh_size)
  # Of those ways, how many go across slices (multi-slice); only the axes in SPANS_SLICES have one.
  dcn_stage: int = option(at_least=1)
  dcn_data: int = option(at_least=1)
  dcn_fsdp: int = option(at_least=1)

  def __post_init__(self):
    if list(self.sizes.values()).count(-1) > 1:
      raise ConfigError(f'mesh sizes may have one -1 (all remaining devices), not several; got '
                        f'{", ".join(f"mesh.{k}={v}" for k, v in self.sizes.items())}.')
    for axis, ways in self.slices.items():
      size = self.sizes[axis]
      if size != -1 and size % ways:
        raise ConfigError(f'mesh.dcn_{axis}={ways} must divide mesh.{axis}={size}: of its {size} ways, that '
                          'many go across slices and the rest stay within each.')

  @property
  def sizes(self) -> dict[str, int]:
    return {axis: getattr(self, axis) for axis in AXES}

  @property
  def slices(self) -> dict[str, int]:
    """Ways of each axis across slices (`make_mesh`)."""
    return {axis: getattr(self, f'dcn_{axis}') for axis in SPANS_SLICES}
_XLA_CPU_COUNT_FLAG = '--xla_force_host_platform_device_count'


def mesh_shape(sizes: Mapping[str, int], num_devices: int, platform: str = '') -> tuple[int, ...]:
  """Sizes in AXES order (a missing axis is 1), with one -1 filled by the remaining devices."""
  shape = [int(sizes.get(a, 1)) for a in AXES]
  described = describe(dict(zip(AXES, shape))).replace(' x ', ', ')
  where = f'{num_devices} {platform} devices'.replace('  ', ' ')
  if -1 in shape:
    fixed = math.prod(s for s in shape if s != -1)
    if num_devices % fixed:
      raise MeshError(f'Mesh ({described}) cannot fill {where}: {num_devices} % {fixed} != 0.')
    shape[shape.index(-1)] = num_devices // fixed
  if math.prod(shape) != num_devices:
    raise MeshError(
        f'Mesh ({described}) needs {math.prod(shape)} devices but there are {where}. '
        f'Make the product of {_sizes_named()} equal {num_devices}, '
        'or set one of them to -1.')
  return tuple(shape)


def _sizes_named() -> str:
  """`mesh.data, mesh.fsdp, ... and mesh.model`: the config keys of the mesh sizes."""
  keys = [f'mesh.{a}' for a in AXES]
  return ', '.join(keys[:-1]) + ' and ' + keys[-1]


def devices_needed(sizes: Mapping[str, int], default: int = 8) -> int:
  """How many devices a mesh asks for; `default` when one size is -1."""
  shape = [int(sizes.get(a, 1)) for a in AXES]
  return default if -1 in shape else math.prod(shape)


def simulate_cpu_devices(count: int) -> None:
  """Asks JAX for `count` CPU devices, and tunes the host allocator if the run will use the CPU
  backend (`host_allocator.keep_freed_memory_if_cpu`).

  Call before the JAX backend starts: once it has, JAX refuses a new count, and this returns without
  changing anything. A count chosen already, with `jax_num_cpu_devices` (JAX_NUM_CPU_DEVICES) or
  XLA_FLAGS=--xla_force_host_platform_device_count, is kept. Only JAX's CPU backend reads the count:
  on a GPU or TPU host the accelerators stay the default devices, with `count` CPU devices beside them.
  """
  if jax.config.jax_num_cpu_devices < 0 and _XLA_CPU_COUNT_FLAG not in os.environ.get('XLA_FLAGS', ''):
    try:
      jax.config.update('jax_num_cpu_devices', count)
    except RuntimeError:  # The backend has started.
      return
  host_allocator.keep_freed_memory_if_cpu()


def pick_devices(count: int | None, devices: Sequence[jax.Device] | None = None
                 ) -> tuple[list[jax.Device], str | None]:
  """`count` devices of the backend in use (`jax.devices()`), or all of them for None (a -1 size).

  Returns the devices and a one-line note on what was chosen. An accelerator host never falls back to
  simulated CPU devices (a mesh that runs 8 CPU devices beside 4 GPUs is found out from the bill):
  too few devices is a `MeshError` naming those found and the fix. CPU devices are simulated only
  when the CPU backend is the one in use (a CPU-only host, or JAX_PLATFORMS=cpu).
  """
  devices = list(jax.devices() if devices is None else devices)
  platform, processes = devices[0].platform, len({d.process_index for d in devices})
  where = f'{len(devices)} {platform} device(s)' + (f' over {processes} processes' if processes > 1 else '')
  if count is not None and len(devices) < count:
    fix = ('set JAX_NUM_CPU_DEVICES (or XLA_FLAGS=--xla_force_host_platform_device_count) to '
           f'{count // processes} per process, or unset it' if platform == 'cpu'
           else f'set JAX_PLATFORMS=cpu to simulate {count} CPU devices instead')
    raise MeshError(f'The mesh needs {count} devices but this run has {where}. Make the product of '
                    f'{_sizes_named()} {len(devices)}, set one of them to -1 to use them '
                    f'all, or {fix}.')
  devices = devices if count is None else devices[:count]
  if platform != 'cpu' or (len(devices) == 1 and processes == 1):
    return devices, None
  if processes > 1:
    return devices, (f'{processes} processes with {len(devices) // processes} {platform} device(s) each, '
                     f'{len(devices)} in all.')
  return devices, f'No accelerator in use: simulating {len(devices)} CPU devices.'


def make_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None,
              slices: Mapping[str, int] | None = None) -> Mesh:
  """An Explicit-axes mesh over `devices` (default: all devices of the default backend).

  `slices` (axis -> ways across slices, default 1 each) lays the mesh over several slices
  (`device_grid`). The `model` axis, innermost, must stay within a process (host): its collectives run
  every layer.
  """
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(sizes, len(devices), devices[0].platform)
  dcn = slice_shape(shape, slices)
  if math.prod(dcn) == 1:
    mesh = jax.make_mesh(shape, AXES, axis_types=(AxisType.Explicit,) * len(AXES), devices=devices)
  else:
    mesh = Mesh(device_grid(shape, dcn, devices), AXES, axis_types=(AxisType.Explicit,) * len(AXES))
  for group in mesh.devices.reshape(-1, shape[-1]):
    if len({d.process_index for d in group}) > 1:
      raise MeshError(f'Mesh ({describe(mesh.shape)}) puts one `model` group on several processes; make '
                      f'mesh.model divide the {jax.local_device_count()} devices of each process.')
  return mesh


def slice_shape(shape: Sequence[int], slices: Mapping[str, int] | None) -> tuple[int, ...]:
  """Ways of each axis (AXES order) across slices; each must divide its axis's size in `shape`."""
  slices = dict(slices or {})
  crossing = [a for a, n in slices.items() if n != 1 and a not in SPANS_SLICES]
  if crossing:
    raise MeshError(f'Only {", ".join(SPANS_SLICES)} may span slices, not {", ".join(crossing)}: its '
                    'collectives run every layer and need the fast interconnect within a slice.')
  dcn = tuple(int(slices.get(a, 1)) for a in AXES)
  for axis, size, ways in zip(AXES, shape, dcn):
    if size % ways:
      raise MeshError(f'mesh.{axis}={size} cannot go {ways} ways across slices (mesh.dcn_{axis}={ways}): '
                      f'{size} % {ways} != 0. Make mesh.{axis} a multiple of {ways}.')
  return dcn


def granule_kind(devices: Sequence[jax.Device]) -> str:
  """What joins these devices over the data-centre network: 'slice' where they sit in several TPU (or
  other) slices, else 'process' (hosts; CPU and GPU devices of one job all report slice 0, if any)."""
  return 'slice' if len({getattr(d, 'slice_index', 0) for d in devices}) > 1 else 'process'


def granule(device: jax.Device, kind: str) -> int:
  return device.slice_index if kind == 'slice' else device.process_index


def device_grid(shape: Sequence[int], dcn: Sequence[int], devices: Sequence[jax.Device]) -> np.ndarray:
  """Devices in a grid of `shape` whose axes are split `dcn` ways across slices, the slice being the
  outer factor of each axis (JAX's hybrid mesh): within a slice, each axis has shape // dcn ways."""
  kind = granule_kind(devices)
  granules = {granule(d, kind) for d in devices}
  if len(granules) != math.prod(dcn):
    across = ' x '.join(f'mesh.dcn_{a}={n}' for a, n in zip(AXES, dcn) if n > 1)
    raise MeshError(f'The mesh goes across {math.prod(dcn)} slices ({across}), but its {len(devices)} '
                    f'devices are in {_count(len(granules), kind)}. Make the product of the mesh.dcn_* sizes '
                    f'{len(granules)}.')
  ici = [size // ways for size, ways in zip(shape, dcn)]
  return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=kind == 'process')


def levels(mesh: Mesh) -> tuple[str, int, dict[str, int]] | None:
  """(granule kind, count, ways of each axis across granules) of a mesh over several slices or
  processes, read from where its devices are; None when it has one."""
  grid = mesh.devices
  kind = granule_kind(list(grid.flat))
  count = len({granule(d, kind) for d in grid.flat})
  if count == 1:
    return None
  origin = (0,) * grid.ndim
  across = {}
  for i, name in enumerate(mesh.axis_names):
    line = grid[origin[:i] + (slice(None),) + origin[i + 1:]]
    across[name] = len({granule(d, kind) for d in line})
  return kind, count, across


def describe(shape: Mapping[str, int]) -> str:
  """`data=4 x fsdp=1 x model=2` for a mesh's `shape`, or the sizes a checkpoint saved; `stage`, `expert`
  and `context` are named only when they split (`data=2 x fsdp=1 x expert=4 x model=1`), so meshes without
  them read as before."""
  return ' x '.join(f'{name}={size}' for name, size in shape.items()
                    if name not in NAMED_IF_SPLIT or size != 1)


def _count(n: int, kind: str) -> str:
  return f'{n} {kind}' + ('' if n == 1 else 'es' if kind == 'process' else 's')


def describe_levels(mesh: Mesh) -> str:
  """Both levels of a mesh over several slices or processes, as the report prints them; '' for one."""
  found = levels(mesh)
  if found is None:
    return ''
  kind, count, across = found
  within = {name: size // across[name] for name, size in mesh.shape.items()}
  return (f'across {_count(count, kind)} (DCN): {describe(across)}; '
          f'within each (ICI): {describe(within)}')
