#!/usr/bin/env python
"""Print the sharding report of a config without allocating the model.

  python scripts/show_sharding.py --config configs/dp4_tp2.py

Under several processes (a multi-slice mesh: `scripts/launch_local.py --num_processes N -- ...` stands
in for N slices), process 0 prints.
"""

from __future__ import annotations

import argparse
import sys

import _bootstrap


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--config', default='configs/dp4_tp2.py', help='ml_collections config file')
  _, config = _bootstrap.parse(parser)
  devices = _bootstrap.devices_for(config.mesh)

  from mintrain import report
  from mintrain.build import build
  from mintrain.config import ConfigError
  from mintrain.mesh import MeshError
  from mintrain.partitioning import PartitioningError
  try:
    run = build(config, devices)
  except (MeshError, PartitioningError, ConfigError) as e:
    _bootstrap.fail(str(e))
  import jax
  if jax.process_index() == 0:
    print(report.format_report(run.layout, run.abstract_state, run.mesh, run.plan, run.rules))
  return 0


if __name__ == '__main__':
  sys.exit(main())
