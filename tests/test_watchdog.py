"""The hang watchdog: a loop that stops making progress has its stacks written and its place named; and the
run's time split (goodput) adds up."""

import os
import re
import signal
import time

import pytest
import test_dead_peer
from helpers import TINY, load_config, mesh_devices, quiet

from mintrain import loop as train_loop
from mintrain import metrics
from mintrain.runtime.watchdog import Watchdog


def stuck_in_a_function_of_its_own(seconds):
  time.sleep(seconds)


def test_a_loop_without_progress_has_its_stacks_written_and_its_place_named_once_per_timeout(tmp_path):
  warnings = []
  with Watchdog(0.4, tmp_path, warnings.append) as watchdog:
    watchdog.beat()
    stuck_in_a_function_of_its_own(1.5)
    watchdog.beat()
    time.sleep(0.2)  # Progress again: no new report.
  assert 1 <= len(warnings) <= 3, warnings
  assert 'no training step finished' in warnings[0] and 'hang_timeout_s' in warnings[0]
  assert 'test_watchdog.py' in warnings[0] and 'stuck_in_a_function_of_its_own' in warnings[0]
  assert str(tmp_path / 'hang.log') in warnings[0]
  dump = (tmp_path / 'hang.log').read_text()
  assert 'stuck_in_a_function_of_its_own' in dump and 'mintrain-watchdog' not in dump.split('\n')[0]


def test_a_steady_loop_is_never_reported(tmp_path):
  warnings = []
  with Watchdog(0.5, tmp_path, warnings.append) as watchdog:
    for _ in range(12):
      watchdog.beat()
      time.sleep(0.1)
  assert warnings == [] and not (tmp_path / 'hang.log').exists()


def test_the_time_split_adds_up_to_the_run_and_goodput_is_the_steps_share(tmp_path):
  config = load_config('single', *TINY, 'train.steps=6', 'train.log_every=2', 'checkpoint.every_steps=3',
                       'eval.steps=1', 'eval.every_steps=3')
  result = train_loop.run(config, tmp_path, devices=mesh_devices(config), print_fn=quiet)
  s = result.summary
  split = {name: s[f'time_{name}_sec'] for name in metrics.TIME_SPLIT}
  assert all(v >= 0 for v in split.values()) and split['steps'] > 0 and split['compile'] > 0
  assert split['checkpointing'] > 0 and split['evaluation'] > 0
  assert sum(split.values()) == pytest.approx(s['total_time_sec'], rel=0.02)
  assert s['goodput'] == pytest.approx(split['steps'] / s['total_time_sec'])
  last = [r for r in result.records if 'goodput' in r][-1]
  assert last['step'] == 6 and last['time_steps_sec'] == split['steps']


@pytest.mark.cluster
def test_a_run_whose_peer_is_stopped_names_where_it_waits_and_writes_its_stacks(tmp_path):
  """Two real processes; one is stopped with SIGSTOP (its sockets stay open, so nothing sees it die): the
  other hangs in the step's collectives, and its watchdog says so within the timeout."""
  procs, _, lines = test_dead_peer.start(tmp_path / 'run', by_hand=True,
                                         extra=('--config.train.hang_timeout_s=5',))
  try:
    test_dead_peer.wait_for(lambda: any(line.startswith('[0] step 3/') for line in lines), 'step 3', procs,
                            lines)
    os.kill(procs[1].pid, signal.SIGSTOP)
    stopped, before = time.monotonic(), len(lines)  # Start-up and compilation may have been reported.

    def warned() -> list[str]:
      return [line for line in lines[before:]
              if line.startswith('[0]') and 'no training step finished' in line]

    test_dead_peer.wait_for(lambda: bool(warned()), 'the watchdog', procs, lines, timeout=60)
    assert time.monotonic() - stopped < 5 + 20
    assert re.search(r'the main thread is at \S+\.py:\d+ in \w+', warned()[0]), ''.join(lines)
  finally:
    for p in procs:
      os.kill(p.pid, signal.SIGCONT)
      p.kill()
      p.wait()
  last = (tmp_path / 'run' / 'logs' / 'hang.log').read_text().split('--- no step finished')[-1]
  assert 'most recent call first' in last and 'mintrain/loop.py' in last
