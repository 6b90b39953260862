"""What the step benchmarks share: build the run exactly as `train_loop.run` does (`mintrain.build`), compile
the step, time it.

Every number is taken with `jax.block_until_ready`, after compiling ahead (`lower(...).compile()`, as the
loop does), so compile time and step time are reported apart. Batches are made before the timed steps:
synthetic data costs nothing to read, so a step time is the model's alone.

Config keys that not every checkout has yet (`model.scan_layers`, `model.remat`, ...) are probed with
`missing_keys`; a benchmark skips a variant that needs one, with a printed note, instead of failing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import pathlib
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from itertools import cycle

import jax
import ml_collections
from jax.sharding import Mesh

from mintrain import config as config_lib
from mintrain import configs, train_state
from mintrain import mesh as mesh_lib
from mintrain.build import Run
from mintrain.build import build as mintrain_build
from mintrain.config import Config
from mintrain.configs import test_small
from mintrain.data import tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
DEVICES = 8
# Untimed steps before timing: on CPU the host heap takes a few steps to reach its steady size
# (mintrain.runtime.host_allocator), and the steps before that page-fault.
WARMUP = 6
BENCH_TINY = configs.DIR / 'bench_tiny.py'  # The model for step time and overhead.
FALLBACK = configs.DIR / 'dp4_tp2.py'
# --smoke: the tests' small model (mintrain/configs/test_small.py) with 256 ids and 2 heads of 16.
SMOKE = (*test_small.OVERRIDES, 'model.vocab_size=256', 'model.num_heads=2', 'model.head_dim=16')


def config_arguments(parser: argparse.ArgumentParser, override_help: str = 'config override; repeatable'):
  """The --config / --override pair every model benchmark takes."""
  parser.add_argument('--config', type=pathlib.Path, default=None,
                      help='config file (default: mintrain/configs/bench_tiny.py)')
  parser.add_argument('--override', action='append', default=[], metavar='KEY=VALUE', help=override_help)


def timing_arguments(parser: argparse.ArgumentParser, steps: int, smoke_help: str) -> None:
  """The --steps / --warmup / --calibration_size / --smoke of the benchmarks that time steps against a
  matmul calibration."""
  parser.add_argument('--steps', type=int, default=steps, help='timed steps per measurement')
  parser.add_argument('--warmup', type=int, default=WARMUP, help='untimed steps after compiling')
  parser.add_argument('--calibration_size', type=int, default=1024, help='square matmul size')
  parser.add_argument('--smoke', action='store_true', help=smoke_help)


@dataclasses.dataclass(frozen=True)
class Timing:
  """What `timing_arguments` asked for: the config, its overrides, and how to time and calibrate."""
  path: pathlib.Path
  base: tuple[str, ...]  # Overrides on every measurement (the fallback's, --override, the smoke's).
  steps: int
  warmup: int
  calibration_size: int
  calibration_s: float


def timing(args: argparse.Namespace) -> Timing:
  """The config (`--config` or bench_tiny) and timing of `config_arguments` and `timing_arguments`."""
  path, base = bench_tiny() if args.config is None else (args.config.resolve(), ())
  base = base + tuple(args.override) + (SMOKE if args.smoke else ())
  if args.smoke:
    return Timing(path, base, 1, 1, 256, 0.2)
  return Timing(path, base, args.steps, args.warmup, args.calibration_size, 1.0)


@dataclasses.dataclass(frozen=True)
class AgainstMatmul:
  """A config's step timed with a matmul calibration after each step (`against_matmul`)."""
  built: Run
  compile_s: float
  times: list[float]
  losses: list[float]
  calibrations: list[float]  # TFLOP/s of a square matmul in the model's dtype, one after each timed step.
  tflop: float  # Model TFLOP per step per device; on the CPU per host (its simulated devices share it).

  @property
  def ratio(self) -> float:
    """Median over steps of the step's model FLOP/s over the calibration after it."""
    return statistics.median(self.tflop / t / c for t, c in zip(self.times, self.calibrations))


def against_matmul(t: Timing, config: Config, devices: Sequence[jax.Device]) -> AgainstMatmul:
  """Builds and compiles `config`'s step and times it as `t` says, each timed step followed by a matmul
  calibration: other load on a shared machine slows both alike."""
  compiled, built, batches = prepare(config, devices)
  calibrations = []

  def calibrate() -> None:
    calibrations.append(matmul_tflops(t, config, devices))
  times, losses = time_steps(compiled, built, batches, warmup=t.warmup, steps=t.steps, after_step=calibrate)
  return AgainstMatmul(built, compiled.total_s, times, losses, calibrations, model_tflop(config, built))


def matmul_tflops(t: Timing, config: Config, devices: Sequence[jax.Device]) -> float:
  """TFLOP/s of `t`'s square matmul calibration in the config's compute dtype, on the first device."""
  from mintrain.runtime import hardware
  return hardware.measure_matmul_tflops(config.model.compute_dtype, size=t.calibration_size,
                                        seconds=t.calibration_s, device=devices[0])


def per_device(tflop: float, mesh: Mesh) -> float:
  """A step's TFLOP over all of `mesh` per device; on the CPU per host (its simulated devices share it)."""
  return tflop / (1 if mesh.devices.flat[0].platform == 'cpu' else mesh.size)


def model_tflop(config: Config, built: Run) -> float:
  """Model TFLOP per step per device; on the CPU per host."""
  from mintrain import report
  return per_device(report.train_flops_per_step(config) / 1e12, built.mesh)


_CHECKOUTS: list[str] = []  # The sys.path entries `checkout` added.


def checkout(tree: pathlib.Path) -> types.ModuleType:
  """This module again, importing mintrain from `tree` (a checkout of the repository): the mintrain modules
  imported so far are dropped, so that several checkouts' steps compile in one process and run in turns
  (`time_interleaved`), under the same load and allocator. What was compiled before keeps working; the
  checkout must have the API this module calls (a nearby commit)."""
  for name in [name for name in sys.modules if name == 'mintrain' or name.startswith('mintrain.')]:
    del sys.modules[name]
  sys.path[:] = [entry for entry in sys.path if entry not in _CHECKOUTS]
  _CHECKOUTS.append(str(tree.resolve()))
  sys.path.insert(0, _CHECKOUTS[-1])
  importlib.invalidate_caches()
  spec = importlib.util.spec_from_file_location(f'harness_{len(_CHECKOUTS)}', __file__)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Its dataclasses look their module up.
  spec.loader.exec_module(module)
  return module


def start_devices() -> list[jax.Device]:
  """The 8 devices the meshes use, simulated on CPU without an accelerator; call before any jax query."""
  mesh_lib.simulate_cpu_devices(DEVICES)
  devices, note = mesh_lib.pick_devices(DEVICES)
  if note:
    print(note, flush=True)
  return devices


def bench_tiny() -> tuple[pathlib.Path, tuple[str, ...]]:
  """(config path, overrides): the bench_tiny config, or dp4_tp2 on a checkout that does not have it."""
  if BENCH_TINY.is_file():
    return BENCH_TINY, ()
  print(f'note: {BENCH_TINY.relative_to(REPO)} does not exist; using {FALLBACK.relative_to(REPO)} '
        'with synthetic data', flush=True)
  return FALLBACK, ('data.source=synthetic',)


def missing_keys(path: pathlib.Path, overrides: Sequence[str]) -> list[str]:
  """The keys of `overrides` that the config at `path` does not have."""
  config = config_lib.load(path)
  missing = []
  for item in overrides:
    node = config
    for name in item.partition('=')[0].split('.'):
      if not isinstance(node, ml_collections.ConfigDict) or name not in node:
        missing.append(item.partition('=')[0])
        break
      node = node[name]
  return missing


def load(path: pathlib.Path, overrides: Sequence[str]) -> Config:
  return config_lib.resolve(config_lib.validate(config_lib.load(path, tuple(overrides))))[0]


def build(config: Config, devices: Sequence[jax.Device]) -> Run:
  """The config's run, as the training loop builds it, on the first devices its mesh needs."""
  return mintrain_build(config, list(devices)[:mesh_lib.devices_needed(config.mesh.sizes)])


def device_batches(built: Run, count: int) -> list[dict[str, jax.Array]]:
  """`count` global batches, already on their devices."""
  with jax.set_mesh(built.mesh):
    batches = built.batches(tokenizer.load(built.config.data.tokenizer))
    return [jax.block_until_ready(next(batches)) for _ in range(count)]


@dataclasses.dataclass
class Compiled:
  compiled: object  # jax.stages.Compiled of the train step.
  state: train_state.TrainState  # Freshly initialised; the first call donates it.
  lower_s: float  # Tracing and lowering to StableHLO.
  compile_s: float  # XLA compilation.

  @property
  def total_s(self) -> float:
    return self.lower_s + self.compile_s


def prepare(config: Config, devices: Sequence[jax.Device], count: int = 2
            ) -> tuple[Compiled, Run, list[dict[str, jax.Array]]]:
  """(compiled step, run, batches): the config's run built, `count` batches on its devices and its step
  compiled, as `time_steps` and `time_interleaved` take them."""
  built = build(config, devices)
  batches = device_batches(built, count)
  return compile_step(built, batches[0]), built, batches


def compile_step(built: Run, batch: dict[str, jax.Array]) -> Compiled:
  """Initialises the state and compiles the step ahead, as `train_loop.run` does before step one."""
  with jax.set_mesh(built.mesh):
    state = jax.block_until_ready(built.init())
    start = time.perf_counter()
    lowered = built.train_step.lower(state, batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
  return Compiled(compiled, state, lowered_at - start, done - lowered_at)


def time_steps(compiled: Compiled, built: Run, batches: Sequence[dict[str, jax.Array]], *, warmup: int,
               steps: int, after_step: Callable[[], None] | None = None,
               trace: pathlib.Path | None = None) -> tuple[list[float], list[float]]:
  """(seconds of each timed step, loss of every step) of `warmup` untimed then `steps` timed steps.

  `after_step` runs after each timed step, outside its time (e.g. a calibration to pair with it). With
  `trace`, one more step runs under `jax.profiler`, its trace written under that directory.
  """
  state, times, losses = compiled.state, [], []
  with jax.set_mesh(built.mesh):
    for i, batch in zip(range(warmup + steps + (trace is not None)), cycle(batches)):
      traced = i == warmup + steps
      if traced:
        jax.profiler.start_trace(str(trace))
      start = time.perf_counter()
      state, metrics = compiled.compiled(state, batch)
      jax.block_until_ready((state, metrics))
      if traced:
        jax.profiler.stop_trace()
      elif i >= warmup:
        times.append(time.perf_counter() - start)
        if after_step is not None:
          after_step()
      losses.append(float(metrics['loss']))
  compiled.state = None  # Donated: the caller must not reuse it.
  return times, losses


@dataclasses.dataclass
class StepTimes:
  """Each timed step's wall seconds, and the process's CPU seconds (all threads) over it."""
  wall: list[float]
  cpu: list[float]

  def cores_busy(self) -> float:
    """Median over steps of CPU over wall seconds. Below the cores a step may use, cores sat idle: on
    simulated CPU devices, while the last devices ran on alone before a collective."""
    return statistics.median(c / w for c, w in zip(self.cpu, self.wall))


def time_interleaved(runs: Sequence[tuple[Compiled, Run, Sequence[dict[str, jax.Array]]]], *, warmup: int,
                     steps: int, after_turn: Callable[[], None] | None = None) -> list[StepTimes]:
  """The timed steps of every run, taken in turns (one step of each, then again): on a shared, noisy
  machine a load that comes and goes slows every variant alike. `after_turn` runs after each timed turn
  (e.g. a calibration to pair with it). Each run's state is donated."""
  states = [compiled.state for compiled, _, _ in runs]
  times = [StepTimes([], []) for _ in runs]
  for i in range(warmup + steps):
    for j, (compiled, built, batches) in enumerate(runs):
      with jax.set_mesh(built.mesh):
        start, cpu = time.perf_counter(), time.process_time()
        states[j], metrics = compiled.compiled(states[j], batches[i % len(batches)])
        jax.block_until_ready((states[j], metrics))
        if i >= warmup:
          times[j].wall.append(time.perf_counter() - start)
          times[j].cpu.append(time.process_time() - cpu)
    if i >= warmup and after_turn is not None:
      after_turn()
  for compiled, _, _ in runs:
    compiled.state = None
  return times


def memory_analysis(compiled: Compiled) -> dict[str, int]:
  """The compiler's own per-device buffer sizes of the step: arguments, outputs, aliased, temporaries."""
  m = compiled.compiled.memory_analysis()
  return {'argument': m.argument_size_in_bytes, 'output': m.output_size_in_bytes,
          'alias': m.alias_size_in_bytes, 'temp': m.temp_size_in_bytes}


def param_count(built: Run) -> int:
  return sum(math.prod(p.shape) for p in built.layout)


def describe_config(path: pathlib.Path, overrides: Sequence[str]) -> str:
  """`mintrain/configs/x.py key=value ...`, the way to ask for the same config on the command line."""
  shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
  return ' '.join([str(shown), *overrides])


def describe_mesh(mesh: Mesh) -> str:
  return 'x'.join(str(s) for s in mesh.shape.values()) + ' (' + mesh_lib.describe(mesh.shape) + ')'


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  """A Markdown table, so the output pastes into BENCHMARKS.md as it is."""
  lines = [list(header), ['---'] * len(header), *[list(r) for r in rows]]
  return '\n'.join('| ' + ' | '.join(cells) + ' |' for cells in lines)


def mib(n: float) -> str:
  return f'{n / 2**20:.2f}'


def spread(xs: Sequence[float]) -> str:
  """Min and max relative to the median, to judge noise on a shared machine."""
  m = statistics.median(xs)
  return f'{min(xs) / m:.2f}-{max(xs) / m:.2f}'


def first_device_bytes(tree) -> int:
  """Bytes that the first device really holds of a tree of arrays."""
  device = jax.tree.leaves(tree)[0].sharding.mesh.devices.flat[0]
  total = 0
  for x in jax.tree.leaves(tree):
    total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
  return total

