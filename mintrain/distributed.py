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
import os

import jax

ENV_ADDRESS, ENV_COUNT, ENV_ID = 'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'


class DistributedError(RuntimeError):
  """Incomplete or inconsistent multi-process settings."""


@dataclasses.dataclass(frozen=True)
class Settings:
  coordinator_address: str | None  # None: let the detected cluster say.
  num_processes: int | None
  process_id: int | None
  cluster: str | None  # Name of the detected cluster environment, if any.


def detected_cluster() -> str | None:
  """The cluster launcher JAX would detect (SLURM, Open MPI, K8s, Cloud TPU), or None."""
  from jax._src.clusters import ClusterEnv  # Where JAX keeps its launcher detection.
  for env in ClusterEnv._cluster_types:
    if not env.opt_in_only_method and env.is_env_present():
      return env.__name__
  return None


def settings(coordinator_address: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> Settings | None:
  """Settings from flags, then environment variables, then cluster detection; None: one process."""
  address = coordinator_address or os.environ.get(ENV_ADDRESS)
  count = num_processes if num_processes is not None else _int_env(ENV_COUNT)
  pid = process_id if process_id is not None else _int_env(ENV_ID)
  given = [x is not None for x in (address, count, pid)]
  cluster = detected_cluster()
  if all(given):
    if not 0 <= pid < count:
      raise DistributedError(f'process id {pid} must be in [0, {count}).')
    return Settings(address, count, pid, cluster) if count > 1 else None
  if any(given) and cluster is None:
    missing = [name for name, g in zip((ENV_ADDRESS, ENV_COUNT, ENV_ID), given) if not g]
    raise DistributedError(
        f'Multi-process settings are incomplete: missing {", ".join(missing)} (or the matching '
        '--coordinator_address / --num_processes / --process_id flags).')
  if cluster is not None:
    return Settings(address, count, pid, cluster)
  return None


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
