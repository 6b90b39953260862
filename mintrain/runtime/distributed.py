"""Multi-process runs on JAX's own multi-controller runtime (`jax.distributed`).

One process per host (or, for tests, several on one machine). The runtime is
initialised when a cluster launcher that JAX recognises is present (SLURM,
Open MPI, Kubernetes / GKE, Cloud TPU), or when the coordinator address,
process count and process id are given as flags or in the standard
environment variables. On CPU, collectives between processes use gloo.
Everything here must run before the JAX backend starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import sys
import threading
from collections.abc import Callable

import jax

from mintrain.errors import DistributedError

ENV_ADDRESS, ENV_COUNT, ENV_ID = 'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'
# What JAX's SlurmCluster needs; `srun` sets them for every task.
_SLURM = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')


@dataclasses.dataclass(frozen=True)
class Settings:
  coordinator_address: str | None  # None: let the detected cluster say.
  num_processes: int | None
  process_id: int | None
  cluster: str | None  # Name of the detected cluster launcher (`Launcher.name`), if any.


@dataclasses.dataclass(frozen=True)
class Launcher:
  """A cluster launcher, and what its environment says about this process."""
  name: str  # slurm, ompi, gketpu, gcetpu or k8s.
  num_processes: int | None  # None: JAX asks the launcher itself (TPU metadata, Kubernetes API).
  process_id: int | None


def detected_cluster() -> Launcher | None:
  """The launcher `jax.distributed.initialize()` would detect, checked in JAX's order, or None.

  The tests of JAX 0.10's cluster environments, from the environment only: nothing here asks a
  metadata server or the Kubernetes API.
  """
  env = os.environ
  if 'OMPI_MCA_orte_hnp_uri' in env:  # Set by mpirun of Open MPI 4 and older (ORTE), not 5 (PRRTE).
    return Launcher('ompi', _int_env('OMPI_COMM_WORLD_SIZE'), _int_env('OMPI_COMM_WORLD_RANK'))
  if all(name in env for name in _SLURM):
    return Launcher('slurm', _int_env('SLURM_NTASKS'), _int_env('SLURM_PROCID'))
  if _on_cloud_tpu():
    if 'TPU_PROCESS_ADDRESSES' in env or 'TPU_WORKER_HOSTNAMES' in env:  # A GKE TPU pod.
      return Launcher('gketpu', None, None)
    if 'TPU_SKIP_MDS_QUERY' not in env:  # A TPU VM, whose metadata server knows its workers.
      return Launcher('gcetpu', None, None)
  if 'KUBERNETES_SERVICE_HOST' in env and importlib.util.find_spec('kubernetes') is not None:
    return Launcher('k8s', None, _int_env('JOB_COMPLETION_INDEX'))  # The index of an Indexed Job.
  return None


def _on_cloud_tpu() -> bool:
  """Whether JAX chose the TPU platform, as it does on import on a Cloud TPU VM (`tpu,cpu`)."""
  return 'tpu' in (jax.config.jax_platforms or '').split(',')


def settings(coordinator_address: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> Settings | None:
  """Settings from flags, then environment variables, then cluster detection; None: one process."""
  address = coordinator_address or os.environ.get(ENV_ADDRESS)
  count = num_processes if num_processes is not None else _int_env(ENV_COUNT)
  pid = process_id if process_id is not None else _int_env(ENV_ID)
  given = [x is not None for x in (address, count, pid)]
  launcher = detected_cluster()
  cluster = launcher.name if launcher else None
  if all(given):
    _check_id(pid, count)
    return Settings(address, count, pid, cluster) if count > 1 else None
  if any(given) and launcher is None:
    missing = [name for name, g in zip((ENV_ADDRESS, ENV_COUNT, ENV_ID), given) if not g]
    raise DistributedError(
        f'Multi-process settings are incomplete: missing {", ".join(missing)} (or the matching '
        '--coordinator_address / --num_processes / --process_id flags).')
  if launcher is not None:
    count = count if count is not None else launcher.num_processes
    pid = pid if pid is not None else launcher.process_id
    if count is not None and pid is not None:
      _check_id(pid, count)
    return Settings(address, count, pid, cluster)
  return None


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


def initialize(s: Settings, timeout: float = DEFAULT_TIMEOUT, say: Callable[[str], None] = print) -> None:
  """Starts the runtime (on CPU, gloo carries the collectives between processes), never in silence.

  Process 0 says whom it waits for and where. JAX's own timeout aborts every process with "another
  task died", so a watchdog ends the wait first: after `timeout` seconds it writes one line naming the
  processes that did not join (from the roll call, see `RollCall`), and exits with status 2.
  """
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  count = s.num_processes or '?'
  if s.process_id == 0:
    where = f' at {s.coordinator_address}' if s.coordinator_address else ''
    say(f'Waiting up to {timeout:.0f} s for {count} processes to join{where} (--init_timeout to change).')
  roll_call = RollCall.start(s)
  watchdog = threading.Timer(timeout, _give_up, (s, timeout, roll_call))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(coordinator_address=s.coordinator_address, num_processes=s.num_processes,
                               process_id=s.process_id, initialization_timeout=int(timeout) + 60)
  finally:
    watchdog.cancel()
    if roll_call is not None:
      roll_call.stop()


def _give_up(s: Settings, timeout: float, roll_call: RollCall | None) -> None:
  address = s.coordinator_address or f"the coordinator {s.cluster or 'JAX'} chose"
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
