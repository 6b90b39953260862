#!/usr/bin/env python
"""Sampling (`sampling.generate`, greedy): the time of one call and its compiled program's memory, at
several prompt and continuation lengths, in one process.

The model is bench_tiny's (or --config's) with freshly drawn parameters, on its mesh; each point is a batch
of --rows random prompts of P tokens continued by N. A call runs the prefill (the whole prompt at once), then
N - 1 cached steps; `temp MiB` is the compiled program's temporaries per device (XLA's memory analysis),
where the prefill's logits would show. With `--ragged`, the prompts are of lengths drawn from P/8 to P,
padded to a width W (a point's third number; default P) as GRPO's rollout and the evaluation harness pad
theirs, and continued by `sampling.complete`. With `--tree`, every checkout's programs are compiled
first, then timed in turns, one call of each per turn, so the machine's drift slows them alike; `x first`
is each point's median over the first checkout's.

  python benchmarks/sampling.py                                   # P,N = 256,64 and 1024,16
  python benchmarks/sampling.py --tree /tmp/before --tree . --point 1024,16 --point 2048,16
  python benchmarks/sampling.py --ragged --point 512,64          # prompts of 64 to 512 tokens
  python benchmarks/sampling.py --ragged --point 128,64,769 --point 128,64   # in 769 columns, and 128
  python benchmarks/sampling.py --smoke                           # the tests' small model, one point
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import statistics
import time

import harness
import numpy as np

POINTS = ['256,64', '1024,16']  # (prompt tokens, new tokens[, width]) of each measurement.


def compiled_points(tree: pathlib.Path | None, path: pathlib.Path, overrides: list[str],
                    points: list[tuple[int, int, int]], rows: int, devices: list,
                    ragged: bool) -> list[tuple]:
  """(label, call, temp bytes) of each point, mintrain imported from `tree` (None: as this process does)."""
  ours = harness.checkout(tree) if tree is not None else harness
  import jax
  from flax import nnx

  from mintrain.models.transformer import sampling

  longest = max(w + n for _, n, w in points)
  config = ours.load(path, [*overrides, f'train.seq_len={longest}'])
  built = ours.build(config, devices)
  with jax.set_mesh(built.mesh):
    model = nnx.merge(built.graphdef, built.init().params)
  out = []
  for p, n, w in points:
    rng = np.random.RandomState(p + n)
    prompt_BP = rng.randint(0, config.model.vocab_size, (rows, w)).astype(np.int32)
    lengths_B = rng.randint(max(p // 8, 1), p + 1, rows) if ragged else np.full(rows, p)
    keys_B = jax.random.split(jax.random.key(0), rows)
    # A checkout before complete's one prefill of every prompt took the prefill's length (GRPO: the shortest).
    older = 'shortest' in inspect.signature(sampling.complete).parameters
    shortest = {'shortest': int(lengths_B.min())} if older else {}

    def call(model=model, prompt_BP=prompt_BP, lengths_B=lengths_B, keys_B=keys_B, n=n, shortest=shortest):
      with jax.set_mesh(built.mesh):
        if ragged:
          return jax.block_until_ready(sampling.complete(model, prompt_BP, lengths_B, n, temperature=0.0,
                                                         top_p=1.0, keys_B=keys_B, **shortest))
        return jax.block_until_ready(sampling.generate(model, prompt_BP, n))

    with jax.set_mesh(built.mesh):
      graphdef, params = nnx.split(model)
      prompt = sampling._replicated(prompt_BP)
      if ragged:
        static = {'prefill': shortest['shortest']} if older else {}
        lowered = sampling._complete.lower(graphdef, params, prompt, sampling._replicated(lengths_B), keys_B,
                                           max_new_tokens=n, temperature=0.0, top_p=1.0, **static)
      else:
        lowered = sampling._generate.lower(graphdef, params, prompt, jax.random.key(0), max_new_tokens=n,
                                           temperature=0.0, top_k=0)
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    call()  # Compiles (the persistent cache aside) and warms the heap.
    out.append((f'{tree or "."}', p, n, w, call, temp))
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
  parser.add_argument('--ragged', action='store_true',
                      help='prompts of P/8 to P tokens padded to W (P,N,W; default P), through '
                      'sampling.complete')
  parser.add_argument('--smoke', action='store_true', help="the tests' small model, one short point")
  args = parser.parse_args()
  devices = harness.start_devices()
  path, overrides = (args.config, []) if args.config else harness.bench_tiny()
  overrides = [*overrides, *args.override]
  points = []
  for text in args.point or POINTS:
    p, n, *width = map(int, text.split(','))
    points.append((p, n, width[0] if width and args.ragged else p))
  if args.smoke:
    path, overrides = harness.FALLBACK, [*harness.SMOKE, 'data.source=synthetic']
    points, args.rounds = [(8, 4, 8)], 2
  what = 'prompts of P/8 to P tokens (sampling.complete)' if args.ragged else 'prompts'
  print(f'{harness.describe_config(path, overrides)}; {args.rows} {what} a call', flush=True)
  runs = [run for tree in args.tree or [None] for run in
          compiled_points(tree, path, overrides, points, args.rows, devices, args.ragged)]
  times: list[list[float]] = [[] for _ in runs]
  for _ in range(args.rounds):
    for i, (*_, call, _temp) in enumerate(runs):
      start = time.perf_counter()
      call()
      times[i].append(time.perf_counter() - start)
  first = {(p, n, w): statistics.median(t) for (tree, p, n, w, *_), t in zip(runs, times)
           if tree == runs[0][0]}
  rows = []
  for (tree, p, n, w, _, temp), t in zip(runs, times):
    median = statistics.median(t)
    rows.append([tree, str(p), str(w), str(n), f'{median * 1e3:.1f}', harness.spread(t),
                 f'{args.rows * n / median:.1f}', harness.mib(temp), f'{median / first[(p, n, w)]:.3f}'])
  print(harness.table(['checkout', 'prompt', 'width', 'new', 'ms', 'spread', 'new tokens/s', 'temp MiB',
                       'x first'], rows))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
