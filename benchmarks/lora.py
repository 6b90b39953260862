#!/usr/bin/env python
"""LoRA and QLoRA against full fine-tuning of the same model: step time and memory per device.

Three variants of one model (bench_tiny with a 4k vocabulary, so the projections LoRA adapts are most of
the step): every parameter trained; LoRA rank 16 on q,k,v,o,gate,up,down (float32 base); QLoRA, the same
adapters on an NF4 base. All are compiled first, then timed in turns (one step of each, again and again),
so a shared machine's load slows them alike. Memory: the plan's parameters, gradients and optimizer state
per device, and the compiler's own argument and temporary buffers of the step.

  python benchmarks/lora.py            # ~5 min on a loaded 2-core CPU machine
  python benchmarks/lora.py --smoke    # tiny model, one step each
"""

from __future__ import annotations

import argparse
import statistics
import sys

import harness

BASE = ('model.vocab_size=4096',)
VARIANTS = {
    'full fine-tuning': (),
    'LoRA r16': ('lora.rank=16',),
    'QLoRA r16 nf4': ('lora.rank=16', 'lora.base_dtype=nf4'),
}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser, 'config override applied to every variant; repeatable')
  parser.add_argument('--steps', type=int, default=6, help='timed steps per variant')
  parser.add_argument('--warmup', type=int, default=2, help='untimed steps per variant after compiling')
  parser.add_argument('--smoke', action='store_true', help='tiny model, one step each')
  args = parser.parse_args()
  devices = harness.start_devices()
  path, base = (args.config.resolve(), ()) if args.config else harness.bench_tiny()
  smoke = (*harness.SMOKE, 'lora.nf4_block_size=16') if args.smoke else ()  # Its heads are 16 wide.
  base = (*base, *BASE, *args.override, *smoke)
  steps, warmup = (1, 1) if args.smoke else (args.steps, args.warmup)
  runs, rows = [], []
  for name, overrides in VARIANTS.items():
    config = harness.load(path, (*base, *overrides))
    runs.append(harness.prepare(config, devices))
    print(f'compiled {name}', flush=True)
  times = [t.wall for t in harness.time_interleaved(runs, warmup=warmup, steps=steps)]
  full = statistics.median(times[0])
  for name, (compiled, built, _), step_times in zip(VARIANTS, runs, times):
    plan, memory = built.plan, harness.memory_analysis(compiled)
    trainable = sum(p.bytes_per_device for p in built.layout if p.trainable)
    rows.append([name, f'{statistics.median(step_times) * 1e3:.1f}', harness.spread(step_times),
                 f'{statistics.median(step_times) / full:.2f}', harness.mib(plan.params),
                 harness.mib(trainable), harness.mib(plan.grads), harness.mib(plan.opt_state),
                 harness.mib(memory['argument']), harness.mib(memory['temp'])])
  _, built, _ = runs[0]
  print(f'\nconfig {harness.describe_config(path, base)}')
  print(f'mesh {harness.describe_mesh(built.mesh)}, {harness.param_count(built):,} parameters (full model)')
  print(f'median of {steps} steps after {warmup} warm-up, variants in turns; MiB per device\n')
  print(harness.table(['variant', 'step_ms', 'spread', 'step / full', 'params', 'trainable', 'grads',
                       'optimizer', 'step arguments', 'step temporaries'], rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
