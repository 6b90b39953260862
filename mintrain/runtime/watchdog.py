"""A hang watchdog: when the training loop makes no progress for `timeout` seconds, every process writes
the Python stacks of all its threads to the workdir's log and says on the console where its main thread
is, so a hung collective, a stalled data source or a deadlock names its line instead of waiting silently.
"""

from __future__ import annotations

import faulthandler
import pathlib
import sys
import threading
import time
import traceback
from collections.abc import Callable

import jax


class Watchdog:
  """`beat()` at every step; a thread checks the time since the last beat. It reports each hang once
  (and again after each further `timeout`), and never stops the run: a slow step may yet finish."""

  def __init__(self, timeout: float, log_dir: pathlib.Path | None, warn: Callable[[str], None]):
    self.timeout, self.warn = timeout, warn
    index = jax.process_index()
    self.path = None if log_dir is None else log_dir / ('hang.log' if index == 0 else f'hang.{index}.log')
    self.main = threading.main_thread().ident
    self._last, self._stop = time.monotonic(), threading.Event()
    self._thread = threading.Thread(target=self._watch, name='mintrain-watchdog', daemon=True)

  def beat(self) -> None:
    self._last = time.monotonic()

  def _watch(self) -> None:
    reported = self._last
    while not self._stop.wait(min(self.timeout / 4, 5.0)):
      last = self._last
      idle = time.monotonic() - last
      if idle >= self.timeout and time.monotonic() - max(reported, last) >= self.timeout:
        reported = time.monotonic()
        self._report(idle)

  def _report(self, idle: float) -> None:
    where = 'stacks of every thread follow on stderr'
    if self.path is not None:
      try:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, 'a') as f:
          f.write(f'--- no step finished for {idle:.0f} s (process {jax.process_index()}) at '
                  f'{time.strftime("%Y-%m-%d %H:%M:%S")} ---\n')
          f.flush()
          faulthandler.dump_traceback(f, all_threads=True)
        where = f'stacks of every thread written to {self.path}'
      except OSError:
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
    else:
      faulthandler.dump_traceback(sys.stderr, all_threads=True)
    self.warn(f'warning: process {jax.process_index()}: no training step finished for {idle:.0f} s '
              f'(train.hang_timeout_s); the main thread is at {self.main_thread_at()}; {where}.')

  def main_thread_at(self) -> str:
    """The main thread's innermost frame in mintrain (else its innermost frame): `file:line in function`."""
    frame = sys._current_frames().get(self.main)
    if frame is None:
      return 'an unknown place'
    stack = traceback.extract_stack(frame)
    ours = [f for f in stack if '/mintrain/' in f.filename.replace('\\', '/')]
    at = (ours or stack)[-1]
    return f'{at.filename}:{at.lineno} in {at.name} ({(at.line or "").strip()})'

  def __enter__(self) -> Watchdog:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
