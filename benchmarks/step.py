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
  python benchmarks/step.py --tree /tmp/before --tree . --only baseline   # two checkouts, steps in turns

With `--tree`, each variant of each checkout is compiled in this one process and all are timed in turns,
a step of each, then again, so that a load that comes and goes slows them alike; each is reported against
the first checkout's same variant (the median of the paired steps' ratios). No calibration runs then.
"""

from __future__ import annotations

import argparse
import pathlib
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
  parser.add_argument('--tree', action='append', type=pathlib.Path, default=[], metavar='CHECKOUT',
                      help='a checkout whose step to time (repeatable): all in turns, against the first')
  args = parser.parse_args()

  devices = harness.start_devices()
  t = harness.timing(args)
  if args.tree:
    return compare_checkouts(args.tree, args.only or ['baseline'], t, devices)

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


def compare_checkouts(trees: list[pathlib.Path], names: list[str], t: harness.Timing, devices) -> int:
  """Each variant's step from each checkout, compiled here and timed in turns (`--tree`)."""
  runs, labels = [], []
  for tree in trees:
    ours = harness.checkout(tree)
    inside = t.path.is_relative_to(harness.REPO)  # A config of the repository: the checkout's own.
    path = tree.resolve() / t.path.relative_to(harness.REPO) if inside else t.path
    for name in names:
      overrides = t.base + VARIANTS[name]
      if missing := ours.missing_keys(path, overrides):
        print(f'skipping {name} of {tree}: its config has no {", ".join(missing)}', flush=True)
        continue
      runs.append(ours.prepare(ours.load(path, overrides), devices))
      labels.append((str(tree), name))
      print(f'compiled {name} with {pathlib.Path(ours.config_lib.__file__).parent}', flush=True)
  times = harness.time_interleaved(runs, warmup=t.warmup, steps=t.steps)
  first = {name: steps for (tree, name), steps in zip(labels, times) if tree == str(trees[0])}
  rows = []
  for (tree, name), steps in zip(labels, times):
    paired = [b / a for a, b in zip(first[name].wall, steps.wall)] if name in first else []
    rows.append([tree, name, f'{statistics.median(steps.wall) * 1e3:.1f}', harness.spread(steps.wall),
                 f'{statistics.median(paired):.3f}' if paired else '-', f'{steps.cores_busy():.2f}'])
  print(f'\nconfig {harness.describe_config(t.path, t.base)}')
  print(f'{t.steps} steps of each in turns after {t.warmup} warm-up; against first: the median over paired '
        f'steps of this step over the first checkout\'s\n')
  print(harness.table(['checkout', 'variant', 'step_ms', 'spread', 'against first', 'cores busy'], rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
