#!/usr/bin/env python
"""Time to first step: each phase of a run's start-up, in fresh processes, as the training loop goes.

A fresh process imports JAX and mintrain, builds bench_tiny's run (mesh, layout), compiles and runs the
initialiser, makes a batch, compiles the train step and takes two steps; it reports each phase's wall and
CPU seconds (all threads: on a shared machine the steadier figure) and the number of loops (`while`) in
the compiled initialiser. No persistent compilation cache is used.
`--tree` compares checkouts (each a repository root put first on PYTHONPATH): rounds run every tree once,
in turn, so load from other processes falls on all of them alike; each row is the median over rounds.

  python benchmarks/startup.py                                  # this checkout, 5 rounds, ~2 min quiet
  python benchmarks/startup.py --tree /tmp/before --tree .      # before and after, interleaved
  python benchmarks/startup.py --smoke                          # the tests' small model, one round
  python benchmarks/startup.py --set model.scan_layers=True     # bench_tiny with its layers scanned
"""

from __future__ import annotations

import time

START = time.perf_counter(), time.process_time()  # Before anything heavy is imported: `import_s` starts here.

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULT = 'RESULT '  # The line a measuring process prints.
PHASES = ['import_s', 'build_s', 'init_compile_s', 'init_run_s', 'batch_s', 'step_compile_s', 'first_step_s',
          'second_step_s']
# to_first_step_s: every phase from build to the first step's end (what a run waits for beyond imports).
HEADER = ['tree', *PHASES, 'to_first_step_s', 'init_loops']


def measure_process(smoke: bool, overrides: list[str]) -> None:
  """One fresh process: prints each phase's seconds (run by `main`)."""
  marks = {}

  def mark(phase: str) -> None:
    marks[phase] = time.perf_counter(), time.process_time()

  import harness
  import jax

  from mintrain.data import tokenizer  # noqa: F401 (imported with the rest of mintrain, as the loop does)
  mark('import_s')
  jax.config.update('jax_enable_compilation_cache', False)
  devices = harness.start_devices()
  path, base = harness.bench_tiny()
  run = harness.build(harness.load(path, (*base, *overrides, *(harness.SMOKE if smoke else ()))), devices)
  mark('build_s')
  with jax.set_mesh(run.mesh):
    if hasattr(run.init, 'compile'):  # Its draws' programs and the state's (since 2026-12-03).
      init = run.init.compile()
      args = ()
    else:  # One program, its keys as arguments since 2026-11-28.
      init, args = run.init.lower().compile(), getattr(run.init, 'args', ())
    mark('init_compile_s')
    state = jax.block_until_ready(init(*args))
    mark('init_run_s')
    batch = harness.device_batches(run, 1)[0]
    mark('batch_s')
    step = run.train_step.lower(state, batch).compile()
    mark('step_compile_s')
    state, metrics = jax.block_until_ready(step(state, batch))
    mark('first_step_s')
    jax.block_until_ready(step(state, batch))
    mark('second_step_s')
  seconds, last = {}, START
  for phase in PHASES:
    seconds[phase] = [now - before for now, before in zip(marks[phase], last)]
    last = marks[phase]
  seconds['to_first_step_s'] = [a - b for a, b in zip(marks['first_step_s'], marks['import_s'])]
  seconds['init_loops'] = [init.as_text().count(' while(')] * 2
  print(RESULT + json.dumps(seconds), flush=True)


def measure(tree: pathlib.Path, smoke: bool, overrides: list[str]) -> dict[str, float]:
  """The phases of one fresh process importing mintrain from `tree`."""
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_COMPILATION_CACHE_DIR')}
  env['PYTHONPATH'] = os.pathsep.join([str(tree), *filter(None, [os.environ.get('PYTHONPATH')])])
  command = [sys.executable, __file__, '--process', *(['--smoke'] if smoke else []),
             *(f'--set={o}' for o in overrides)]
  proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  results = [json.loads(line.split(RESULT, 1)[1]) for line in proc.stdout.splitlines() if RESULT in line]
  if proc.returncode != 0 or not results:
    raise RuntimeError(f'the start-up in {tree} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}')
  return results[0]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--tree', action='append', type=pathlib.Path, default=[],
                      help='a repository root whose mintrain to time (repeatable; default: this checkout)')
  parser.add_argument('--rounds', type=int, default=5, help='fresh processes per tree (default 5)')
  parser.add_argument('--smoke', action='store_true', help="the tests' small model, one round")
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                      help="a config override on top of bench_tiny's, e.g. --set model.scan_layers=True")
  parser.add_argument('--process', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.process:
    measure_process(args.smoke, args.set)
    return 0
  trees = [t.resolve() for t in args.tree] or [REPO]
  rounds = 1 if args.smoke else args.rounds
  load_average = os.getloadavg()
  results = {tree: [] for tree in trees}
  for i in range(rounds):
    for tree in trees:
      results[tree].append(measure(tree, args.smoke, args.set))
    print(f'round {i + 1} of {rounds} done', flush=True)
  load_average += os.getloadavg()
  import harness

  print(f'\nbench_tiny{"".join(f" {o}" for o in args.set)}. '
        f'Medians of {rounds} fresh process(es) per tree, taken in turn. Load average (1, 5, 15 min) '
        f'before: {", ".join(f"{x:.1f}" for x in load_average[:3])}; after: '
        f'{", ".join(f"{x:.1f}" for x in load_average[3:])}.')
  for i, what in enumerate(('wall', 'CPU')):
    rows = []
    for tree, runs in results.items():
      medians = [statistics.median(r[key][i] for r in runs) for key in HEADER[1:]]
      rows.append([str(tree), *(f'{m:.2f}' for m in medians[:-1]), f'{medians[-1]:.0f}'])
    print(f'\n{what} seconds:\n')
    print(harness.table(HEADER, rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
