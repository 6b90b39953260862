"""Every way out of the training loop leaves the run clean: the asynchronous save in flight is finished,
the profiler trace is closed, the metrics are flushed, the signal handlers are given back and the global
loggers lose the checkpoints' filters."""

from __future__ import annotations

import json
import logging
import signal
import sys

import helpers
import jax
import numpy as np
import pytest
from helpers import load_config, mesh_devices, quiet
from tensorboard.backend.event_processing import event_accumulator

from mintrain import loop as train_loop
from mintrain.build import Run
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.errors import NonFiniteLossError

SMALL = ('data.source=synthetic', *helpers.SMALL, 'train.steps=6', 'train.log_every=1', 'eval.every_steps=0',
         'eval.steps=1', 'checkpoint.every_steps=1', 'checkpoint.keep=10', 'profile.start_step=2',
         'profile.num_steps=100')
TRIGGER_STEP = 4


class Trigger:
  """The train batches, with `action` run when the batch of step TRIGGER_STEP is taken."""

  def __init__(self, batches, action):
    self.batches, self.action, self.taken = batches, action, 0

  def __next__(self):
    self.taken += 1
    if self.taken == TRIGGER_STEP:
      self.action()
    return next(self.batches)

  def __getattr__(self, name):
    return getattr(self.batches, name)


def raise_error():
  raise RuntimeError('the disk is on fire')


def non_finite_at_step_4(check):
  def checked(first_step, fetched):
    if first_step + len(fetched) >= TRIGGER_STEP:
      raise NonFiniteLossError(f'Non-finite loss=nan at step {TRIGGER_STEP} (simulated).')
    check(first_step, fetched)
  return checked


# Exit path -> (what is patched, the exception the run ends with, the steps saved).
PATHS = {
    'success': (None, None, [1, 2, 3, 4, 5, 6]),
    'signal': ('batches', None, [1, 2, 3, 4]),
    'non_finite': ('check', NonFiniteLossError, [1, 2, 3]),
    'exception': ('batches', RuntimeError, [1, 2, 3]),
}


@pytest.mark.parametrize('path', PATHS)
def test_every_exit_finishes_the_save_closes_the_trace_and_flushes_the_metrics(path, tmp_path, monkeypatch):
  patched, error, saved = PATHS[path]
  if patched == 'batches':
    action = (lambda: signal.raise_signal(signal.SIGTERM)) if path == 'signal' else raise_error
    make = Run.batches
    monkeypatch.setattr(Run, 'batches', lambda self, tok, split='train': (
        Trigger(make(self, tok, split), action) if split == 'train' else make(self, tok, split)))
  if patched == 'check':
    monkeypatch.setattr(train_loop, 'check_finite', non_finite_at_step_4(train_loop.check_finite))
  handler = signal.getsignal(signal.SIGTERM)
  config = load_config('dp4_tp2', *SMALL)
  filters = {name: list(logging.getLogger(name).filters) for name in ('absl', 'asyncio')}
  loggers = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
             for name in ('absl', 'asyncio')}
  unraisable = sys.unraisablehook

  def train():
    return train_loop.run(config, tmp_path, devices=mesh_devices(config), print_fn=quiet)

  if error is None:
    result = train()
    assert result.stopped_by == ('SIGTERM' if path == 'signal' else None)
  else:
    with pytest.raises(error):
      train()

  # The save in flight was finished: every step up to the last saved one is complete and readable.
  checkpoints = ckpt_lib.Checkpoints(tmp_path / 'checkpoints', read_only=True)
  assert checkpoints.steps() == saved
  assert not [p for p in (tmp_path / 'checkpoints').iterdir() if 'tmp' in p.name]
  assert checkpoints.metadata(saved[-1])['step'] == saved[-1]
  # The trace was closed (a new one can start) and written.
  jax.profiler.start_trace(str(tmp_path / 'probe'))
  jax.profiler.stop_trace()
  assert list((tmp_path / 'profile').rglob('*.xplane.pb'))
  # The metrics were flushed: TensorBoard holds every loss that metrics.jsonl holds.
  records = map(json.loads, (tmp_path / 'metrics.jsonl').read_text().splitlines())
  jsonl = {r['step']: r['loss'] for r in records if 'loss' in r}
  acc = event_accumulator.EventAccumulator(str(tmp_path / 'tensorboard'), size_guidance={'scalars': 0})
  acc.Reload()
  events = {e.step: e.value for e in acc.Scalars('loss')}
  assert sorted(jsonl) == sorted(events) == saved[:len(jsonl)] and len(jsonl) >= len(saved) - 1
  np.testing.assert_allclose([events[s] for s in sorted(events)], [jsonl[s] for s in sorted(jsonl)],
                             rtol=1e-6)
  assert signal.getsignal(signal.SIGTERM) is handler
  # The checkpoints' log filters were taken off the global loggers with them (other tests of this worker
  # may have left their own).
  assert {name: list(logging.getLogger(name).filters) for name in filters} == filters
  # The run's log file took the libraries' records and Python's unraisable exceptions for the run only.
  assert {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
          for name in loggers} == loggers
  assert sys.unraisablehook is unraisable
