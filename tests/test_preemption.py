"""A stop request that reaches any subset of a run's processes, at any moment, stops them all after the
same step, saved, with exit status 0; the next start resumes bit-exactly.

Real processes and real signals: two processes under scripts/launch_local.py or started by hand through
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID. One run is interrupted again and again,
each time at another moment and by another route, and its losses must equal an uninterrupted run's.
Every process has a timeout.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from helpers import REPO, SMALL, free_port, script_env, script_flags

pytestmark = pytest.mark.cluster

STEPS = 300
ARGS = ['--config', 'mintrain/configs/dp4_tp2.py',
        *script_flags(*SMALL, 'train.log_every=1', f'train.steps={STEPS}', 'checkpoint.every_steps=25',
                      'checkpoint.keep=100', 'eval.every_steps=50', 'eval.steps=20')]
# Seconds from the signal, or from the first step if that ends later (every process finishes its compile
# first; a compile is not interrupted), until every process has exited (README states it).
STOP_BOUND = 20.0
START_TIMEOUT = 240


class Job:
  """Two processes of scripts/train.py, their output gathered line by line."""

  def __init__(self, workdir: pathlib.Path, by_hand: bool):
    self.workdir, self.lines, self.lock = workdir, [], threading.Lock()
    self.first_step_at = None  # When the first step of this start was logged.
    self.started = time.monotonic()
    train = [sys.executable, 'scripts/train.py', '--workdir', str(workdir), *ARGS]
    env = script_env()
    if by_hand:
      address = f'127.0.0.1:{free_port()}'
      self.procs = [subprocess.Popen(train, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=dict(env, JAX_COORDINATOR_ADDRESS=address,
                                                         JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(i),
                                                         JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES='4'))
                    for i in range(2)]
      self.pids = {i: p.pid for i, p in enumerate(self.procs)}
    else:
      self.procs = [subprocess.Popen([sys.executable, 'scripts/launch_local.py', '--num_processes', '2', '--',
                                      *train], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)]
      self.pids = {}
    self.readers = [threading.Thread(target=self._read, args=(i, p), daemon=True)
                    for i, p in enumerate(self.procs)]
    for reader in self.readers:
      reader.start()
    if not by_hand:
      self.wait_for(lambda: len(self.pids) == 2, 'the launcher names its processes')

  def _read(self, index: int, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
      if self.first_step_at is None and re.search(r'step \d+/\d+ .*\| loss', line):
        self.first_step_at = time.monotonic()
      with self.lock:
        who = '' if len(self.procs) == 1 else f'[{index}] '
        self.lines.append(f'{time.monotonic() - self.started:7.2f} {who}{line}')
        found = re.match(r'\[launcher\] process (\d): pid (\d+)', line)
        if found:
          self.pids[int(found[1])] = int(found[2])

  @property
  def output(self) -> str:
    with self.lock:
      return ''.join(self.lines)

  def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
      if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
        self.kill()
        raise AssertionError(f'never saw: {what}\n{self.output}')
      time.sleep(0.01)

  def steps_logged(self) -> int:
    return max(logged_losses(self.workdir), default=0)

  def finish(self, timeout: float) -> list[int]:
    try:
      return [p.wait(timeout=timeout) for p in self.procs]
    except subprocess.TimeoutExpired:
      self.kill()
      raise AssertionError(f'still running {timeout:.0f} s after the stop request\n{self.output}') from None

  def kill(self) -> None:
    for pid in self.pids.values():
      _kill(pid)
    for p in self.procs:
      p.kill()
      p.wait(timeout=30)


def _kill(pid: int) -> None:
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def logged_losses(workdir: pathlib.Path) -> dict[int, float]:
  path = workdir / 'metrics.jsonl'
  if not path.exists():
    return {}
  records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith('}')]
  return {r['step']: r['loss'] for r in records if 'loss' in r}


def saving(workdir: pathlib.Path) -> bool:
  folder = workdir / 'checkpoints'
  return folder.exists() and any('tmp' in p.name for p in folder.iterdir())


def saved_steps(workdir: pathlib.Path) -> list[int]:
  folder = workdir / 'checkpoints'
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


# (moment, how the processes start, whom the signal reaches, which signal, when it is sent)
SEGMENTS = [
    ('compile', False, 1, signal.SIGTERM, lambda job, start: 'model: ' in job.output),
    ('restore', False, 0, signal.SIGTERM, lambda job, start: 'model: ' in job.output),
    ('step', True, 1, signal.SIGINT, lambda job, start: job.steps_logged() >= start + 5),
    ('evaluation', False, 1, signal.SIGTERM,
     lambda job, start: job.steps_logged() >= (start // 50 + 1) * 50),
    ('save', True, 0, signal.SIGTERM, lambda job, start: saving(job.workdir)),
    ('both', False, 'launcher', signal.SIGTERM, lambda job, start: job.steps_logged() >= start + 5),
]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory) -> dict[int, float]:
  workdir = tmp_path_factory.mktemp('uninterrupted')
  job = Job(workdir, by_hand=False)
  assert job.finish(600) == [0], job.output
  losses = logged_losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return losses


def test_a_stop_at_any_moment_to_any_process_stops_all_at_one_saved_step_and_resume_is_exact(
    tmp_path, uninterrupted):
  workdir = tmp_path / 'run'
  start = 0
  for moment, by_hand, target, sig, due in SEGMENTS:
    job = Job(workdir, by_hand)
    job.wait_for(lambda: due(job, start), f'the moment "{moment}"')  # noqa: B023 (used at once)
    sent = time.monotonic()
    os.kill(job.procs[0].pid if target == 'launcher' else job.pids[target], sig)
    codes = job.finish(timeout=STOP_BOUND + START_TIMEOUT)
    elapsed = time.monotonic() - max(sent, job.first_step_at or sent)
    out = job.output
    assert codes == [0] * len(codes), f'{moment}: exit statuses {codes}\n{out}'
    stopped = re.search(r'(?:Received SIG[A-Z]+|Stopped by .*): finished step (\d+), saved step \1 to ', out)
    assert stopped, f'{moment}: no stop line\n{out}'
    step = int(stopped[1])
    assert step > start and saved_steps(workdir)[-1] == step, (moment, step, saved_steps(workdir))
    assert elapsed < STOP_BOUND, f'{moment}: {elapsed:.1f} s from the signal to the exit of all\n{out}'
    assert len(re.findall(r'finished step \d+, saved step', out)) == 1, out  # Process 0 alone reports.
    if start:
      assert f'Resuming from step {start} ' in out, out
    start = step

  job = Job(workdir, by_hand=False)
  assert job.finish(600) == [0], job.output
  assert logged_losses(workdir) == uninterrupted
