"""Print the sharding report of a config without allocating the model.

  python scripts/show_sharding.py --config mintrain/configs/dp4_tp2.py

Under several processes (a multi-slice mesh: `scripts/launch_local.py --num_processes N -- ...` stands
in for N slices), process 0 prints.
"""

from __future__ import annotations

import argparse
import sys

from mintrain.runtime import startup


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--config', default='mintrain/configs/dp4_tp2.py', help='ml_collections config file')
  _, config, _ = startup.parse(parser)
  devices = startup.devices_for(config.mesh)

  from mintrain import report
  from mintrain.build import build
  from mintrain.errors import MintrainError
  try:
    run = build(config, devices)
  except MintrainError as e:
    startup.fail(str(e))
  import jax
  if jax.process_index() == 0:
    print(report.format_report(run.layout, run.abstract_state, run.mesh, run.plan, run.rules))
    for note in run.notes:  # As the training run prints them.
      print(f'note: {note}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
