"""Stop requests every process agrees on: a SIGTERM or SIGINT reaching any subset of the processes, or a
preemption notice, stops all of them after the same step. The decision is JAX's preemption service's (a
process stopping on its own flag would deadlock the others' collectives), fed this run's own step counter;
only SIGINT gets a Python handler, which passes the request on to JAX as a SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal

import jax
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)
AGREED = 'a stop request agreed by all processes (SIGTERM or SIGINT to one of them, or a preemption notice)'


class StopRequests:
  """As a context, turns stop signals into a decision `should_stop` gives alike on every process."""

  def __init__(self):
    self.received: str | None = None  # The signal this process received, if Python saw it.
    self.agreed = jax.process_count() > 1
    self._previous: dict[signal.Signals, object] = {}

  def __enter__(self) -> StopRequests:
    if self.agreed:
      try:
        multihost_utils.reached_preemption_sync_point(0)  # Counter 0: no step taken yet.
      except RuntimeError as e:  # jax_enable_preemption_service is off.
        raise RuntimeError('Multi-process runs agree on stops through JAX\'s preemption service; '
                           'leave jax_enable_preemption_service on.') from e
    try:
      for sig in (signal.SIGINT,) if self.agreed else SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    except ValueError:  # Not the main thread: leave signals alone.
      self._previous = {}
    return self

  def _handle(self, signum: int, frame) -> None:
    self.received = signal.Signals(signum).name
    if self.agreed:
      os.kill(os.getpid(), signal.SIGTERM)  # To JAX's handler, which tells the other processes.

  def should_stop(self, steps_taken: int) -> bool:
    """Whether to stop after this run's `steps_taken`-th step (1, 2, ...): the same on every process."""
    if self.agreed:
      return multihost_utils.reached_preemption_sync_point(steps_taken)
    return self.received is not None

  @property
  def reason(self) -> str:
    return self.received or AGREED

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
    if self.agreed:
      # The run is saved; a SIGTERM now would start an agreement that processes already shutting down
      # never join (JAX's barrier waits 3 minutes). Let the exit finish instead.
      with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
