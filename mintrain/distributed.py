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

import jax

ENV_ADDRESS, ENV_COUNT, ENV_ID = 'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'
# What JAX's SlurmCluster needs; `srun` sets them for every task.
_SLURM = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')


class DistributedError(RuntimeError):
  """Incomplete or inconsistent multi-process settings."""


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


def initialize(s: Settings) -> None:
  """Starts the runtime; on CPU, gloo carries the collectives between processes."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=s.coordinator_address, num_processes=s.num_processes,
                             process_id=s.process_id)
