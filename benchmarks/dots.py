#!/usr/bin/env python
"""The ratio a step's matmuls allow: the step against programs of only its dots, timed in turns.

Every `dot` of the config's compiled train step (unrolled layers), at its own shapes and layouts, is
computed again on the same devices, each device its own (random operands), by one program per kind of dot
(`dots_programs`). The step and those programs are timed in turns in one process, each turn followed by
the matmul calibration of `step.py`. `of the step` is the share of the step its matmuls would take at
their own pace; the dots' ratio is the one the step would reach if everything else (norms, softmax,
activations, the optimizer, collectives) took no time. XLA runs a program's independent dots side by side,
which the step's chain of layers cannot, so the bound is generous.

  python benchmarks/dots.py                      # bench_tiny
  python benchmarks/dots.py --override model.num_layers=16
  python benchmarks/dots.py --kinds              # and each kind of dot's time and ratio, slowest first
  python benchmarks/dots.py --smoke              # tiny model, one turn: it still runs
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import harness
import jax
import jax.numpy as jnp
import numpy as np
import op_profile
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class Program(NamedTuple):
  """A jitted program computing `count` dots of one kind (shapes and dimension numbers) on each device."""
  run: Callable
  operands: list[jax.Array]
  kind: tuple  # (lhs shape, rhs shape, dimension numbers), as `op_profile.Dot` gives them.
  count: int
  gflop: float  # Of its `count` dots on one device.


def dots_programs(found: list[op_profile.Dot], devices: list[jax.Device], dtype) -> list[Program]:
  """One program for each kind of dot of `found`, computing all of that kind's on each of `devices`; run
  one after the other, they do what the step's dots do, and a deep model's products need not all fit in
  memory at once.

  The n dots of a kind read n windows of one buffer per operand, a row apart: distinct values, so that XLA
  cannot merge equal dots, without n copies of the operands (each window's copy costs a pass over it, far
  less than its matmul)."""
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  split = NamedSharding(mesh, P('d'))
  kinds = collections.Counter((d.lhs, d.rhs, d.dimension_numbers) for d in found)
  gflop = {(d.lhs, d.rhs, d.dimension_numbers): d.gflop for d in found}
  programs = []
  for i, ((lhs, rhs, numbers), n) in enumerate(sorted(kinds.items())):
    def body(lhs_buffer, rhs_buffer, lhs=lhs, rhs=rhs, numbers=numbers, n=n):
      return [jax.lax.dot_general(jax.lax.slice_in_dim(lhs_buffer[0], j, j + lhs[0]),
                                  jax.lax.slice_in_dim(rhs_buffer[0], j, j + rhs[0]), numbers,
                                  preferred_element_type=jnp.float32)[None] for j in range(n)]
    keys = jax.random.split(jax.random.key(i), 2)
    buffers = [jax.device_put(jax.random.normal(key, (len(devices), shape[0] + n - 1, *shape[1:]), dtype),
                              split) for key, shape in zip(keys, (lhs, rhs))]
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P('d'), out_specs=P('d')))
    programs.append(Program(program, buffers, (lhs, rhs, numbers), n, gflop[lhs, rhs, numbers] * n))
  return programs


def kinds_table(programs: list[Program], mesh: jax.sharding.Mesh, turns: int,
                calibration: float) -> list[list[str]]:
  """Each kind's median time over `turns` calls (compiled already), its share of all the kinds' and its
  ratio to `calibration` (TFLOP/s), slowest kind first: which of the step's products run below the matmul
  rate."""
  timed = []
  for program in programs:
    seconds = []
    for _ in range(turns):
      start = time.perf_counter()
      jax.block_until_ready(program.run(*program.operands))
      seconds.append(time.perf_counter() - start)
    tflop = harness.per_device(program.gflop * mesh.size / 1e3, mesh)
    timed.append((statistics.median(seconds), program.kind, program.count, tflop))
  total = sum(s for s, *_ in timed)
  return [[f'{s * 1e3:,.1f}', f'{s / total:.1%}', f'{n}', f'{lhs}', f'{rhs}', f'{numbers}',
           f'{tflop / s / calibration:.1%}']
          for s, (lhs, rhs, numbers), n, tflop in sorted(timed, reverse=True)]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser)
  harness.timing_arguments(parser, 8, 'tiny model, one turn')
  parser.add_argument('--kinds', action='store_true', help="each kind of dot's time and ratio as well")
  args = parser.parse_args()
  devices = harness.start_devices()
  t = harness.timing(args)
  config = harness.load(t.path, t.base)
  compiled, built, batches = harness.prepare(config, devices)
  found = op_profile.dots(compiled.compiled.as_text())
  mesh_devices = list(built.mesh.devices.flat)
  programs = dots_programs(found, mesh_devices, jnp.dtype(config.model.compute_dtype))
  state = compiled.state

  def step() -> float:
    nonlocal state
    start = time.perf_counter()
    state, metrics = compiled.compiled(state, batches[0])
    jax.block_until_ready((state, metrics))
    return time.perf_counter() - start

  def dots() -> float:
    start = time.perf_counter()
    for program in programs:
      jax.block_until_ready(program.run(*program.operands))
    return time.perf_counter() - start

  for _ in range(t.warmup):
    step(), dots()
  turns = [(step(), dots(), harness.matmul_tflops(t, config, devices)) for _ in range(t.steps)]
  model = harness.model_tflop(config, built)
  dot_tflop = harness.per_device(sum(d.gflop for d in found) * built.mesh.size / 1e3, built.mesh)
  print(f'config {harness.describe_config(t.path, t.base)}')
  print(f'mesh {harness.describe_mesh(built.mesh)}: {len(found)} dots per device, '
        f'{dot_tflop * 1e3:.2f} GFLOP (the analytic count: {model * 1e3:.2f}); median of {t.steps} turns '
        f'after {t.warmup} warm-up; ratio = FLOP/s over the matmul calibration after each turn\n')
  steps, alone, calibrations = zip(*turns)
  median = statistics.median
  print(harness.table(['program', 'ms', 'spread', 'of the step', 'ratio'], [
      ['the train step', f'{median(steps) * 1e3:,.1f}', harness.spread(steps), '1.00',
       f'{median(model / s / c for s, c in zip(steps, calibrations)):.1%}'],
      ['its dots alone', f'{median(alone) * 1e3:,.1f}', harness.spread(alone),
       f'{median(d / s for s, d in zip(steps, alone)):.2f}',
       f'{median(dot_tflop / d / c for d, c in zip(alone, calibrations)):.1%}']]))
  if args.kinds:
    print('\nEach kind of dot alone (one program each, the median of as many calls as turns), against the '
          'median calibration:\n')
    print(harness.table(['ms', 'share', 'dots', 'lhs', 'rhs', 'dimension numbers', 'ratio'],
                        kinds_table(programs, built.mesh, t.steps, median(calibrations))))
  return 0


if __name__ == '__main__':
  sys.exit(main())
