"""List the steps of a run's checkpoints and describe one, without loading any array.

  python scripts/inspect_checkpoint.py runs/dp4_tp2              # steps, then the newest one
  python scripts/inspect_checkpoint.py runs/dp4_tp2/checkpoints/200
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from mintrain.runtime import startup


def summarize_config(config: dict) -> str:
  """A few lines of the saved config for inspection."""
  model, train = config.get('model', {}), config.get('train', {})
  sizes = ', '.join(f'{k}={v}' for k, v in model.items() if k != 'name')
  return '\n'.join([
      f"model: {model.get('name')} ({sizes})",
      f"train: steps={train.get('steps')} global_batch_size={train.get('global_batch_size')} "
      f"seq_len={train.get('seq_len')} grad_accum_steps={train.get('grad_accum_steps')}",
      f"data: {json.dumps(config.get('data', {}))}",
      f"seed: {config.get('seed')}",
  ])


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('path', help='a run directory, its checkpoints/ directory, or one step directory')
  parser.add_argument('--step', type=int, default=None, help='which step to describe (default: newest)')
  args = parser.parse_args()

  startup.quiet_libraries()
  from mintrain import errors
  from mintrain import mesh as mesh_lib
  from mintrain.checkpoint import checkpoints as ckpt_lib
  try:
    directory, step = ckpt_lib.find_run_checkpoints(args.path)
    checkpoints = ckpt_lib.Checkpoints(directory, read_only=True)
    steps = checkpoints.steps()
    step = args.step if args.step is not None else step if step is not None else steps[-1]
    if step not in steps:
      raise errors.CheckpointError(f'{directory} has no complete step {step}; steps: {steps}.')
    meta = checkpoints.metadata(step)
    arrays = checkpoints.array_metadata(step)
  except errors.CheckpointError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2

  print(f'{directory}: steps {", ".join(map(str, steps))}')
  print(f'\nstep {step} ({checkpoints.step_dir(step)})')
  print(f"saved on mesh {mesh_lib.describe(meta.get('mesh', {}))} by {meta.get('process_count', '?')} "
        'process(es); versions: '
        + ', '.join(f'{k} {v}' for k, v in meta.get('versions', {}).items()))
  print(summarize_config(meta.get('config', {})))
  rows = [('array', 'shape', 'dtype', 'saved sharding')]
  for path, m in arrays.items():
    spec = getattr(getattr(m, 'sharding', None), 'partition_spec', None)
    rows.append((path, str(tuple(m.shape)), str(m.dtype), str(tuple(spec)) if spec is not None else '-'))
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  print()
  for row in rows:
    print('  '.join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
  total = sum(m.dtype.itemsize * math.prod(m.shape) for m in arrays.values())
  print(f'\n{len(arrays)} arrays, {total / 2**20:.1f} MiB')
  return 0


if __name__ == '__main__':
  sys.exit(main())
