#!/usr/bin/env python
"""Step time of a mixture-of-experts model against the dense model with the same active parameters.

The dense model is mintrain/configs/bench_tiny.py (MLP width F = 1024). The MoE models replace every MLP by
E = 8 experts of width F / 2 = 512 with k = 2 per token, or E = 64 experts of width F / 4 = 256 with k = 4,
so a token meets the same MLP FLOPs and as many active MLP parameters (plus a D x E router). Each variant
runs on all 8 devices:

  dense                           data 8 (bench_tiny's batch split 8 ways)
  8e top-2 grouped                data 8: dropless, each device its tokens' choices by the grouped matmul
  8e top-2 grouped, EP4           expert 4 x data 2: the choices to their experts' devices by all-to-all,
                                  each peer sent at most all of them (exact)
  8e top-2 grouped, EP4, bound 2  the same, each peer sent at most twice its even share
  8e top-2 slots, EP4             dropless the old way: every expert L slots a sequence (E / k the work)
  8e top-2 capacity 1.25, EP4     1.25 x the even share of slots per expert, the rest dropped
  64e top-4 grouped               data 8
  64e top-4 grouped, EP4, bound 2 expert 4 x data 2
  64e top-4 grouped, EP8          expert 8: each device 8 whole experts, none replicated (exact)
  64e top-4 grouped, EP8, bound 2 the same, each peer sent at most twice its even share

The ratio column is each step time over the dense one. Model TFLOP/s use the analytic count (active
experts only), as the training loop's MFU does. `cores busy` is the process's CPU seconds over a step's
wall seconds (median): on simulated CPU devices, what falls short of the machine's cores sat idle while the
last devices finished before a collective.

  python benchmarks/moe.py             # the table above
  python benchmarks/moe.py --smoke     # tiny models, one step each: it still runs
  python benchmarks/moe.py --variant '64e top-4 grouped, EP8'   # dense and the named ones only
  python benchmarks/moe.py --interleave --variant '64e top-4 grouped, EP8, bound 2' --variant ...
      # all compiled first, then timed in turns, one step of each (a few variants: they share the memory)
  git archive HEAD~1 | tar -x -C /tmp/before
  python benchmarks/moe.py --interleave --variant '64e top-4 grouped, EP8, bound 2' --baseline /tmp/before
      # each variant also with the MoE layer of another checkout, timed in turns in the same process: a
      # change to the layer measured under the same load (runs in turns minutes apart spread by 0.1x)
  python benchmarks/moe.py --interleave --variant '64e top-4 grouped, EP8, bound 2' --tile 64 --tile 128
      # each grouped variant also with tiles of that many rows (`model.moe_tile`; the table's own rows:
      # the automatic size), in turns in the same process
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import pathlib
import statistics
import sys
from collections.abc import Callable

import harness

from mintrain import report
from mintrain.models.transformer import moe as moe_layer

DATA8 = ('mesh.data=8', 'mesh.fsdp=1', 'mesh.expert=1', 'mesh.model=1')
EP4 = ('mesh.data=2', 'mesh.fsdp=1', 'mesh.expert=4', 'mesh.model=1')
EP8 = ('mesh.data=1', 'mesh.fsdp=1', 'mesh.expert=8', 'mesh.model=1')
E8 = ('model.num_experts=8', 'model.experts_per_token=2', 'model.expert_mlp_dim=512')
E64 = ('model.num_experts=64', 'model.experts_per_token=4', 'model.expert_mlp_dim=256')
BOUND2 = ('model.expert_exchange_factor=2',)
VARIANTS = {
    'dense': DATA8,
    '8e top-2 grouped': (*DATA8, *E8),
    '8e top-2 grouped, EP4': (*EP4, *E8),
    '8e top-2 grouped, EP4, bound 2': (*EP4, *E8, *BOUND2),
    '8e top-2 slots, EP4': (*EP4, *E8, 'model.grouped_matmul=off'),
    '8e top-2 capacity 1.25, EP4': (*EP4, *E8, 'model.capacity_factor=1.25'),
    '64e top-4 grouped': (*DATA8, *E64),
    '64e top-4 grouped, EP4, bound 2': (*EP4, *E64, *BOUND2),
    '64e top-4 grouped, EP8': (*EP8, *E64),
    '64e top-4 grouped, EP8, bound 2': (*EP8, *E64, *BOUND2),
}
SMOKE = ('model.embed_dim=32', 'model.num_heads=2', 'model.head_dim=16', 'model.mlp_dim=64',
         'model.expert_mlp_dim=32', 'model.num_layers=2', 'model.vocab_size=256', 'train.global_batch_size=8',
         'train.seq_len=16')


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--steps', type=int, default=5, help='timed steps per variant')
  parser.add_argument('--warmup', type=int, default=harness.WARMUP, help='untimed steps after compiling')
  parser.add_argument('--smoke', action='store_true', help='tiny models, one step each')
  parser.add_argument('--interleave', action='store_true',
                      help='compile every variant first, then time them in turns (one step of each)')
  parser.add_argument('--variant', action='append', choices=list(VARIANTS)[1:], default=[],
                      help='run the dense step and this variant only; repeatable (default: all)')
  parser.add_argument('--baseline', type=pathlib.Path, default=None, metavar='CHECKOUT',
                      help="also run each variant with this checkout's MoE layer (its "
                           'mintrain/models/transformer/moe.py and grouped.py)')
  parser.add_argument('--tile', type=int, action='append', default=[], metavar='ROWS',
                      help='each grouped variant also with tiles of ROWS rows (model.moe_tile); repeatable')
  args = parser.parse_args()
  devices = harness.start_devices()
  path, base = harness.bench_tiny()
  steps, warmup = (1, 1) if args.smoke else (args.steps, args.warmup)
  names = [name for name in VARIANTS if not args.variant or name == 'dense' or name in args.variant]
  names += [f'{name}, tile {rows}' for rows in args.tile for name in names if 'grouped' in name]
  theirs = None
  if args.baseline:
    names += [f'{name} (baseline)' for name in names[1:]]
    theirs = baseline_layer(args.baseline)

  def compiled(name: str) -> tuple:
    variant, _, tile = name.removesuffix(' (baseline)').partition(', tile ')
    tiles = (f'model.moe_tile={tile}',) if tile else ()
    config = harness.load(path, (*base, *VARIANTS[variant], *tiles, *(SMOKE if args.smoke else ())))
    with layer_in_place(theirs) if name.endswith(' (baseline)') else contextlib.nullcontext():
      return config, harness.prepare(config, devices)

  measured = {}  # name -> (config, (compiled step, run, batches), its StepTimes)
  if args.interleave:
    runs = {name: compiled(name) for name in names}
    every = harness.time_interleaved([run for _, run in runs.values()], warmup=warmup, steps=steps)
    measured = {name: (*config_run, times) for (name, config_run), times in zip(runs.items(), every)}
  else:
    for name in names:
      config, run = compiled(name)
      [times] = harness.time_interleaved([run], warmup=warmup, steps=steps)
      measured[name] = (config, run, times)
      print(f'{name}: {statistics.median(times.wall) * 1e3:.1f} ms per step', flush=True)
  dense_s = statistics.median(measured['dense'][2].wall)
  rows = []
  for name, (config, (step, built, _), times) in measured.items():
    step_s = statistics.median(times.wall)
    tflops = report.train_flops_per_step(config) / step_s / 1e12
    rows.append((name, harness.describe_mesh(built.mesh), f'{harness.param_count(built):,}',
                 f'{report.train_flops_per_step(config) / 1e9:.2f}', f'{step.total_s:.1f}',
                 f'{step_s * 1e3:.1f}', f'{step_s / dense_s:.2f}', f'{tflops:.4f}',
                 harness.spread(times.wall), f'{times.cores_busy():.2f}'))
  print(harness.describe_config(path, base))
  print(harness.table(('variant', 'mesh', 'parameters', 'GFLOP per step (active)', 'compile s', 'step ms',
                       'step / dense', 'model TFLOP/s', 'spread', 'cores busy'), rows))
  return 0


def baseline_layer(checkout: pathlib.Path) -> Callable:
  """The dropless MoE layer (`_grouped_local`) of `checkout`'s moe.py, with its own grouped.py."""
  def load(name: str):
    spec = importlib.util.spec_from_file_location(f'baseline_{name}',
                                                  checkout / 'mintrain/models/transformer' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  theirs = load('moe')
  theirs.grouped = load('grouped')
  # Only the arguments it takes: an older layer has fewer (`platform`).
  parameters = inspect.signature(theirs._grouped_local).parameters
  if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
    return theirs._grouped_local
  return lambda *args, **kwargs: theirs._grouped_local(*args, **{k: v for k, v in kwargs.items()
                                                                 if k in parameters})


@contextlib.contextmanager
def layer_in_place(layer: Callable):
  """`layer` in place of this checkout's dropless MoE layer while a step is traced and compiled."""
  ours = moe_layer._grouped_local
  moe_layer._grouped_local = layer
  try:
    yield
  finally:
    moe_layer._grouped_local = ours


if __name__ == '__main__':
  sys.exit(main())
