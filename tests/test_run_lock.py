"""One run per workdir: the lock is held by real processes here, alive, killed, racing and forced."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import REPO

from mintrain.errors import RunLockError
from mintrain.runtime import run_lock
from mintrain.runtime.run_lock import RunLock

TIMEOUT_S = 60

# A run that takes the lock, says `held`, and keeps it until its stdin closes (then releases it). With
# `raise`, it raises inside the lock instead. It starts at the time given, so that racers start together.
RUN = '''
import sys, time
from mintrain.errors import RunLockError
from mintrain.runtime.run_lock import RunLock
workdir, mode, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
time.sleep(max(0.0, start_at - time.time()))
try:
  with RunLock(workdir, force=mode == 'force'):
    print('held', flush=True)
    if mode == 'raise':
      raise RuntimeError('the run failed')
    sys.stdin.readline()
except RunLockError as e:
  print('refused', e, flush=True)
'''


class Runs:
  """Child processes running RUN, their stdout read line by line as it comes; every one is killed and
  reaped at the end of the test."""

  def __init__(self):
    self.procs: list[subprocess.Popen] = []
    self.lines: dict[int, queue.Queue] = {}
    self.warnings: dict[int, list[str]] = {}

  def start(self, workdir, mode: str = 'hold', start_at: float = 0.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, '-c', RUN, str(workdir), mode, str(start_at)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self.procs.append(proc)
    self.lines[proc.pid] = lines = queue.Queue()
    self.warnings[proc.pid] = []

    def read():
      for line in proc.stdout:
        lines.put(line)
      lines.put('')  # The end.

    threading.Thread(target=read, daemon=True).start()
    return proc

  def first_line(self, proc: subprocess.Popen) -> str:
    """Its first line after any warning (of a lock it took over): `held` or `refused ...`."""
    while True:
      try:
        line = self.lines[proc.pid].get(timeout=TIMEOUT_S)
      except queue.Empty:
        raise AssertionError(f'pid {proc.pid} said nothing in {TIMEOUT_S} s') from None
      assert line, f'pid {proc.pid} exited without a word: {proc.stderr.read()}'
      if not line.startswith('warning: '):
        return line.strip()
      self.warnings[proc.pid].append(line)

  def rest(self, proc: subprocess.Popen) -> str:
    """What it printed after the lines already taken, once it has ended."""
    proc.wait(timeout=TIMEOUT_S)
    lines = []
    while (line := self.lines[proc.pid].get(timeout=TIMEOUT_S)):
      lines.append(line)
    return ''.join(lines)

  def holding(self, workdir) -> subprocess.Popen:
    proc = self.start(workdir)
    assert self.first_line(proc) == 'held'
    return proc

  def finish(self, proc: subprocess.Popen) -> str:
    """Closes its stdin (it releases the lock) and waits for it: the rest of its stdout."""
    proc.stdin.close()
    return self.rest(proc)

  def close(self) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait(timeout=TIMEOUT_S)
      for stream in (proc.stdin, proc.stderr):
        stream.close()


@pytest.fixture
def runs():
  r = Runs()
  yield r
  r.close()


def lock_of(workdir) -> dict:
  return json.loads((workdir / run_lock.LOCK_FILE).read_text())


def write_lock(workdir, **fields) -> None:
  workdir.mkdir(exist_ok=True)
  holder = {'host': socket.gethostname(), 'pid': 1, 'start_time': '2025-01-01T00:00:00+00:00',
            'command': 'python scripts/train.py', **fields}
  (workdir / run_lock.LOCK_FILE).write_text(json.dumps(holder))


def test_the_lock_names_host_pid_start_time_and_command_and_goes_when_the_run_ends(tmp_path, runs):
  proc = runs.holding(tmp_path)
  holder = lock_of(tmp_path)
  assert (holder['host'], holder['pid']) == (socket.gethostname(), proc.pid)
  assert holder['start_time'][:4].isdigit() and 'python' in holder['command']
  runs.finish(proc)
  assert proc.returncode == 0
  assert not (tmp_path / run_lock.LOCK_FILE).exists()


def test_a_second_run_is_refused_naming_the_live_holder(tmp_path, runs):
  proc = runs.holding(tmp_path)
  with pytest.raises(RunLockError) as e:
    with RunLock(tmp_path):
      pass
  message = str(e.value)
  assert f'pid {proc.pid} on host {socket.gethostname()}, started ' in message
  assert 'Wait for it to finish, or pass --force' in message and '\n' not in message
  assert lock_of(tmp_path)['pid'] == proc.pid  # The holder's lock is untouched.


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, runs):
  proc = runs.holding(tmp_path)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=TIMEOUT_S)
  assert lock_of(tmp_path)['pid'] == proc.pid
  warnings = []
  with RunLock(tmp_path, warn=warnings.append):
    assert lock_of(tmp_path)['pid'] == os.getpid()
  assert len(warnings) == 1 and f'from pid {proc.pid} on host' in warnings[0]
  assert 'no longer running' in warnings[0]
  assert not (tmp_path / run_lock.LOCK_FILE).exists()


def test_a_lock_whose_pid_now_belongs_to_a_later_process_is_taken_over(tmp_path, runs):
  other = runs.holding(tmp_path / 'elsewhere')  # Alive, but not the process that took this lock.
  write_lock(tmp_path, pid=other.pid, process_start='another-boot:12345')
  warnings = []
  with RunLock(tmp_path, warn=warnings.append):
    assert lock_of(tmp_path)['pid'] == os.getpid()
  assert len(warnings) == 1 and 'no longer running' in warnings[0]


def test_a_lock_from_another_host_is_refused_naming_the_host(tmp_path):
  write_lock(tmp_path, host='gpu-node-7', pid=4242)
  with pytest.raises(RunLockError, match=r'pid 4242 on host gpu-node-7, .*another host: whether it still '
                     r'runs cannot be checked here.*--force'):
    with RunLock(tmp_path):
      pass
  assert lock_of(tmp_path)['host'] == 'gpu-node-7'


def test_force_takes_over_any_lock_with_a_warning_and_the_old_holder_leaves_it_alone(tmp_path, runs):
  proc = runs.holding(tmp_path)
  warnings = []
  with RunLock(tmp_path, force=True, warn=warnings.append):
    assert len(warnings) == 1 and f'from pid {proc.pid}' in warnings[0] and 'forced' in warnings[0]
    out = runs.finish(proc)  # The old holder ends: the lock is no longer its own to remove.
    assert proc.returncode == 0
    assert f'was taken over by pid {os.getpid()}' in out
    assert lock_of(tmp_path)['pid'] == os.getpid()
  assert not (tmp_path / run_lock.LOCK_FILE).exists()

  write_lock(tmp_path, host='gpu-node-7')
  warnings = []
  with RunLock(tmp_path, force=True, warn=warnings.append):
    assert lock_of(tmp_path)['pid'] == os.getpid()
  assert len(warnings) == 1 and 'gpu-node-7' in warnings[0]


def test_the_lock_is_released_when_the_run_raises(tmp_path, runs):
  proc = runs.start(tmp_path, 'raise')
  assert runs.first_line(proc) == 'held'
  runs.rest(proc)
  assert proc.returncode == 1 and 'RuntimeError: the run failed' in proc.stderr.read()
  assert not (tmp_path / run_lock.LOCK_FILE).exists()
  warnings = []
  with RunLock(tmp_path, warn=warnings.append):
    pass
  assert warnings == []


@pytest.mark.parametrize('left_by', ['nobody', 'a killed run'])
def test_of_runs_started_at_once_exactly_one_holds_the_lock(tmp_path, runs, left_by):
  if left_by == 'a killed run':
    dead = runs.holding(tmp_path)
    dead.kill()
    dead.wait(timeout=TIMEOUT_S)
  start_at = time.time() + 2.0  # After every racer has started Python.
  racers = [runs.start(tmp_path, start_at=start_at) for _ in range(4)]
  lines = [runs.first_line(proc) for proc in racers]
  held = [proc for proc, line in zip(racers, lines) if line == 'held']
  assert len(held) == 1, lines
  assert lock_of(tmp_path)['pid'] == held[0].pid
  assert all(line.startswith('refused') for line in lines if line != 'held'), lines
  # Only the one that holds it may say it took a lock over: another racer may have moved the dead lock
  # aside first, and then the winner found none to take over (CI saw that order once).
  warned = [proc for proc in racers if runs.warnings[proc.pid]]
  assert warned in ([], held) if left_by == 'a killed run' else warned == []
  assert all(len(runs.warnings[proc.pid]) <= 1 for proc in racers)


def test_a_lock_that_names_no_holder_is_refused_unless_forced(tmp_path, monkeypatch):
  monkeypatch.setattr(run_lock, 'WRITE_GRACE_S', 0.1)
  tmp_path.joinpath(run_lock.LOCK_FILE).write_text('{"host": "h"')
  with pytest.raises(RunLockError, match='names no holder .* delete it or pass --force'):
    with RunLock(tmp_path):
      pass
  warnings = []
  with RunLock(tmp_path, force=True, warn=warnings.append):
    assert lock_of(tmp_path)['pid'] == os.getpid()
  assert len(warnings) == 1


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / 'run').write_text('not a directory')
  with pytest.raises(RunLockError, match='is a file, not a directory'):
    with RunLock(tmp_path / 'run'):
      pass
  assert (tmp_path / 'run').read_text() == 'not a directory'


def test_without_atomic_create_a_run_started_while_another_holds_the_lock_is_refused(
    tmp_path, runs, monkeypatch):
  # What a gs:// workdir gets: write, pause, read back (exercised here on a local directory).
  monkeypatch.setattr(run_lock, '_is_local', lambda path: False)
  monkeypatch.setattr(run_lock, 'REMOTE_SETTLE_S', 0.0)
  proc = runs.holding(tmp_path)
  with pytest.raises(RunLockError, match=f'pid {proc.pid}'):
    with RunLock(tmp_path):
      pass
  runs.finish(proc)
  with RunLock(tmp_path):
    assert lock_of(tmp_path)['pid'] == os.getpid()
  assert not (tmp_path / run_lock.LOCK_FILE).exists()
