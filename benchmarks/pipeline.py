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
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import harness

from mintrain import configs

COMMON = ('data.source=synthetic', 'model.scan_layers=True', 'mesh.fsdp=1', 'mesh.model=1')
FULL = ('model.num_layers=8', 'train.global_batch_size=64', 'train.seq_len=64')


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--steps', type=int, default=3, help='timed steps per configuration')
  parser.add_argument('--smoke', action='store_true', help='tiny model, 1 and 2 stages, one step')
  args = parser.parse_args()

  devices = harness.start_devices()
  path = configs.DIR / 'dp4_tp2.py'
  overrides = COMMON + ((*harness.SMOKE, 'model.num_layers=2') if args.smoke else FULL)
  stages, microbatches = ((1, 2), (2,)) if args.smoke else ((1, 2, 4), (2, 4, 8))
  steps = 1 if args.smoke else args.steps

  results = {}  # (stages, microbatches) -> (step_s, bubble, temp bytes, plan bytes)
  for s in stages:
    for m in (microbatches if s > 1 else microbatches[:1]):  # One stage runs no schedule.
      mesh = (f'mesh.stage={s}', f'mesh.data={len(devices) // s}', f'pipeline.microbatches={m}')
      built = harness.build(harness.load(path, overrides + mesh), devices)
      batches = harness.device_batches(built, 2)
      compiled = harness.compile_step(built, batches[0])
      temp = harness.memory_analysis(compiled)['temp']
      times, _ = harness.time_steps(compiled, built, batches, warmup=1, steps=steps)
      results[s, m] = (statistics.median(times), built.placement.pipeline.bubble, temp,
                       built.plan.activations)
      print(f'measured {s} stage(s), {m} microbatches', flush=True)

  base = results[1, microbatches[0]][0]
  header = ['stages', 'microbatches', 'bubble', 'predicted_ms', 'step_ms', 'step / 1 stage', 'temp_MiB',
            'plan_MiB']
  rows = []
  for (s, m), (step, bubble, temp, plan) in results.items():
    rows.append([str(s), str(m) if s > 1 else '-', f'{bubble:.1%}', f'{base / (1 - bubble) * 1e3:.1f}',
                 f'{step * 1e3:.1f}', f'{step / base:.2f}', harness.mib(temp), harness.mib(plan)])
  print(f'\nconfig {harness.describe_config(pathlib.Path(path), overrides)}, mesh.stage x mesh.data = '
        f'{len(devices)} devices; median of {steps} steps after 1 warm-up\n')
  print(harness.table(header, rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
