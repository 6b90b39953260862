"""Shared start-up of the scripts: repo on the path, config from the command line, devices.

Runs before the JAX backend starts, so it can still ask XLA for simulated CPU devices.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from mintrain import config as config_lib  # noqa: E402
from mintrain import mesh as mesh_lib  # noqa: E402


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None):
  """Parses `--config FILE` plus `--config.key.path=value` overrides; exits 2 on a bad config."""
  argv = sys.argv[1:] if argv is None else argv
  overrides = [a[len('--config.'):] for a in argv if a.startswith('--config.')]
  rest = [a for a in argv if not a.startswith('--config.')]
  args = parser.parse_args(rest)
  try:
    config = config_lib.load(args.config, overrides)
    config_lib.validate(config)
  except config_lib.ConfigError as e:
    sys.exit(f'error: {e}')
  return args, config


def quiet_libraries() -> None:
  """Orbax logs routine decisions at WARNING through absl; keep the console for our own lines."""
  from absl import logging
  logging.set_verbosity(logging.ERROR)


def devices_for(config):
  """Devices for the config's mesh, simulating CPU devices when the machine has too few."""
  quiet_libraries()
  mesh_lib.simulate_cpu_devices(mesh_lib.devices_needed(config.mesh))
  devices, note = mesh_lib.pick_devices(mesh_lib.devices_needed(config.mesh))
  if note:
    print(note, flush=True)
  return devices
