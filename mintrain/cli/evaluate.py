"""Evaluate a run's checkpoint on lm-evaluation-harness tasks (the `eval` extra: pip install -e '.[eval]').

  python scripts/evaluate.py --workdir runs/ft --tasks hellaswag,arc_easy --output_path results/ft.json
  python scripts/evaluate.py --workdir runs/ft --step 200 --tasks my_task --include_path my_tasks/ \
      --num_fewshot 5 --limit 100 --batch_size 16 --config mintrain/configs/dp4_tp2.py --output_path out.json

The model is the one in the checkpoint's saved config, on one device unless --config gives a mesh (with its
partitioning rules); `--config.key=value` overrides apply to the saved config. Writes lm-eval's results JSON
to --output_path (as lm-eval's CLI does) and prints lm-eval's table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from mintrain import errors
from mintrain.runtime import startup


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--workdir', required=True, help='a run directory, its checkpoints/, or one step in it')
  parser.add_argument('--step', type=int, default=None, help='the checkpoint step (default: the newest)')
  parser.add_argument('--tasks', required=True, help='comma-separated lm-eval task or group names')
  parser.add_argument('--include_path', default=None, help='a directory of task YAML files of your own')
  parser.add_argument('--num_fewshot', type=int, default=None, help="examples in each context (default: "
                      "each task's own)")
  parser.add_argument('--limit', type=float, default=None, help='documents per task (a fraction if < 1)')
  parser.add_argument('--apply_chat_template', action='store_true',
                      help="render each context with the tokenizer's chat template")
  parser.add_argument('--batch_size', type=int, default=8, help='rows per forward pass')
  parser.add_argument('--max_length', type=int, default=0,
                      help='positions per forward pass (default: the train.seq_len it was trained on)')
  parser.add_argument('--config', default=None,
                      help='config file whose mesh and partitioning rules to run on (default: one device)')
  parser.add_argument('--output_path', required=True, help="the results JSON file to write")
  overrides, rest = startup.split_overrides(sys.argv[1:])
  args = parser.parse_args(rest)
  from mintrain import config as config_lib  # After --help: it imports JAX.
  tasks = [t.strip() for t in args.tasks.split(',') if t.strip()]
  if not tasks:
    parser.error('--tasks names no task')
  if args.batch_size < 1 or args.max_length < 0 or (args.num_fewshot or 0) < 0 or (args.limit or 1) <= 0:
    parser.error('--batch_size must be >= 1, --max_length and --num_fewshot >= 0, --limit > 0')
  output = pathlib.Path(args.output_path)
  if output.is_dir():
    startup.fail(f'--output_path {output} is a directory; give the JSON file to write.')
  try:
    from mintrain.checkpoint import model as saved_model
    from mintrain.evaluation import harness

    layout = saved_model.layout_config(args.config, overrides)
    mesh_config = config_lib.validate(config_lib.upgrade({'mesh': layout.mesh.to_dict()})).mesh
    manager = harness.task_manager(args.include_path)  # Unknown tasks are refused before any device.
    harness.check_tasks(tasks, manager)
  except errors.MintrainError as e:
    startup.fail(str(e))
  devices = startup.devices_for(mesh_config)

  import lm_eval.utils

  from mintrain import mesh as mesh_lib
  from mintrain.runtime import caches

  try:
    restored = saved_model.restore_model(args.workdir, step=args.step, layout=layout, overrides=overrides,
                                     devices=devices)
    caches.use_compilation_cache(restored.config.train.compilation_cache)
    lm = harness.HarnessLM(restored.model, restored.config, restored.tokenizer, restored.mesh,
                           batch_size=args.batch_size, max_length=args.max_length or None)
    print(f'Evaluating step {restored.step} of {restored.directory} on mesh '
          f'{mesh_lib.describe(restored.mesh.shape)}: {", ".join(tasks)}.', flush=True)
    if lm.sampling_plan():
      print(lm.sampling_plan(), flush=True)
    results = harness.evaluate(lm, tasks, manager, num_fewshot=args.num_fewshot,
                               limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit,
                               apply_chat_template=args.apply_chat_template)
  except errors.MintrainError as e:
    startup.fail(str(e))
  results.pop('samples', None)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(results, indent=2, default=lm_eval.utils.handle_non_serializable,
                               ensure_ascii=False) + '\n')
  print(lm_eval.utils.make_table(results))
  if 'groups' in results:
    print(lm_eval.utils.make_table(results, 'groups'))
  print(f'Wrote {output}.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
