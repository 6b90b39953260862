"""Shared start-up of the scripts: the config from the command line, one-line failures, the devices.

Runs before the JAX backend starts, so it can still ask XLA for simulated CPU devices. It imports JAX and
the config only once the arguments are parsed, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING, NoReturn

from mintrain import errors

if TYPE_CHECKING:
  from mintrain import mesh as mesh_lib


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  """(`key.path=value` overrides given as `--config.key.path=value`, the other arguments)."""
  prefix = '--config.'
  overrides = [a[len(prefix):] for a in argv if a.startswith(prefix)]
  return overrides, [a for a in argv if not a.startswith(prefix)]


def fail(message: str) -> NoReturn:
  """One line on stderr and exit status 2: the input was wrong, nothing ran."""
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None):
  """Parses `--config FILE` plus `--config.key.path=value` overrides into (args, the validated and resolved
  config, its loaded tokenizer)."""
  overrides, rest = split_overrides(sys.argv[1:] if argv is None else argv)
  parser.add_argument('--show_config', action='store_true',
                      help='print every config key with its value and meaning, then exit')
  args = parser.parse_args(rest)
  from mintrain import config as config_lib

  try:
    config, tok = config_lib.resolve(config_lib.validate(config_lib.load(args.config, overrides)))
  except errors.ConfigError as e:
    fail(str(e))
  if args.show_config:
    print(show_config(config.to_dict()))
    sys.exit(0)
  return args, config, tok


def show_config(config: dict) -> str:
  """`key = value  # meaning` for every key, the meanings from mintrain/configs/base.py's comments."""
  from mintrain import configs

  meanings = configs.comments()
  rows = []

  def walk(tree: dict, prefix: str) -> None:
    for key, value in tree.items():
      if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        walk(value, f'{prefix}{key}.')
      else:
        meaning = meanings.get(f'{prefix}{key}', '')
        rows.append(f'{prefix}{key} = {value!r}' + (f'  # {meaning}' if meaning else ''))

  walk(config, '')
  return '\n'.join(rows)


def quiet_libraries() -> None:
  """Orbax logs routine decisions at WARNING through absl; keep the console for our own lines."""
  from absl import logging
  logging.set_verbosity(logging.ERROR)


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
  group = parser.add_argument_group('multi-process (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, '
                                    'JAX_PROCESS_ID; detected under SLURM, Open MPI, K8s, Cloud TPU)')
  group.add_argument('--coordinator_address', default=None, help='host:port of process 0')
  group.add_argument('--num_processes', type=int, default=None)
  group.add_argument('--process_id', type=int, default=None)
  group.add_argument('--init_timeout', type=float, default=None,
                     help="seconds to wait for every process to join (default: JAX's 300)")


def devices_for(mesh: mesh_lib.MeshConfig, args: argparse.Namespace | None = None, *,
                watch_peers: bool = False):
  """Devices for the mesh: joins a multi-process run if one is set up; on the CPU backend, simulates
  the mesh's devices (each process its share); elsewhere, the accelerators or a one-line error.
  `watch_peers` (training): a peer's death stops this process (`distributed.PeerWatch`)."""
  import jax

  from mintrain import mesh as mesh_lib
  from mintrain.runtime import distributed

  quiet_libraries()
  needed = mesh_lib.devices_needed(mesh.sizes)
  all_devices = -1 in mesh.sizes.values()
  try:
    dist = distributed.settings(getattr(args, 'coordinator_address', None),
                                getattr(args, 'num_processes', None), getattr(args, 'process_id', None))
  except errors.DistributedError as e:
    fail(str(e))
  processes = dist.num_processes if dist is not None and dist.num_processes else 1
  if needed % processes:
    fail(f'the mesh needs {needed} devices, which {processes} processes cannot share evenly.')
  mesh_lib.simulate_cpu_devices(needed // processes)
  try:
    joined = dist is not None and distributed.initialize(
        dist, getattr(args, 'init_timeout', None) or distributed.DEFAULT_TIMEOUT)
  except errors.DistributedError as e:
    fail(str(e))
  try:
    devices, note = mesh_lib.pick_devices(None if all_devices else needed)
  except errors.MeshError as e:
    fail(str(e))
  if watch_peers and joined and jax.process_count() > 1:
    host = dist.coordinator_address.rpartition(':')[0] if dist.coordinator_address else None
    try:
      distributed.PeerWatch.start(host, functools.partial(newest_saved, getattr(args, 'workdir', None)))
    except errors.DistributedError as e:
      fail(str(e))
  if note and jax.process_index() == 0:
    print(note, flush=True)
  return devices


def newest_saved(workdir: str | None) -> str:
  """What a restart would resume from: the newest complete step directory, as a restore finds them."""
  if workdir is None:
    return 'This run has no workdir: nothing was saved.'
  from mintrain.checkpoint.checkpoints import CHECKPOINTS
  from mintrain.runtime import storage
  folder = storage.run_path(workdir) / CHECKPOINTS
  remote = storage.is_remote(folder)  # Written in place there: complete once Orbax's commit file is.
  try:
    steps = [int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / 'state').is_dir()
             and (not remote or (p / 'commit_success.txt').exists())]
  except OSError:
    steps = []
  if not steps:
    return f'No step was saved in {folder}.'
  newest = max(steps)
  return f'The newest saved step is {newest} ({folder / str(newest)}); a restart resumes there.'
