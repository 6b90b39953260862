#!/usr/bin/env python
"""Pipeline parallelism: step time at 1, 2 and 4 stages with 2, 4 and 8 microbatches, against the bubble the
schedule predicts, and the activation memory of one device.

All eight devices run each configuration (`stage` x `data`), so every one does the same FLOPs per device:
a stage holds 1/S of the layers and S times the rows. Without a bubble the step would take as long as the
unpipelined one; the schedule predicts t(1 stage) / (1 - bubble), bubble = (S - 1) / (M + S - 1). The
`temp` column is XLA's temporary buffers per device (activations kept for the backward pass and
workspace), `plan` the memory plan's activation estimate.

  python benchmarks/pipeline.py           # 8 layers, 64 rows of 64 tokens (~10 min on 2 CPU cores)
  python benchmarks/pipeline.py --smoke   # a tiny model at 1 and 2 stages, 2 microbatches, one step
  python benchmarks/pipeline.py --override pipeline.repeats=2 --override model.remat=none \
      --stages 2 4 --microbatches 4   # the circular schedule's memory without remat

A point the config refuses (the circular schedule needs microbatches >= stages) is reported and skipped.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import harness

from mintrain import configs
from mintrain.errors import ConfigError

COMMON = ('data.source=synthetic', 'model.scan_layers=True', 'mesh.fsdp=1', 'mesh.model=1')
FULL = ('model.num_layers=8', 'train.global_batch_size=64', 'train.seq_len=64')


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--steps', type=int, default=3, help='timed steps per configuration')
  parser.add_argument('--smoke', action='store_true', help='tiny model, 1 and 2 stages, one step')
  parser.add_argument('--stages', type=int, nargs='+', default=None, help='stage counts (default 1 2 4)')
  parser.add_argument('--microbatches', type=int, nargs='+', default=None,
                      help='microbatch counts (default 2 4 8)')
  parser.add_argument('--override', action='append', default=[], metavar='KEY=VALUE',
                      help='config override applied to every point; repeatable')
  args = parser.parse_args()

  devices = harness.start_devices()
  path = configs.DIR / 'dp4_tp2.py'
  overrides = COMMON + ((*harness.SMOKE, 'model.num_layers=2') if args.smoke else FULL) + tuple(args.override)
  stages, microbatches = ((1, 2), (2,)) if args.smoke else ((1, 2, 4), (2, 4, 8))
  stages, microbatches = tuple(args.stages or stages), tuple(args.microbatches or microbatches)
  steps = 1 if args.smoke else args.steps

  results = {}  # (stages, microbatches) -> (step_s, bubble, temp bytes, plan bytes)
  for s in stages:
    for m in (microbatches if s > 1 else microbatches[:1]):  # One stage runs no schedule.
      mesh = (f'mesh.stage={s}', f'mesh.data={len(devices) // s}', f'pipeline.microbatches={m}')
      try:
        built = harness.build(harness.load(path, overrides + mesh), devices)
      except ConfigError as e:
        print(f'skipped {s} stage(s), {m} microbatches: {e}', flush=True)
        continue
      batches = harness.device_batches(built, 2)
      compiled = harness.compile_step(built, batches[0])
      temp = harness.memory_analysis(compiled)['temp']
      times, _ = harness.time_steps(compiled, built, batches, warmup=1, steps=steps)
      results[s, m] = (statistics.median(times), built.placement.pipeline.bubble, temp,
                       built.plan.activations)
      print(f'measured {s} stage(s), {m} microbatches', flush=True)

  if not results:
    print('no point of --stages x --microbatches is a valid config', file=sys.stderr)
    return 2
  # The fewest stages measured is the reference: its step without its bubble is the ideal step.
  first = min(results)
  ideal = results[first][0] * (1 - results[first][1])
  reference = '1 stage' if first[0] == 1 else f'{first[0]} x {first[1]}'
  header = ['stages', 'microbatches', 'bubble', 'predicted_ms', 'step_ms', f'step / {reference}',
            'temp_MiB', 'plan_MiB']
  rows = []
  for (s, m), (step, bubble, temp, plan) in results.items():
    rows.append([str(s), str(m) if s > 1 else '-', f'{bubble:.1%}', f'{ideal / (1 - bubble) * 1e3:.1f}',
                 f'{step * 1e3:.1f}', f'{step / results[first][0]:.2f}', harness.mib(temp),
                 harness.mib(plan)])
  print(f'\nconfig {harness.describe_config(pathlib.Path(path), overrides)}, mesh.stage x mesh.data = '
        f'{len(devices)} devices; median of {steps} steps after 1 warm-up\n')
  print(harness.table(header, rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
