#!/usr/bin/env python
"""How fast the mintrain train step runs, against how fast this machine multiplies matrices.

Model FLOP/s alone says little across machines; its ratio to a matmul rate measured in the same run, on
the same device and in the model's compute dtype (float32 for bench_tiny), says how much of the machine
the step uses. The FLOPs are the analytic count of
`mintrain.report.train_flops_per_step` (matmuls only, causal attention halved), the same as the loop's MFU.

The step is built as `train_loop.run` builds it (train_state.setup, make_train_step, make_batches) and
compiled ahead; step times are medians of jitted steps after warm-up, each until `block_until_ready`.
Besides the config as it is, each optimisation variant whose config key exists is timed too
(`model.attention`, `model.scan_layers`, `model.remat`, `model.mlp_overlap`, `model.loss_chunks`).

Simulated CPU devices share the host's cores, and one device's matmul already uses all of them, so on CPU
the ratio is the step's total model FLOP/s over the one-device matmul rate; on accelerators it is per
device over per device.

  python benchmarks/step.py                              # mintrain/configs/bench_tiny.py and its variants
  python benchmarks/step.py --config mintrain/configs/dp4_tp2.py --only baseline
  python benchmarks/step.py --override model.vocab_size=384   # what-if: any key=value, on every variant
  python benchmarks/step.py --smoke                      # tiny model, baseline, one step: it still runs
"""

from __future__ import annotations

import argparse
import statistics
import sys

import harness

from mintrain import report

# Variant name -> config overrides on top of the config (and of --override).
VARIANTS = {
    'baseline': (),
    'attention=dot_product': ('model.attention=dot_product',),
    'scan_layers': ('model.scan_layers=True',),
    'remat=full': ('model.remat=full',),
    'remat=save_matmuls': ('model.remat=save_matmuls',),
    'mlp_overlap': ('model.mlp_overlap=True',),
    'unfused_loss': ('model.loss_chunks=0',),
    'loss_chunks=4': ('model.loss_chunks=4',),
    'bfloat16': ('model.compute_dtype=bfloat16',),
    'maxtext_shipped': ('model.compute_dtype=bfloat16', 'model.remat=full', 'model.scan_layers=True'),
}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser, 'config override applied to every variant; repeatable')
  parser.add_argument('--only', nargs='+', choices=sorted(VARIANTS), default=None, help='variants to run')
  harness.timing_arguments(parser, 5, 'tiny model, baseline, one step')
  args = parser.parse_args()

  devices = harness.start_devices()
  t = harness.timing(args)

  shares_host = devices[0].platform == 'cpu'
  rows, first = [], None
  for name in args.only or (('baseline',) if args.smoke else VARIANTS):
    overrides = t.base + VARIANTS[name]
    missing = harness.missing_keys(t.path, overrides)
    if missing:
      print(f'skipping {name}: the config has no {", ".join(missing)} yet', flush=True)
      continue
    config = harness.load(t.path, overrides)
    m = harness.against_matmul(t, config, devices)
    step_s = statistics.median(m.times)
    first = first or (config, m.built)
    rows.append([name, f'{m.compile_s:.1f}', f'{step_s * 1e3:.1f}', harness.spread(m.times),
                 f'{report.tokens_per_step(config) / step_s:,.0f}', f'{m.tflop / step_s:.4f}',
                 f'{statistics.median(m.calibrations):.4f}', f'{m.ratio:.1%}', f'{m.losses[0]:.4f}'])
    print(f'measured {name}', flush=True)
  if first is None:
    print('no variant could run')
    return 1

  config, built = first
  where = 'all devices together' if shares_host else 'per device'
  print(f'\nconfig {harness.describe_config(t.path, t.base)}')
  print(f'mesh {harness.describe_mesh(built.mesh)}, {harness.param_count(built):,} parameters, '
        f'{report.train_flops_per_step(config) / 1e9:.1f} GFLOP and {report.tokens_per_step(config):,} '
        f'tokens per step, compute {config.model.compute_dtype}')
  size = t.calibration_size
  print(f'median of {t.steps} steps after {t.warmup} warm-up; model TFLOP/s {where}; matmul_TFLOP_s: a '
        f'{config.model.compute_dtype} {size}x{size} matmul on one device, timed for '
        f'{t.calibration_s} s after each step; ratio = median over steps of model / matmul rate\n')
  print(harness.table(['variant', 'compile_s', 'step_ms', 'spread', 'tokens_per_s', 'model_TFLOP_s',
                       'matmul_TFLOP_s', 'ratio', 'loss_at_init'], rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
