"""Multi-process runs on JAX's own multi-controller runtime (`jax.distributed`).

One process per host (or, for tests, several on one machine). The coordinator address, process count and
process id come from flags or JAX's environment variables; what they leave out, JAX's own cluster detection
(SLURM, Open MPI, Kubernetes, Cloud TPU) fills in, and where it finds no cluster the run is one process.
On CPU, collectives between processes use gloo. Everything here but `PeerWatch` must run before the JAX
backend starts.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils

from mintrain.errors import DistributedError
from mintrain.runtime import console_guard

ENV_ADDRESS, ENV_COUNT, ENV_ID = 'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'
# The count and id that mpirun and an srun step put in each process's environment: the CPU devices each
# process simulates must be known before the backend starts, and JAX's public API tells them only after.
_LAUNCHER_COUNT_AND_ID = (('OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_RANK'),
                          ('SLURM_STEP_NUM_TASKS', 'SLURM_PROCID'))


@dataclasses.dataclass(frozen=True)
class Settings:
  coordinator_address: str | None  # None: JAX's cluster detection finds it, or finds no cluster.
  num_processes: int | None
  process_id: int | None


def settings(coordinator_address: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> Settings | None:
  """Settings from flags, then JAX's environment variables, then a launcher's count and id; None: one
  process, as given (a count of 1)."""
  address = coordinator_address or os.environ.get(ENV_ADDRESS)
  count = num_processes if num_processes is not None else _int_env(ENV_COUNT)
  pid = process_id if process_id is not None else _int_env(ENV_ID)
  if address and count is not None and pid is not None:
    _check_id(pid, count)
    return Settings(address, count, pid) if count > 1 else None
  for count_name, id_name in _LAUNCHER_COUNT_AND_ID:
    if count_name in os.environ:
      count = count if count is not None else _int_env(count_name)
      pid = pid if pid is not None else _int_env(id_name)
      break
  if count is not None and pid is not None:
    _check_id(pid, count)
  return Settings(address, count, pid)


def _check_id(pid: int, count: int) -> None:
  if not 0 <= pid < count:
    raise DistributedError(f'process id {pid} must be in [0, {count}).')


def _int_env(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None or value == '':
    return None
  try:
    return int(value)
  except ValueError as e:
    raise DistributedError(f'{name}={value!r} is not an integer.') from e


DEFAULT_TIMEOUT = 300  # Seconds: as JAX's own; a cluster's processes may start minutes apart.


def initialize(s: Settings, timeout: float = DEFAULT_TIMEOUT, say: Callable[[str], None] = print) -> bool:
  """Joins the runtime (on CPU, gloo carries the collectives between processes), never in silence;
  False where nothing was given and JAX detects no cluster (one process).

  Process 0 says whom it waits for and where. JAX's own timeout aborts every process with "another
  task died", so a watchdog ends the wait first: after `timeout` seconds it writes one line naming the
  processes that did not join (from the roll call, see `RollCall`), and exits with status 2.
  """
  if s.process_id == 0:
    where = f' at {s.coordinator_address}' if s.coordinator_address else ''
    say(f'Waiting up to {timeout:.0f} s for {s.num_processes or "?"} processes to join{where} '
        '(--init_timeout to change).')
  roll_call = RollCall.start(s)
  watchdog = threading.Timer(timeout, _give_up, (s, timeout, roll_call))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(coordinator_address=s.coordinator_address, num_processes=s.num_processes,
                               process_id=s.process_id, initialization_timeout=int(timeout) + 60)
  except ValueError as e:  # What JAX's cluster detection could not fill in.
    if s == Settings(None, None, None):
      return False
    raise DistributedError(
        f'Multi-process settings are incomplete ({e}): give {ENV_ADDRESS}, {ENV_COUNT} and {ENV_ID} (or the '
        '--coordinator_address / --num_processes / --process_id flags), or start under a launcher.') from e
  finally:
    watchdog.cancel()
    if roll_call is not None:
      roll_call.stop()
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  return True


def _give_up(s: Settings, timeout: float, roll_call: RollCall | None) -> None:
  address = s.coordinator_address or "the coordinator JAX's cluster detection chose"
  check = (f'Check that every process was started with the same coordinator address and process count '
           f'({s.num_processes}), its own process id, and can reach {address}; --init_timeout waits longer.')
  if s.process_id == 0 and roll_call is not None:
    message = roll_call.verdict(s.num_processes)
  elif s.process_id == 0:
    message = f'not all {s.num_processes} processes joined'
  elif s.coordinator_address and not _reachable(s.coordinator_address):
    message = f'process {s.process_id} found nothing listening at {address}: is process 0 running?'
  else:
    message = (f'process {s.process_id} could not join: process 0 is up, but not every process joined, '
               f'or another process took id {s.process_id} (see process 0\'s error)')
  print(f'error: {message} within {timeout:.0f} s at {address}. {check}', file=sys.stderr, flush=True)
  os._exit(2)  # The main thread is inside JAX's blocking connect; nothing has been written yet.


def _reachable(address: str) -> bool:
  host, _, port = address.rpartition(':')
  try:
    with socket.create_connection((host, int(port)), timeout=2):
      return True
  except (OSError, ValueError):
    return False


class RollCall:
  """Who has joined, for the timeout's message: while they wait, processes send their id in a UDP
  datagram to the coordinator's port, where process 0 listens (UDP: JAX's service uses TCP there).

  Best effort: where UDP to the coordinator is blocked, process 0 hears no one and says so.
  """

  def __init__(self, sock: socket.socket, s: Settings):
    self.sock, self.settings, self.done = sock, s, threading.Event()
    self.heard: dict[int, set[str]] = {}  # Process id -> the senders that claimed it ("host pid N").
    self.thread = threading.Thread(target=self._listen if s.process_id == 0 else self._announce, daemon=True)
    self.thread.start()

  @classmethod
  def start(cls, s: Settings) -> RollCall | None:
    if not s.coordinator_address or s.process_id is None:
      return None
    host, _, port = s.coordinator_address.rpartition(':')
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
      if s.process_id == 0:
        sock.bind(('', int(port)))
        sock.settimeout(0.2)
      else:
        sock.connect((host, int(port)))
    except (OSError, ValueError):
      sock.close()
      return None
    return cls(sock, s)

  def _listen(self) -> None:
    while not self.done.is_set():
      try:
        data, (host, _) = self.sock.recvfrom(256)
      except (TimeoutError, OSError):
        continue
      parts = data.decode(errors='replace').split()
      if len(parts) == 4 and parts[0] == 'mintrain-join' and parts[1].isdigit():
        self.heard.setdefault(int(parts[1]), set()).add(f'{parts[2]} ({host}) pid {parts[3]}')

  def _announce(self) -> None:
    message = f'mintrain-join {self.settings.process_id} {socket.gethostname()} {os.getpid()}'.encode()
    while not self.done.wait(0.5):
      try:
        self.sock.send(message)
      except OSError:
        pass

  def verdict(self, count: int | None) -> str:
    """One clause: who did not join, and any id that two processes claimed."""
    duplicated = {pid: who for pid, who in self.heard.items() if len(who) > 1}
    if duplicated:
      return '; '.join(f'process id {pid} was taken by {len(who)} processes ({", ".join(sorted(who))})'
                       for pid, who in sorted(duplicated.items()))
    missing = [pid for pid in range(1, count or 1) if pid not in self.heard]
    if not missing:
      return f'all {count} processes answered the roll call, but JAX\'s connect did not finish'
    caveat = '' if self.heard else ' (none answered the roll call; if they run, UDP to it is blocked)'
    return f'process(es) {", ".join(map(str, missing))} of {count} did not join{caveat}'

  def stop(self) -> None:
    self.done.set()
    self.thread.join(timeout=2)
    self.sock.close()


def barrier(name: str, timeout: int = 600) -> None:
  """Waits until every process reaches `name`, through the coordination service, not a device collective:
  gloo gives a peer 30 s to reach the first collective, less than a compile may take on a loaded host."""
  if jax.process_count() > 1:
    from orbax.checkpoint import multihost  # Orbax's public barrier over JAX's distributed client.
    multihost.sync_global_processes(name, timeout=timeout)


PEER_DIED_EXIT = 3  # A peer died; this process stopped (2 is bad input).


def _guarded_stderr() -> int:
  """Points fd 2 at a `console_guard` child that writes to the console; returns a descriptor of the pipe."""
  sys.stderr.flush()
  guard = subprocess.Popen([sys.executable, '-I', console_guard.__file__], stdin=subprocess.PIPE, stdout=2)
  os.dup2(guard.stdin.fileno(), 2)
  guard.stdin.close()
  return os.dup(2)


class PeerWatch:
  """Stops the survivors at once when a peer dies hard (SIGKILL, a crash, the OOM killer), with one line
  naming it and the newest saved step, rather than JAX's abort with a C++ stack trace once its heartbeat
  times out.

  JAX's runtime offers only the heartbeat timeout (`heartbeat_timeout_seconds`), whose expiry aborts every
  process in C++: no Python sees it. So each process holds a TCP connection to process 0, and the kernel
  closes a dead process's end at once. A process that exits through Python says `bye` first (atexit);
  an end closed without it is a death, which process 0 passes on to the others before it stops. JAX's
  client notices process 0's death as soon (its service runs there) and aborts with its own lines, so the
  watch points the C++ side's stderr at /dev/null before it stops, and in the other processes stderr runs
  through `console_guard`, which holds back an abort that comes first.
  """

  def __init__(self, process_id: int, saved: Callable[[], str]):
    self.process_id, self.saved = process_id, saved
    # Where the one line goes once fd 2 is silenced.
    self.console = _guarded_stderr() if process_id != 0 else os.dup(2)
    self.devnull = os.open(os.devnull, os.O_WRONLY)
    self.lock = threading.Lock()
    self.peers: dict[socket.socket, str] = {}  # Open connection -> whom it reaches ("process 1 (pid ...)").
    self.leaving = False

  @classmethod
  def start(cls, coordinator_host: str | None, saved: Callable[[], str]) -> PeerWatch:
    """Process 0 listens on a free port, which a collective tells the others; they connect to it."""
    watch = cls(jax.process_index(), saved)
    listener = None
    address = np.zeros(256, np.uint8)
    if watch.process_id == 0:
      dual = socket.has_dualstack_ipv6()
      listener = socket.create_server(('', 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                      dualstack_ipv6=dual)
      host = coordinator_host or socket.gethostname()
      encoded = f'{host}:{listener.getsockname()[1]}'.encode()
      address[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    address = bytes(np.asarray(multihost_utils.broadcast_one_to_all(address))).rstrip(b'\0').decode()
    if listener is not None:
      threading.Thread(target=watch._accept, args=(listener,), daemon=True).start()
    else:
      host, _, port = address.rpartition(':')
      try:
        conn = socket.create_connection((host.strip('[]'), int(port)), timeout=30)
      except OSError as e:
        raise DistributedError(f'process {watch.process_id} cannot reach process 0 at {address} ({e}) to '
                               'hear of a peer\'s death.') from e
      conn.settimeout(None)
      conn.sendall(watch._hello())
      reader = conn.makefile('r', errors='replace')
      watch._follow(conn, reader, watch._who(reader.readline()) or 'process 0')
    atexit.register(watch.leave)
    return watch

  def _hello(self) -> bytes:
    return f'hello {self.process_id} {socket.gethostname()} {os.getpid()}\n'.encode()

  @staticmethod
  def _who(hello: str) -> str | None:
    parts = hello.split()
    if len(parts) != 4 or parts[0] != 'hello':
      return None
    return f'process {parts[1]} (pid {parts[3]} on {parts[2]})'

  def _accept(self, listener: socket.socket) -> None:
    while True:
      conn, _ = listener.accept()
      reader = conn.makefile('r', errors='replace')
      who = self._who(reader.readline())
      if who is None:
        conn.close()
        continue
      conn.sendall(self._hello())
      self._follow(conn, reader, who)

  def _follow(self, conn: socket.socket, reader: TextIO, who: str) -> None:
    with self.lock:
      self.peers[conn] = who
    threading.Thread(target=self._read, args=(conn, reader, who), daemon=True).start()

  def _read(self, conn: socket.socket, reader: TextIO, who: str) -> None:
    try:
      for line in reader:
        if line.startswith('bye'):
          with self.lock:
            self.peers.pop(conn, None)
          return
        if line.startswith('dead '):
          self._stop(line[len('dead '):].strip())
    except OSError:  # A reset: the peer died with our bytes unread.
      pass
    self._stop(who)

  def _stop(self, dead: str) -> None:
    with self.lock:
      if self.leaving:
        return
      self.leaving = True
      os.dup2(self.devnull, 2)  # Before JAX's abort can write there.
      for conn in self.peers:
        try:
          conn.sendall(f'dead {dead}\n'.encode())
        except OSError:
          pass
    sys.stdout.flush()
    os.write(self.console, f'error: {dead} died; process {self.process_id} stops too, with status '
                           f'{PEER_DIED_EXIT}. {self.saved()}\n'.encode())
    os._exit(PEER_DIED_EXIT)  # The main thread may be inside a collective that will never finish.

  def leave(self) -> None:
    """Tells the others that this process exits on its own, so its closed end is no death."""
    with self.lock:
      self.leaving = True
      for conn in self.peers:
        try:
          conn.sendall(b'bye\n')
        except OSError:
          pass
