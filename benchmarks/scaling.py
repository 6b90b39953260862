#!/usr/bin/env python
"""Whether the train step's cost grows with its FLOPs: bench_tiny at more layers and larger batches.

Each point is bench_tiny with `model.num_layers` or `train.global_batch_size` changed, built, compiled
ahead and timed as `step.py` times a variant (medians of jitted steps after warm-up, a matmul calibration
after each step). Against the first point of its series it reports how much the step time grew
(`time_x`), how much the analytic model FLOPs grew (`flops_x`, `report.train_flops_per_step`), and their
quotient `time_x / flops_x`: 1.00 is linear in FLOPs, above 1 the added work runs slower than the first
point's. `ratio` is the step's model FLOP/s over the matmul rate, as in `step.py`: it should not fall as
the model deepens.

With `--interleave`, every point of a series is compiled first and the points are timed in turns (one
step of each, then a calibration, then again), so a machine whose speed drifts over the minutes a series
takes slows every point alike: `time_x` is then the median over turns of the point's step over the first
point's step of the same turn, `ratio` pairs each step with its turn's calibration, and `cores_busy` is the
process's CPU seconds over a step's wall seconds (median; below the cores, they sat idle while devices
waited on each other at a collective). The series' models share the memory.

  python benchmarks/scaling.py                          # 4, 8, 16, 32 layers; batch 16, 32, 64 (~15 min)
  python benchmarks/scaling.py --layers 4 8 --batches   # depth only, two points
  python benchmarks/scaling.py --interleave --batches   # depth only, the points timed in turns
  python benchmarks/scaling.py --smoke                  # the tests' small model, 1 and 2 layers, one step
"""

from __future__ import annotations

import argparse
import statistics
import sys

import harness

from mintrain import report


def measure(t: harness.Timing, overrides: tuple[str, ...], devices) -> dict:
  """One point: median step seconds, model FLOPs per step, and the median ratio to the matmul rate."""
  config = harness.load(t.path, (*t.base, *overrides))
  m = harness.against_matmul(t, config, devices)
  return {'step_s': statistics.median(m.times), 'spread': harness.spread(m.times),
          'flops': report.train_flops_per_step(config), 'ratio': m.ratio, 'compile_s': m.compile_s}


def measure_in_turns(t: harness.Timing, points: list[tuple[str, ...]], devices) -> list[dict]:
  """Every point compiled first, then timed in turns with a calibration after each turn (`--interleave`):
  as `measure`, with `time_x` the median over turns of the step over the first point's of the same turn."""
  configs = [harness.load(t.path, (*t.base, *overrides)) for overrides in points]
  runs = [harness.prepare(config, devices) for config in configs]
  calibrations = []
  times = harness.time_interleaved(
      runs, warmup=t.warmup, steps=t.steps,
      after_turn=lambda: calibrations.append(harness.matmul_tflops(t, configs[0], devices)))
  first = times[0].wall
  measured = []
  for config, (compiled, built, _), steps in zip(configs, runs, times):
    tflop = harness.model_tflop(config, built)
    measured.append({'step_s': statistics.median(steps.wall), 'spread': harness.spread(steps.wall),
                     'flops': report.train_flops_per_step(config), 'compile_s': compiled.total_s,
                     'time_x': statistics.median(s / f for s, f in zip(steps.wall, first)),
                     'ratio': statistics.median(tflop / s / c for s, c in zip(steps.wall, calibrations)),
                     'cores_busy': steps.cores_busy()})
  return measured


def series_rows(name: str, key: str, values: list[int], points: list[dict]) -> list[list[str]]:
  first = points[0]
  rows = []
  for value, p in zip(values, points):
    time_x = p.get('time_x', p['step_s'] / first['step_s'])
    flops_x = p['flops'] / first['flops']
    rows.append([name, f'{key}={value}', f'{p["compile_s"]:.1f}', f'{p["step_s"] * 1e3:.1f}', p['spread'],
                 f'{p["flops"] / 1e9:.1f}', f'{time_x:.2f}', f'{flops_x:.2f}', f'{time_x / flops_x:.2f}',
                 f'{p["ratio"]:.1%}', f'{p["cores_busy"]:.2f}' if 'cores_busy' in p else '-'])
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser, 'config override applied to every point; repeatable')
  parser.add_argument('--layers', nargs='*', type=int, default=[4, 8, 16, 32],
                      help='model.num_layers of the depth series (none: skip it)')
  parser.add_argument('--batches', nargs='*', type=int, default=[16, 32, 64],
                      help='train.global_batch_size of the batch series (none: skip it)')
  parser.add_argument('--interleave', action='store_true',
                      help="compile a series' points first, then time them in turns")
  harness.timing_arguments(parser, 4, "the tests' small model, 1 and 2 layers")
  args = parser.parse_args()

  devices = harness.start_devices()
  t = harness.timing(args)
  layers, batches = ([1, 2], []) if args.smoke else (args.layers, args.batches)
  series = [('depth', 'model.num_layers', layers), ('batch', 'train.global_batch_size', batches)]
  rows = []
  for name, key, values in series:
    if not values:
      continue
    if args.interleave:
      points = measure_in_turns(t, [(f'{key}={value}',) for value in values], devices)
    else:
      points = []
      for value in values:
        points.append(measure(t, (f'{key}={value}',), devices))
        print(f'measured {key}={value}', flush=True)
    rows += series_rows(name, key.split('.')[-1], values, points)
  timed = 'in turns, a calibration after each turn' if args.interleave else 'a calibration after each step'
  print(f'\nconfig {harness.describe_config(t.path, t.base)}; median of {t.steps} steps after {t.warmup} '
        f'warm-up per point, {timed}; x: against the first point of the series; ratio: model FLOP/s over '
        f'a {t.calibration_size}x{t.calibration_size} matmul rate\n')
  print(harness.table(['series', 'point', 'compile_s', 'step_ms', 'spread', 'GFLOP', 'time_x', 'flops_x',
                       'time_x / flops_x', 'ratio', 'cores_busy'], rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
