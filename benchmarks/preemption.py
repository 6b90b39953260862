#!/usr/bin/env python
"""What agreeing on stops costs per step, and how long an agreed stop takes, on the default run.

  python benchmarks/preemption.py            # mintrain/configs/dp4_tp2.py in 2 processes, 300 steps, ~1.5 min
  python benchmarks/preemption.py --smoke    # 30 steps

Starts itself in 2 processes (scripts/launch_local.py). Each runs `train_loop.run` on the README's
default config with `StopRequests.should_stop` timed around every call (JAX's preemption sync point: a
mutex and a comparison while no notice is pending), then compares the mean call with the mean step.
A second job is sent SIGTERM to process 1 after step 50, and the time until both exited is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from mintrain import configs

REPO = pathlib.Path(__file__).resolve().parents[1]


def worker(steps: int, workdir: str) -> None:
  """One process of the job: the default run, with the stop check timed."""
  import jax

  from mintrain import config as config_lib
  from mintrain import loop as train_loop
  from mintrain.runtime import preemption, startup

  # The README's default run; the stopped job logs every step, so the signal can follow step N.
  overrides = [f'train.steps={steps}'] + (['train.log_every=1'] if workdir else [])
  config, _ = config_lib.resolve(config_lib.validate(config_lib.load(configs.DIR / 'dp4_tp2.py', overrides)))
  devices = startup.devices_for(config.mesh)
  calls = []
  should_stop = preemption.StopRequests.should_stop

  def timed(self, steps_taken):
    start = time.perf_counter()
    out = should_stop(self, steps_taken)
    calls.append(time.perf_counter() - start)
    return out
  preemption.StopRequests.should_stop = timed
  result = train_loop.run(config, workdir or None, devices=devices, print_fn=lambda _: None)
  step_time = result.summary.get('step_time', float('nan'))
  print('RESULT ' + json.dumps({'process': jax.process_index(), 'calls': len(calls),
                                'check_us': 1e6 * sum(calls) / max(len(calls), 1),
                                'step_ms': 1e3 * step_time}), flush=True)


def launch(steps: int, workdir: str, stop_after: int | None) -> tuple[list[dict], float | None]:
  """Runs the job; with `stop_after`, SIGTERM to process 1 once that many steps are logged."""
  command = [sys.executable, str(REPO / 'scripts' / 'launch_local.py'), '--num_processes', '2', '--',
             sys.executable, __file__, '--worker', '--steps', str(steps), '--workdir', workdir]
  proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
  reader.start()
  sent = None
  while stop_after is not None and sent is None and proc.poll() is None:
    pids = dict(re.findall(r'\[launcher\] process (\d): pid (\d+)', ''.join(lines)))
    if '1' in pids and _logged(workdir) >= stop_after:
      os.kill(int(pids['1']), signal.SIGTERM)
      sent = time.monotonic()
    time.sleep(0.01)
  code = proc.wait(timeout=600)
  elapsed = time.monotonic() - sent if sent else None
  reader.join(timeout=10)
  results = [json.loads(found) for found in re.findall(r'RESULT (.*)', ''.join(lines))]
  if code != 0 or len(results) != 2:
    raise SystemExit(''.join(lines[-40:]))
  return results, elapsed


def _logged(workdir: str) -> int:
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  if not path.exists():
    return 0
  steps = [json.loads(x).get('step', 0) for x in path.read_text().splitlines() if x.endswith('}')]
  return max(steps, default=0)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--steps', type=int, default=300)
  parser.add_argument('--smoke', action='store_true')
  parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--workdir', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()
  steps = 30 if args.smoke else args.steps
  if args.worker:
    worker(steps, args.workdir)
    return
  results, _ = launch(steps, '', None)
  print('| process | stop checks | mean check | mean step | check / step |')
  print('|---|---|---|---|---|')
  for r in sorted(results, key=lambda r: r['process']):
    print(f"| {r['process']} | {r['calls']} | {r['check_us']:.1f} us | {r['step_ms']:.2f} ms | "
          f"{r['check_us'] / (10 * r['step_ms']):.3f}% |")
  with tempfile.TemporaryDirectory() as workdir:
    stop_after = min(50, steps // 2)
    results, elapsed = launch(steps * 10, workdir, stop_after)
    stopped = min(r['calls'] for r in results)
    print(f'\nSIGTERM to process 1 once step {stop_after} was logged: both stopped after step {stopped}, '
          f'saved it and exited {elapsed:.1f} s after the signal.')


if __name__ == '__main__':
  main()
