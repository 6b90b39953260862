"""`console_guard` holds back C++ error lines: a peer's death line replaces them; otherwise they come
after a moment or at the end, in order. The real two-process case is tests/test_dead_peer.py (cluster)."""

from __future__ import annotations

import subprocess
import sys
import time

from mintrain.runtime import console_guard

CPP_ERROR = b'E1125 17:49:50.720520   28860 coordination_service_agent.cc:289] Polled an error\n'
FATAL = b'F1125 17:49:50.720600   28860 client.h:80] Terminating process because ...\n'
DIED = b'error: process 0 (pid 7 on vm) died; process 1 stops too, with status 3. Saved: 1\n'


def guard() -> subprocess.Popen:
  return subprocess.Popen([sys.executable, '-I', console_guard.__file__], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE)


def test_a_peers_death_line_replaces_the_errors_before_it_and_ends_the_output():
  out, _ = guard().communicate(b'step 1\n' + CPP_ERROR + FATAL + DIED + FATAL + b'step 2\n')
  assert out == b'step 1\n' + DIED


def test_errors_without_a_death_line_are_written_at_the_end_in_order():
  out, _ = guard().communicate(b'step 1\n' + CPP_ERROR + b'step 2\n' + FATAL + b'no newline')
  assert out == b'step 1\n' + CPP_ERROR + b'step 2\n' + FATAL + b'no newline'


def test_a_held_error_is_written_after_the_hold_while_the_process_runs():
  p = guard()
  p.stdin.write(CPP_ERROR)
  p.stdin.flush()
  start = time.monotonic()
  assert p.stdout.readline() == CPP_ERROR
  assert console_guard.HOLD_S - 0.1 <= time.monotonic() - start < console_guard.HOLD_S + 5
  p.stdin.write(b'step 2\n')
  p.stdin.close()
  assert p.stdout.read() == b'step 2\n'
  assert p.wait() == 0
