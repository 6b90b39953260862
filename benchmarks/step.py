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
}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser, 'config override applied to every variant; repeatable')
  parser.add_argument('--only', nargs='+', choices=sorted(VARIANTS), default=None, help='variants to run')
  harness.timing_arguments(parser, 5, 'tiny model, baseline, one step')
  args = parser.parse_args()

  devices = harness.start_devices()
  t = harness.timing(args)
  path, base, steps, warmup = t.path, t.base, t.steps, t.warmup
  size, seconds = t.calibration_size, t.calibration_s

  shares_host = devices[0].platform == 'cpu'
  rows, first = [], None
  for name in args.only or (('baseline',) if args.smoke else VARIANTS):
    overrides = base + VARIANTS[name]
    missing = harness.missing_keys(path, overrides)
    if missing:
      print(f'skipping {name}: the config has no {", ".join(missing)} yet', flush=True)
      continue
    config = harness.load(path, overrides)
    built = harness.build(config, devices)
    batches = harness.device_batches(built, 2)
    compiled = harness.compile_step(built, batches[0])
    # A calibration right after each timed step: other load on a shared machine slows both alike.
    calibrations, calibrate = harness.calibrator(config.model.compute_dtype, size, seconds, devices[0])
    times, losses = harness.time_steps(compiled, built, batches, warmup=warmup, steps=steps,
                                       after_step=calibrate)
    step_s = statistics.median(times)
    per = 1 if shares_host else built.mesh.size  # Simulated CPU devices share one host's matmul rate.
    tflop = report.train_flops_per_step(config) / per / 1e12  # Per device, or per host on CPU.
    ratio = statistics.median([tflop / t / c for t, c in zip(times, calibrations)])
    first = first or (config, built)
    rows.append([name, f'{compiled.total_s:.1f}', f'{step_s * 1e3:.1f}', harness.spread(times),
                 f'{report.tokens_per_step(config) / step_s:,.0f}', f'{tflop / step_s:.4f}',
                 f'{statistics.median(calibrations):.4f}', f'{ratio:.1%}', f'{losses[0]:.4f}'])
    print(f'measured {name}', flush=True)
  if first is None:
    print('no variant could run')
    return 1

  config, built = first
  where = 'all devices together' if shares_host else 'per device'
  print(f'\nconfig {harness.describe_config(path, base)}')
  print(f'mesh {harness.describe_mesh(built.mesh)}, {harness.param_count(built):,} parameters, '
        f'{report.train_flops_per_step(config) / 1e9:.1f} GFLOP and {report.tokens_per_step(config):,} '
        f'tokens per step, compute {config.model.compute_dtype}')
  print(f'median of {steps} steps after {warmup} warm-up; model TFLOP/s {where}; matmul_TFLOP_s: a '
        f'{config.model.compute_dtype} {size}x{size} matmul on one device, timed for '
        f'{seconds} s after each step; ratio = median over steps of model / matmul rate\n')
  print(harness.table(['variant', 'compile_s', 'step_ms', 'spread', 'tokens_per_s', 'model_TFLOP_s',
                       'matmul_TFLOP_s', 'ratio', 'loss_at_init'], rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
