#!/usr/bin/env python
"""Sampling (`sampling.generate`, greedy): the time of one call and its compiled program's memory, at
several prompt and continuation lengths, in one process.

The model is bench_tiny's (or --config's) with freshly drawn parameters, on its mesh; each point is a batch
of --rows random prompts of P tokens continued by N. A call runs the prefill (the whole prompt at once), then
N - 1 cached steps; `temp MiB` is the compiled program's temporaries per device (XLA's memory analysis),
where the prefill's logits would show. With `--tree`, every checkout's programs are compiled first, then
timed in turns, one call of each per turn, so the machine's drift slows them alike; `x first` is each
point's median over the first checkout's.

  python benchmarks/sampling.py                                   # P,N = 256,64 and 1024,16
  python benchmarks/sampling.py --tree /tmp/before --tree . --point 1024,16 --point 2048,16
  python benchmarks/sampling.py --smoke                           # the tests' small model, one point
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import harness
import numpy as np

POINTS = ['256,64', '1024,16']  # (prompt tokens, new tokens) of each measurement.


def compiled_points(tree: pathlib.Path | None, path: pathlib.Path, overrides: list[str],
                    points: list[tuple[int, int]], rows: int, devices: list) -> list[tuple]:
  """(label, call, temp bytes) of each point, mintrain imported from `tree` (None: as this process does)."""
  ours = harness.checkout(tree) if tree is not None else harness
  import jax
  from flax import nnx

  from mintrain.models.transformer import sampling

  longest = max(p + n for p, n in points)
  config = ours.load(path, [*overrides, f'train.seq_len={longest}'])
  built = ours.build(config, devices)
  with jax.set_mesh(built.mesh):
    model = nnx.merge(built.graphdef, built.init().params)
  out = []
  for p, n in points:
    prompt_BP = np.random.RandomState(p + n).randint(0, config.model.vocab_size, (rows, p)).astype(np.int32)

    def call(model=model, prompt_BP=prompt_BP, n=n):
      with jax.set_mesh(built.mesh):
        return jax.block_until_ready(sampling.generate(model, prompt_BP, n))

    with jax.set_mesh(built.mesh):
      graphdef, params = nnx.split(model)
      lowered = sampling._generate.lower(graphdef, params, sampling._replicated(prompt_BP), jax.random.key(0),
                                         max_new_tokens=n, temperature=0.0, top_k=0)
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    call()  # Compiles (the persistent cache aside) and warms the heap.
    out.append((f'{tree or "."}', p, n, call, temp))
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser)
  parser.add_argument('--point', action='append', default=[], metavar='P,N',
                      help=f'prompt and new tokens (repeatable; default {" and ".join(POINTS)})')
  parser.add_argument('--rows', type=int, default=4, help='prompts per call')
  parser.add_argument('--rounds', type=int, default=5, help='timed calls of each point')
  parser.add_argument('--tree', action='append', type=pathlib.Path, default=[],
                      help='a repository root whose sampler to time (repeatable)')
  parser.add_argument('--smoke', action='store_true', help="the tests' small model, one short point")
  args = parser.parse_args()
  devices = harness.start_devices()
  path, overrides = (args.config, []) if args.config else harness.bench_tiny()
  overrides = [*overrides, *args.override]
  points = [tuple(map(int, p.split(','))) for p in args.point or POINTS]
  if args.smoke:
    path, overrides = harness.FALLBACK, [*harness.SMOKE, 'data.source=synthetic']
    points, args.rounds = [(8, 4)], 2
  print(f'{harness.describe_config(path, overrides)}; {args.rows} prompts a call', flush=True)
  runs = [run for tree in args.tree or [None] for run in
          compiled_points(tree, path, overrides, points, args.rows, devices)]
  times: list[list[float]] = [[] for _ in runs]
  for _ in range(args.rounds):
    for i, (*_, call, _temp) in enumerate(runs):
      start = time.perf_counter()
      call()
      times[i].append(time.perf_counter() - start)
  first = {(p, n): statistics.median(t) for (tree, p, n, *_), t in zip(runs, times) if tree == runs[0][0]}
  rows = []
  for (tree, p, n, _, temp), t in zip(runs, times):
    median = statistics.median(t)
    rows.append([tree, str(p), str(n), f'{median * 1e3:.1f}', harness.spread(t),
                 f'{args.rows * n / median:.1f}', harness.mib(temp), f'{median / first[(p, n)]:.3f}'])
  print(harness.table(['checkout', 'prompt', 'new', 'ms', 'spread', 'new tokens/s', 'temp MiB', 'x first'],
                      rows))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
