"""Plot loss and throughput of one or more runs from their metrics.jsonl.

  python scripts/plot_metrics.py runs/dp4_tp2 runs/fsdp8 --out runs/compare.png

Top: train loss (solid) and eval loss (dashed) against step; bottom: tokens/s
against step. One colour per run, labelled by its workdir's name.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


class MetricsError(ValueError):
  """A workdir without usable metrics."""


def read_records(workdir: pathlib.Path) -> list[dict]:
  """The records of WORKDIR/metrics.jsonl; lines that do not parse (a run cut off mid-write) are skipped."""
  path = workdir / 'metrics.jsonl'
  if not path.is_file():
    raise MetricsError(f'{workdir} has no metrics.jsonl; train with --workdir {workdir} to write one.')
  records = []
  for line in path.read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and 'step' in record:
      records.append(record)
  if not records:
    raise MetricsError(f'{path} has no records with a step.')
  return newest_attempts(records)


def newest_attempts(records: list[dict]) -> list[dict]:
  """The records of the run's surviving timeline, in step order. Each record names its `attempt` (a resume
  after a crash is a new one); a later attempt's records replace an earlier one's past the step it resumed
  from, and at that step where they hold the same figures."""
  def attempt(r: dict) -> int:
    return r.get('attempt', 0)

  first, keys = {}, {}  # Attempt -> the first step it logged; (attempt, step) -> the figures logged then.
  for r in records:
    first[attempt(r)] = min(first.get(attempt(r), r['step']), r['step'])
    keys.setdefault((attempt(r), r['step']), set()).update(r)

  def superseded(r: dict) -> bool:
    figures = set(r) - {'step', 'attempt'}
    return any(a > attempt(r) and (step < r['step'] or (step == r['step'] and keys[a, step] & figures))
               for a, step in first.items())

  return sorted((r for r in records if not superseded(r)), key=lambda r: r['step'])


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
  """(steps, values) of the records that have `key`."""
  pairs = [(r['step'], r[key]) for r in records if r.get(key) is not None]
  return [s for s, _ in pairs], [v for _, v in pairs]


def plot(runs: dict[str, list[dict]], out: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
  for i, (name, records) in enumerate(runs.items()):
    color = f'C{i}'
    for key, style, label in (('loss', '-', name), ('eval_loss', '--', f'{name} (eval)')):
      steps, values = series(records, key)
      if steps:
        loss_ax.plot(steps, values, style, color=color, label=label)
    steps, values = series(records, 'tokens_per_sec')
    if steps:
      speed_ax.plot(steps, values, '-', color=color, marker='.', label=name)
  loss_ax.set(ylabel='loss', title='loss (solid: train, dashed: eval)')
  speed_ax.set(xlabel='step', ylabel='tokens/s', title='throughput')
  speed_ax.set_ylim(bottom=0)
  for ax in (loss_ax, speed_ax):
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize='small')
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('workdirs', nargs='+', type=pathlib.Path, metavar='WORKDIR',
                      help='run directories, each with a metrics.jsonl')
  parser.add_argument('--out', type=pathlib.Path, default=None,
                      help='PNG to write (default: WORKDIR[0]/metrics.png)')
  args = parser.parse_args(argv)
  try:
    runs = {}
    for workdir in args.workdirs:
      name = workdir.resolve().name
      runs[name if name not in runs else str(workdir)] = read_records(workdir)
  except MetricsError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  out = args.out or args.workdirs[0] / 'metrics.png'
  plot(runs, out)
  print(f'wrote {out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
