"""Train a model on a device mesh; re-running with the same --workdir resumes.

  python scripts/train.py --config mintrain/configs/dp4_tp2.py --workdir runs/dp4_tp2 --config.train.steps=20
  python scripts/train.py --config mintrain/configs/tp8.py --workdir runs/tp8 --restore_from runs/dp4_tp2
"""

from __future__ import annotations

import argparse
import sys

from mintrain.runtime import startup


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--config', default='mintrain/configs/dp4_tp2.py', help='ml_collections config file')
  parser.add_argument('--workdir', default=None, help='metrics.jsonl and checkpoints/ go here')
  parser.add_argument('--restore_from', default=None,
                      help="start from another run's checkpoint: a run directory or one step inside it")
  parser.add_argument('--restore_params_only', action='store_true',
                      help='with --restore_from: parameters only, fresh optimizer state and step 0')
  parser.add_argument('--force', action='store_true',
                      help="take over the workdir's run lock even if its holder may still run: another\n"
                           "host's lock on a shared file system, when that run is known to be gone")
  startup.add_distributed_flags(parser)
  args, config, tok = startup.parse(parser)
  if args.restore_params_only and not args.restore_from:
    parser.error('--restore_params_only needs --restore_from PATH')
  devices = startup.devices_for(config.mesh, args, watch_peers=True)

  import jax

  from mintrain import loop as train_loop
  from mintrain.errors import MintrainError, NonFiniteLossError
  try:
    result = train_loop.run(config, args.workdir, devices=devices, restore_from=args.restore_from,
                            restore_params_only=args.restore_params_only, force=args.force, tok=tok)
  except NonFiniteLossError as e:  # The input was fine; training diverged.
    print(f'error: {e}', file=sys.stderr)
    return 1
  except MintrainError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if jax.process_index() != 0:  # One voice per run.
    return 0
  if result.losses:
    print(f'done: steps {result.first_step}..{result.first_step + len(result.losses)}, '
          f'final loss {result.losses[-1]:.4f}')
  else:
    print(f'done: nothing to do, the run is already at step {result.first_step} of {config.train.steps}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
