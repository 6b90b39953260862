"""One run per workdir: process 0 holds `WORKDIR/run.lock` for the run's life.

Two runs on one workdir would write the same checkpoint steps and interleave metrics.jsonl. The lock names
its holder (host, pid, start time, command). A holder on this host (same hostname) whose process is gone
left its lock behind: it is taken over with a warning. One on another host cannot be checked from here;
`force` takes over any lock. The caller decides which process is process 0.

Local paths create the lock with O_CREAT | O_EXCL, and a stale one is renamed aside first, so exactly one
of many runs started at once holds it. Remote paths (`gs://`, `s3://`) have no atomic create: the lock is
read back after REMOTE_SETTLE_S seconds and must still be ours, which refuses a run started while another
holds it, but not two started within the same few seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import shlex
import socket
import sys
import time
from collections.abc import Callable

from etils import epath

from mintrain.errors import RunLockError

LOCK_FILE = 'run.lock'
REMOTE_SETTLE_S = 2.0  # Longer than a remote write takes to become visible to every reader.
WRITE_GRACE_S = 2.0  # How long an unreadable lock may be a run's lock being written (created, not filled).


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds a lock: enough to tell whether it still runs, and to tell a person whom they wait for."""

  host: str
  pid: int
  start_time: str  # When the lock was taken, ISO 8601 with the UTC offset.
  command: str
  process_start: str | None = None  # '<boot id>:<start ticks>' from /proc, so a reused pid is told apart.

  @classmethod
  def this_process(cls) -> Holder:
    pid = os.getpid()
    stat = _proc_stat(pid)
    return cls(host=socket.gethostname(), pid=pid,
               start_time=datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
               command=shlex.join([pathlib.Path(sys.executable).name, *sys.argv]),
               process_start=stat[1] if stat else None)

  @classmethod
  def parse(cls, text: str) -> Holder:
    """The holder a lock file names; ValueError if it names none."""
    try:
      values = json.loads(text)
      holder = cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
    except (TypeError, AttributeError) as e:  # Not an object, or a field missing.
      raise ValueError(str(e)) from None
    if not isinstance(holder.pid, int) or holder.pid <= 0 or not isinstance(holder.host, str):
      raise ValueError('no valid host and pid')
    return holder

  def text(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1) + '\n'

  def describe(self) -> str:
    command = self.command if len(self.command) <= 160 else self.command[:157] + '...'
    return f'pid {self.pid} on host {self.host}, started {self.start_time} (`{command}`)'

  def on_this_host(self) -> bool:
    return self.host == socket.gethostname()

  def running(self) -> bool:
    """Whether the holder (on this host) still runs: its pid exists, is no zombie, and started when it did."""
    try:
      os.kill(self.pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass  # It runs, as another user.
    stat = _proc_stat(self.pid)
    if stat is None:  # No /proc (macOS): the pid is all there is to go by.
      return True
    state, start = stat
    return state != 'Z' and (self.process_start is None or start == self.process_start)


def _proc_stat(pid: int) -> tuple[str, str] | None:
  """(state, '<boot id>:<start ticks>') of `pid` from /proc; None where there is no /proc or no such pid."""
  try:
    stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
    boot_id = pathlib.Path('/proc/sys/kernel/random/boot_id').read_text().strip()
  except OSError:
    return None
  fields = stat[stat.rindex(')') + 2:].split()  # The command name, in parentheses, may hold spaces.
  return fields[0], f'{boot_id}:{fields[19]}'


def _is_local(path: epath.Path) -> bool:
  return '://' not in str(path)


class RunLock:
  """Holds `WORKDIR/run.lock` while entered; raises RunLockError on entry if another run holds it.

  `warn` receives the one-line warnings (a lock taken over, a lock found taken over on release).
  """

  def __init__(self, workdir: str | os.PathLike, *, force: bool = False,
               warn: Callable[[str], None] = print):
    self.workdir = epath.Path(workdir)
    self.path = self.workdir / LOCK_FILE
    self.force, self.warn = force, warn
    self.holder = Holder.this_process()
    self._text = self.holder.text()

  def __enter__(self) -> RunLock:
    try:
      self._make_workdir()
      if _is_local(self.path):
        self._acquire_local()
      else:
        self._acquire_remote()
    except OSError as e:
      raise RunLockError(f'Cannot take the run lock {self.path}: {e.strerror or e}; choose a writable '
                         '--workdir.') from None
    return self

  def __exit__(self, *exc) -> None:
    """Removes the lock if it is still this run's; never hides the error the run may be ending with."""
    try:
      text = self.path.read_text()
    except OSError:
      self.warn(f'warning: the run lock {self.path} was removed while this run held it.')
      return
    if text != self._text:
      self.warn(f'warning: the run lock {self.path} was taken over by {_describe(text)}; leaving it.')
      return
    with contextlib.suppress(OSError):
      self.path.unlink()

  def _make_workdir(self) -> None:
    if self.workdir.exists() and not self.workdir.is_dir():
      raise RunLockError(f'The workdir {self.workdir} is a file, not a directory; choose another --workdir.')
    try:
      self.workdir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
      raise RunLockError(f'Cannot create the workdir {self.workdir}: a part of its path is a file; choose '
                         'another --workdir.') from None

  def _acquire_local(self) -> None:
    """O_EXCL create; a lock found in the way is judged, and moved aside if its holder is gone."""
    path, taking_over = os.fspath(self.path), None
    for _ in range(5):  # Each round ends held, refused, or with a lock that changed under us.
      try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        text = self._read_settled()
        if text is not None:
          taking_over = self._judge(text)
          self._move_aside(path, text)
        continue
      try:
        with os.fdopen(fd, 'w') as f:
          f.write(self._text)
          f.flush()
          os.fsync(f.fileno())
      except OSError:
        os.unlink(path)  # An empty lock would stop the next run for nothing.
        raise
      if taking_over:
        self.warn(taking_over)
      return
    raise RunLockError(f'The run lock {self.path} keeps changing: other runs are starting on '
                       f'{self.workdir} at the same time.')

  def _read_settled(self) -> str | None:
    """The lock's text once it names a holder (or WRITE_GRACE_S has passed); None if it is gone."""
    deadline = time.monotonic() + WRITE_GRACE_S
    while True:
      try:
        text = self.path.read_text()
      except FileNotFoundError:
        return None
      try:
        Holder.parse(text)
        return text
      except ValueError:
        if time.monotonic() > deadline:
          return text
        time.sleep(0.05)

  def _judge(self, text: str) -> str:
    """Raises RunLockError if the lock's holder may still run; else the warning to give once it is ours."""
    try:
      holder = Holder.parse(text)
    except ValueError:
      if self.force:
        return f'warning: took over the run lock {self.path}, which named no holder (forced).'
      raise RunLockError(f'The run lock {self.path} names no holder ({text[:80]!r}); if no run uses '
                         f'{self.workdir}, delete it or pass --force.') from None
    if holder.on_this_host() and not holder.running():
      return (f'warning: took over the run lock {self.path} from {holder.describe()}, which is no longer '
              'running.')
    if self.force:
      return (f'warning: took over the run lock {self.path} from {holder.describe()} (forced; if it still '
              'runs, both runs write to this workdir).')
    where = '' if holder.on_this_host() else ' (another host: whether it still runs cannot be checked here)'
    raise RunLockError(f'{self.workdir} is in use by another run: {holder.describe()}{where}. Wait for it '
                       'to finish, or pass --force if you are sure it is gone.')

  def _move_aside(self, path: str, stale: str) -> None:
    """Removes the stale lock, unless another run replaced it since it was read: that one is put back."""
    aside = f'{path}.stale.{os.getpid()}'
    try:
      os.rename(path, aside)  # Atomic: of several runs taking over, one moves it.
    except FileNotFoundError:
      return
    try:
      if pathlib.Path(aside).read_text() != stale:
        with contextlib.suppress(FileExistsError):
          os.link(aside, path)
    finally:
      os.unlink(aside)

  def _acquire_remote(self) -> None:
    """Write, pause, read back: the best a store without atomic create allows (see the module doc)."""
    taking_over = self._judge(self.path.read_text()) if self.path.exists() else None
    self.path.write_text(self._text)
    time.sleep(REMOTE_SETTLE_S)
    text = self.path.read_text()
    if text != self._text:
      raise RunLockError(f'{self.workdir} was taken at the same time by another run: {_describe(text)}. '
                         'Wait for it to finish, or pass --force if you are sure it is gone.')
    if taking_over:
      self.warn(taking_over)


def _describe(text: str) -> str:
  try:
    return Holder.parse(text).describe()
  except ValueError:
    return f'a lock naming no holder ({text[:80]!r})'
