#!/usr/bin/env python
"""Context parallelism on a long sequence: activation memory per device, and step time of both paths.

One small model with a long sequence (MODEL) trains on one device (context 1) and on a mesh that splits
the sequence 4 ways (context 4), with keys and values gathered (`model.context_attention=all_gather`) or
passed round a ring (`ring`). Per run: the compiler's memory analysis of the compiled train step per
device (temporaries: what the step's activations and workspace take; arguments: parameters, optimizer
state and batch), the memory plan's activation estimate, the compile time and the median step time.

Splitting the length 4 ways should leave each device at most 0.35x the activations of one device (a
quarter of the tokens, each still scoring every key, plus the gathered keys and values).

  python benchmarks/context.py          # seq 4096 (~3 min on 2 CPU cores)
  python benchmarks/context.py --smoke  # a tiny model and sequence, one step each
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import harness

from mintrain import configs
from mintrain.configs import test_small

REPO = pathlib.Path(__file__).resolve().parents[1]


MODEL = ('model.embed_dim=128', 'model.num_layers=2', 'model.num_heads=4', 'model.head_dim=32',
         'model.mlp_dim=512', 'train.seq_len=4096', 'train.global_batch_size=1', 'data.source=synthetic')
SMOKE = (*test_small.OVERRIDES, 'train.seq_len=64', 'train.global_batch_size=1', 'data.source=synthetic')
ONE_DEVICE = ('mesh.data=1', 'mesh.fsdp=1', 'mesh.context=1', 'mesh.model=1')
RUNS = {  # name: (mesh and attention overrides)
    'context1': ONE_DEVICE,
    'context4 all_gather': (*ONE_DEVICE, 'mesh.context=4', 'model.context_attention=all_gather'),
    'context4 ring': (*ONE_DEVICE, 'mesh.context=4', 'model.context_attention=ring'),
}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--steps', type=int, default=3, help='timed steps per run, after one warm-up')
  parser.add_argument('--smoke', action='store_true', help='tiny model and sequence, one step each')
  args = parser.parse_args()

  devices = harness.start_devices()
  model = SMOKE if args.smoke else MODEL
  steps = 1 if args.smoke else args.steps

  rows, temp, step_ms = [], {}, {}
  for name, overrides in RUNS.items():
    config = harness.load(configs.DIR / 'base.py', (*model, *overrides))
    compiled, built, batches = harness.prepare(config, devices, 1)
    analysis = harness.memory_analysis(compiled)
    times, _ = harness.time_steps(compiled, built, batches, warmup=1, steps=steps)
    temp[name], step_ms[name] = analysis['temp'], statistics.median(times) * 1e3
    rows.append([name, harness.describe_mesh(built.mesh), f'{compiled.total_s:.1f}', f'{step_ms[name]:.0f}',
                 harness.mib(analysis['temp']), harness.mib(analysis['argument']),
                 harness.mib(built.plan.activations)])
    print(f'measured {name}', flush=True)

  print(f'\nmodel: {" ".join(model)} ({harness.param_count(built):,} parameters, float32)')
  print(f'median of {steps} steps after 1 warm-up; memory per device in MiB: xla_* from '
        'compiled.memory_analysis(), act_plan from mintrain.report.plan\n')
  print(harness.table(['run', 'mesh', 'compile_s', 'step_ms', 'xla_temp_MiB', 'xla_argument_MiB',
                       'act_plan_MiB'], rows))
  print()
  for name in ('context4 all_gather', 'context4 ring'):
    print(f'activation ratio: xla_temp per device {name} / context1 = {temp[name] / temp["context1"]:.3f}')
  print(f'step time ratio: ring / all_gather on context4 = '
        f'{step_ms["context4 ring"] / step_ms["context4 all_gather"]:.2f}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
