#!/usr/bin/env python
"""Train a model on a device mesh.

  python scripts/train.py --config configs/dp4_tp2.py --workdir runs/dp4_tp2 --config.train.steps=20
"""

from __future__ import annotations

import argparse
import sys

import _bootstrap


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--config', default='configs/dp4_tp2.py', help='ml_collections config file')
  parser.add_argument('--workdir', default=None, help='where metrics.jsonl is written')
  args, config = _bootstrap.parse(parser)
  devices = _bootstrap.devices_for(config)

  from mintrain import train_loop
  from mintrain.config import ConfigError
  from mintrain.mesh import MeshError
  from mintrain.metrics import NonFiniteLossError
  from mintrain.partitioning import PartitioningError
  try:
    result = train_loop.run(config, args.workdir, devices=devices)
  except (MeshError, PartitioningError, ConfigError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except NonFiniteLossError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(f'done: {len(result.losses)} steps, final loss {result.losses[-1]:.4f}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
