"""A process killed with SIGKILL after a save stops the other within 10 s, with one line naming the dead
process and the newest saved step, a non-zero status and checkpoints that still restore; none of JAX's
C++ error lines reach the console, also where process 0 dies and JAX's client in the other notices as soon
(the coordination service ran in process 0).

Real processes and a real SIGKILL: two processes under scripts/launch_local.py, or started by hand through
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import REPO, SCRIPT_DEFAULTS, free_port, run_script, script_env

pytestmark = pytest.mark.cluster

ARGS = ['--config', 'mintrain/configs/dp4_tp2.py', '--config.model.num_layers=1',
        '--config.model.embed_dim=64', '--config.model.mlp_dim=128', '--config.train.global_batch_size=16',
        '--config.train.seq_len=32',
        '--config.train.log_every=1', '--config.train.steps=5000', '--config.checkpoint.every_steps=10',
        '--config.eval.every_steps=5000', *SCRIPT_DEFAULTS]
STOP_BOUND = 10.0


def start(workdir: pathlib.Path, by_hand: bool, extra: tuple[str, ...] = ()
          ) -> tuple[list[subprocess.Popen], dict[int, int], list[str]]:
  """(the Popen objects, process id -> OS pid, the output lines as they come)."""
  train = [sys.executable, 'scripts/train.py', '--workdir', str(workdir), *ARGS, *extra]
  if by_hand:
    address = f'127.0.0.1:{free_port()}'
    procs = [subprocess.Popen(train, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(script_env(), JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES='2',
                                       JAX_PROCESS_ID=str(i), JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES='4'))
             for i in range(2)]
  else:
    launch = [sys.executable, 'scripts/launch_local.py', '--num_processes', '2', '--', *train]
    procs = [subprocess.Popen(launch, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=script_env())]
  lines: list[str] = []
  for index, p in enumerate(procs):
    prefix = f'[{index}] ' if by_hand else ''
    threading.Thread(target=lambda p=p, prefix=prefix: lines.extend(prefix + line for line in p.stdout),
                     daemon=True).start()
  pids = {i: p.pid for i, p in enumerate(procs)} if by_hand else {}
  return procs, pids, lines


def wait_for(condition, what: str, procs: list[subprocess.Popen], lines: list[str],
             timeout: float = 240) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      for p in procs:
        p.kill()
      raise AssertionError(f'never saw: {what}\n{"".join(lines)}')
    time.sleep(0.01)


def saved_steps(workdir: pathlib.Path) -> list[int]:
  folder = workdir / 'checkpoints'
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []


@pytest.mark.parametrize('by_hand, victim', [(False, 1), (True, 0), (True, 1)],
                         ids=['launcher-kill-1', 'by-hand-kill-0', 'by-hand-kill-1'])
def test_a_peer_killed_after_a_save_stops_the_other_within_10s_with_one_line_and_the_run_resumes(
    tmp_path, by_hand, victim):
  workdir = tmp_path / 'run'
  procs, pids, lines = start(workdir, by_hand)
  if not by_hand:
    def named() -> bool:
      for line in list(lines):
        found = re.match(r'\[launcher\] process (\d): pid (\d+)', line)
        if found:
          pids[int(found[1])] = int(found[2])
      return len(pids) == 2
    wait_for(named, 'the launcher names its processes', procs, lines)
  wait_for(lambda: saved_steps(workdir)[-1:] >= [10], 'a saved step', procs, lines)
  time.sleep(0.5)  # A few steps past the save.
  saved = saved_steps(workdir)[-1]
  os.kill(pids[victim], signal.SIGKILL)
  killed = time.monotonic()
  survivors = procs if not by_hand else [procs[1 - victim]]
  try:
    codes = [p.wait(timeout=STOP_BOUND + 20) for p in survivors]
  except subprocess.TimeoutExpired:
    codes = None
  finally:
    for p in procs:
      p.kill()
  elapsed = time.monotonic() - killed
  out = ''.join(lines)
  assert codes is not None, f'still running {STOP_BOUND + 20:.0f} s after the SIGKILL\n{out}'
  assert all(code != 0 for code in codes), (codes, out)
  assert elapsed < STOP_BOUND, f'{elapsed:.1f} s from the SIGKILL to the exit of the others\n{out}'
  stops = [line for line in out.splitlines() if re.search(r'error: process \d .* died; ', line)]
  assert len(stops) == 1, out
  assert 'JAX distributed service detected fatal errors' not in out, out
  assert not re.search(r'^(\[\d\] )?[EF]\d{4} ', out, re.MULTILINE), out
  newest = saved_steps(workdir)[-1]
  assert newest >= saved
  dead = rf'process {victim} \(pid {pids[victim]} on [^)]+\)'
  said = rf'error: {dead} died; process {1 - victim} stops too, .* The newest saved step is {newest} '
  assert re.search(said, stops[0]), stops[0]
  assert 'stack trace' not in out and 'Traceback' not in out, out
  if not by_hand:
    assert f'[launcher] process {victim} exited with code -9; stopping the others' in out, out

  resumed = run_script('scripts/train.py', '--workdir', str(workdir), *ARGS,
                       f'--config.train.steps={newest + 1}')
  assert resumed.returncode == 0, resumed.stderr
  assert f'Resuming from step {newest} ' in resumed.stdout, resumed.stdout
