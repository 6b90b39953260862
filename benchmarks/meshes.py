#!/usr/bin/env python
"""One model on every mesh: step time, and what each device holds.

The same model (the overrides in MODEL) runs on the configs single, dp8, dp4_tp2, tp8, fsdp8, fsdp4_tp2.
Per mesh it reports the compile time and median step time, the bytes of parameters and optimizer state
that the first device really holds after the sharded init (checked against the layout's own figures),
the memory plan's activation estimate, and the compiler's memory analysis of the compiled step (per
device: arguments, outputs, outputs aliased to donated arguments, temporaries).

FSDP is meant to divide parameters and optimizer state by the number of `fsdp` ways: on fsdp8 each
device should hold at most 1/7 of what it holds on dp8 (1/8 plus the replicated scalars and slack).

  python benchmarks/meshes.py          # six meshes (~1.5 min on 2 CPU cores)
  python benchmarks/meshes.py --meshes dp8 fsdp8
  python benchmarks/meshes.py --smoke  # a tiny model on dp8 and fsdp8, one step
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import harness

from mintrain import configs
from mintrain import mesh as mesh_lib
from mintrain.configs import test_small

REPO = pathlib.Path(__file__).resolve().parents[1]


MESHES = ('single', 'dp8', 'dp4_tp2', 'tp8', 'fsdp8', 'fsdp4_tp2')
# Every split dimension divides by 8: heads, mlp and vocab for tp8, embed for fsdp8, batch for dp8.
MODEL = ('model.embed_dim=256', 'model.num_layers=4', 'model.num_heads=8', 'model.head_dim=32',
         'model.mlp_dim=1024', 'model.vocab_size=8192', 'train.seq_len=128', 'train.global_batch_size=16',
         'data.source=synthetic')
SMOKE = (*test_small.OVERRIDES, 'model.vocab_size=256', 'data.source=synthetic')


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--meshes', nargs='+', choices=MESHES, default=None, help='config names to run')
  parser.add_argument('--steps', type=int, default=3, help='timed steps per mesh')
  parser.add_argument('--smoke', action='store_true', help='tiny model on dp8 and fsdp8, one step')
  args = parser.parse_args()

  devices = harness.start_devices()
  overrides = SMOKE if args.smoke else MODEL
  names = args.meshes or (('dp8', 'fsdp8') if args.smoke else MESHES)
  steps = 1 if args.smoke else args.steps

  rows, held = [], {}
  for name in names:
    config = harness.load(configs.DIR / f'{name}.py', overrides)
    compiled, built, batches = harness.prepare(config, devices)
    params_b = harness.first_device_bytes(compiled.state.params)
    opt_b = harness.first_device_bytes(compiled.state.opt_state)
    plan = built.plan
    if (params_b, opt_b) != (plan.params, plan.opt_state):
      print(f'note: on {name} the arrays hold {params_b} + {opt_b} bytes per device; the layout says '
            f'{plan.params} + {plan.opt_state}', flush=True)
    analysis = harness.memory_analysis(compiled)
    times, _ = harness.time_steps(compiled, built, batches, warmup=1, steps=steps)
    held[name] = params_b + opt_b
    rows.append([name, mesh_lib.describe(built.mesh.shape), f'{compiled.total_s:.1f}',
                 f'{statistics.median(times) * 1e3:.1f}', harness.mib(params_b), harness.mib(opt_b),
                 harness.mib(plan.activations), *(harness.mib(analysis[k]) for k in analysis)])
    print(f'measured {name}', flush=True)

  params = harness.param_count(built)
  print(f'\nmodel: {" ".join(overrides)} ({params:,} parameters, float32 params and Adam state)')
  print(f'median of {steps} steps after 1 warm-up; memory per device in MiB: params/opt_state from the '
        'arrays the first device holds, act_plan from mintrain.report.plan, xla_* from '
        'compiled.memory_analysis()\n')
  print(harness.table(['mesh', 'axes', 'compile_s', 'step_ms', 'params_MiB', 'opt_state_MiB',
                       'act_plan_MiB', 'xla_argument_MiB', 'xla_output_MiB', 'xla_alias_MiB',
                       'xla_temp_MiB'], rows))
  print()
  for fsdp, dp in (('fsdp8', 'dp8'), ('fsdp4_tp2', 'dp4_tp2')):
    if fsdp in held and dp in held:
      ratio = held[fsdp] / held[dp]
      print(f'FSDP ratio: params + opt_state per device on {fsdp} / {dp} = {ratio:.4f} (1/{1 / ratio:.2f})')
  return 0


if __name__ == '__main__':
  sys.exit(main())
