#!/usr/bin/env python
"""Print the sharding report of a config without allocating the model.

  python scripts/show_sharding.py --config configs/dp4_tp2.py
"""

from __future__ import annotations

import argparse
import sys

import _bootstrap


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--config', default='configs/dp4_tp2.py', help='ml_collections config file')
  _, config = _bootstrap.parse(parser)
  devices = _bootstrap.devices_for(config)

  from mintrain import memory, report, train_state
  from mintrain import mesh as mesh_lib
  from mintrain.config import ConfigError
  from mintrain.partitioning import AxisRules, PartitioningError
  try:
    mesh = mesh_lib.make_mesh(config.mesh, devices)
    rules = AxisRules.from_config(config.partitioning)
    setup = train_state.setup(config, rules, mesh)
    plan = memory.plan(config, rules, mesh, setup.layout, setup.abstract_state)
  except (mesh_lib.MeshError, PartitioningError, ConfigError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(report.format_report(setup.layout, setup.abstract_state, mesh, plan))
  return 0


if __name__ == '__main__':
  sys.exit(main())
