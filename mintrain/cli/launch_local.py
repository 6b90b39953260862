"""Run N processes of one command on this machine as a JAX multi-process job (tests, development).

  python scripts/launch_local.py --num_processes 2 -- \
      python scripts/train.py --config mintrain/configs/dp4_tp2.py

Each process gets JAX_COORDINATOR_ADDRESS (a free loopback port), JAX_NUM_PROCESSES and JAX_PROCESS_ID,
and simulates its share of the CPU devices. Output lines are prefixed with the process id. If any
process fails, the others are stopped and the launcher exits with that process's code. SIGTERM and
SIGINT are passed on to every process; whoever still runs --grace_seconds later is killed (SIGKILL), as
SLURM does after its KillWait. Production runs use the cluster's launcher instead.
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--num_processes', type=int, required=True)
  parser.add_argument('--devices', type=int, default=8, help='simulated CPU devices in all')
  parser.add_argument('--grace_seconds', type=float, default=30.0,
                      help='how long stopped processes get to save and exit before they are killed')
  parser.add_argument('command', nargs=argparse.REMAINDER, help='-- then the command to run')
  args = parser.parse_args()
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    parser.error('give the command after --')
  if args.num_processes < 1 or args.devices % args.num_processes:
    parser.error(f'--devices {args.devices} must split evenly over --num_processes {args.num_processes}')

  address = f'127.0.0.1:{free_port()}'
  procs = []
  for pid in range(args.num_processes):
    # The device count through JAX's own option, which wins over a count in XLA_FLAGS (kept as given).
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(args.num_processes),
               JAX_PROCESS_ID=str(pid), JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1',
               JAX_NUM_CPU_DEVICES=str(args.devices // args.num_processes))
    procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True))
    print(f'[launcher] process {pid}: pid {procs[-1].pid}', flush=True)

  kill_at = None  # When the processes told to stop get SIGKILL.

  def forward(signum, frame):
    nonlocal kill_at
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)
    if kill_at is None:
      kill_at = time.monotonic() + args.grace_seconds
      print(f'[launcher] passed {signal.Signals(signum).name} on; killing whoever still runs in '
            f'{args.grace_seconds:.0f} s', file=sys.stderr, flush=True)
  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)

  selector = selectors.DefaultSelector()
  for pid, p in enumerate(procs):
    selector.register(p.stdout, selectors.EVENT_READ, pid)
  open_streams, failed = len(procs), None
  ended = []  # Process ids in the order their output ended: a dying process's ends as it exits.

  def notice_failure() -> None:
    nonlocal failed
    if failed is None:
      failed = first_failure(procs, ended)
      if failed is not None:
        print(f'[launcher] process {failed} exited with code {procs[failed].returncode}; stopping the others',
              file=sys.stderr, flush=True)
        stop(procs, args.grace_seconds)

  while open_streams:
    for key, _ in selector.select(timeout=0.5):
      line = key.fileobj.readline()
      if line:
        print(f'[{key.data}] {line}', end='', flush=True)
      else:
        selector.unregister(key.fileobj)
        open_streams -= 1
        ended.append(key.data)
    if kill_at is not None and time.monotonic() > kill_at:
      kill_at = float('inf')
      print('[launcher] grace period over: SIGKILL', file=sys.stderr, flush=True)
      for p in procs:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
    notice_failure()
  for p in procs:
    p.wait()
  notice_failure()  # The last outputs can end before their processes' exits are seen.
  codes = [procs[failed].returncode] if failed is not None else [p.returncode for p in procs]
  code = max(codes, key=abs)
  return code if code >= 0 else 128 - code  # Killed by signal N: 128 + N, as a shell reports it.


def first_failure(procs: list[subprocess.Popen], ended: list[int]) -> int | None:
  """The process whose failure stops the job, of those that have exited: one killed by a signal before
  one that exited with an error (the others' failures may follow from its death), then the one whose
  output ended first (`ended`; the others after, by id)."""
  order = ended + [pid for pid in range(len(procs)) if pid not in ended]
  dead = [pid for pid in order if procs[pid].poll() not in (None, 0)]
  return min(dead, key=lambda pid: procs[pid].returncode > 0, default=None)


def stop(procs: list[subprocess.Popen], grace: float) -> None:
  """SIGTERM to the survivors (they save and exit), then SIGKILL to whoever is still there."""
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline and any(p.poll() is None for p in procs):
    time.sleep(0.1)
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)


if __name__ == '__main__':
  sys.exit(main())
