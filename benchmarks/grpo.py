#!/usr/bin/env python
"""GRPO's step time split between sampling and updating, at group sizes 4 and 8, in one process.

Each variant trains examples/arithmetic/config.py (dp4_tp2, the default model, the byte tokenizer) for
--steps steps on 8 prompts per step, so group size 8 samples and updates twice the rows of group size 4.
Per step: `grpo_sample_sec` (the KV-cached sampler, every row), `grpo_rollout_sec` (with the rewards and the
reference's log-probabilities) and `grpo_update_sec` (the train step's updates); medians over the steps after
the first two (compilation).

  python examples/arithmetic/make_prompts.py
  PYTHONPATH=examples/arithmetic python benchmarks/grpo.py
"""

from __future__ import annotations

import argparse
import pathlib
import statistics

import harness

from mintrain import loop

CONFIG = pathlib.Path(__file__).resolve().parent.parent / 'examples' / 'arithmetic' / 'config.py'
PROMPTS_PER_STEP = 8
KEYS = ('grpo_sample_sec', 'grpo_rollout_sec', 'grpo_update_sec')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--steps', type=int, default=12, help='steps per group size')
  parser.add_argument('--group_sizes', default='4,8', help='comma-separated group sizes')
  args = parser.parse_args()
  devices = harness.start_devices()
  print('| group size | rows | sample s | rollout s | update s | sampling share |')
  print('| --- | --- | --- | --- | --- | --- |')
  for group in map(int, args.group_sizes.split(',')):
    rows = group * PROMPTS_PER_STEP
    config = harness.load(CONFIG, (f'grpo.group_size={group}', f'train.global_batch_size={rows}',
                                   f'train.steps={args.steps}', 'train.log_every=1'))
    records = loop.run(config, None, devices=devices, print_fn=lambda _: None).records
    steps = [r for r in records if 'grpo_update_sec' in r][2:]
    sample, rollout, update = (statistics.median(r[k] for r in steps) for k in KEYS)
    print(f'| {group} | {rows} | {sample:.3f} | {rollout:.3f} | {update:.3f} | '
          f'{rollout / (rollout + update):.0%} |')


if __name__ == '__main__':
  main()
