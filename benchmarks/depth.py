#!/usr/bin/env python
"""Compile time against depth: unrolled layers against `model.scan_layers`.

An unrolled model hands XLA one copy of the block per layer, so compile time grows with depth; a scanned
model hands it one block inside a loop, so compile time should barely move. This compiles the train step
of the same model at 4, 12 and 24 layers both ways, ahead of time as the training loop does, and runs a
few steps of each so that a faster compile is not bought with a slower step.

`trace_s` is tracing and lowering (Python and Flax), `xla_s` is XLA's compilation; their sum is what a run
waits for before its first step. The scanned column is skipped, with a note, on a checkout whose config
has no `model.scan_layers`.

  python benchmarks/depth.py                               # dp4_tp2's model (~3 min on 2 CPU cores)
  python benchmarks/depth.py --config mintrain/configs/fsdp8.py --layers 4 24
  python benchmarks/depth.py --smoke                       # a tiny model at 2 layers, one step
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import harness

from mintrain import configs

REPO = pathlib.Path(__file__).resolve().parents[1]


COMMON = ('data.source=synthetic',)
FORMS = {'unrolled': (), 'scanned': ('model.scan_layers=True',)}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--config', type=pathlib.Path, default=configs.DIR / 'dp4_tp2.py')
  parser.add_argument('--layers', type=int, nargs='+', default=None, help='depths (default 4 12 24)')
  parser.add_argument('--steps', type=int, default=3, help='timed steps per model')
  parser.add_argument('--smoke', action='store_true', help='tiny model at 2 layers, one step')
  args = parser.parse_args()

  devices = harness.start_devices()
  path = args.config.resolve()
  overrides = COMMON + (harness.SMOKE if args.smoke else ())
  depths = args.layers or ((2,) if args.smoke else (4, 12, 24))
  steps = 1 if args.smoke else args.steps

  forms = {}
  for form, extra in FORMS.items():
    missing = harness.missing_keys(path, extra)
    if missing:
      print(f'skipping the {form} column: the config has no {", ".join(missing)} yet', flush=True)
    else:
      forms[form] = extra

  results = {}  # (form, depth) -> (trace_s, xla_s, step_s)
  for depth in depths:
    for form, extra in forms.items():
      config = harness.load(path, overrides + extra + (f'model.num_layers={depth}',))
      compiled, built, batches = harness.prepare(config, devices)
      times, _ = harness.time_steps(compiled, built, batches, warmup=1, steps=steps)
      results[form, depth] = (compiled.lower_s, compiled.compile_s, statistics.median(times))
      print(f'measured {form} {depth} layers', flush=True)

  header, rows = ['layers'], []
  for form in forms:
    header += [f'{form}_trace_s', f'{form}_xla_s', f'{form}_total_s', f'{form}_step_ms']
  for depth in depths:
    row = [str(depth)]
    for form in forms:
      trace, xla, step = results[form, depth]
      row += [f'{trace:.1f}', f'{xla:.1f}', f'{trace + xla:.1f}', f'{step * 1e3:.1f}']
    rows.append(row)
  print(f'\nconfig {harness.describe_config(path, overrides)}, model.num_layers as in the table; median of '
        f'{steps} steps after 1 warm-up\n')
  print(harness.table(header, rows))
  print()
  low, high = min(depths), max(depths)
  for form in forms:
    t_low, t_high = (sum(results[form, d][:2]) for d in (low, high))
    x_low, x_high = results[form, low][1], results[form, high][1]
    print(f'{form}: compile({high} layers) / compile({low} layers) = {t_high / t_low:.2f}x '
          f'(XLA alone {x_high / x_low:.2f}x)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
