#!/usr/bin/env python
"""What a DPO step costs against the SFT step on the same pairs, in one run.

The SFT step trains on the pairs' prompt + chosen sequences alone (one padded row each); DPO trains on both
sequences of each pair, with its reference as a copy in the state (one more forward pass over both), with
LoRA (the reference is the frozen base: no copy), or precomputed (`dpo.precompute_reference`: the step
reads the reference's log-probabilities from the batch). Pairs are random bytes written to a temporary
JSONL file; step times are medians of jitted steps after warm-up, each until `block_until_ready`.

  python benchmarks/dpo.py                  # bench_tiny's model on 16 pairs of 128 tokens
  python benchmarks/dpo.py --smoke          # tiny model, one step: it still runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

import harness
import jax
import numpy as np

from mintrain import report
from mintrain.objectives import dpo

COMMON = ('data.tokenizer=byte', 'data.source=jsonl', 'data.packing=pad', 'data.eval_fraction=0.0',
          'model.vocab_size=256', 'train.seq_len=128', 'data.block_bytes=4096')
DPO = ('train.objective=dpo', 'data.format=preference')
VARIANTS = {
    'sft': (),
    'dpo, reference copy': DPO,
    'dpo, LoRA (r=8)': (*DPO, 'lora.rank=8'),
    'dpo, precomputed reference': (*DPO, 'dpo.precompute_reference=True'),
}


def write_pairs(directory: str, count: int, prompt: int, response: int) -> tuple[str, str]:
  """(pairs file, file of their prompt + chosen as text): random printable bytes."""
  rng = np.random.default_rng(0)
  def text(n: int) -> str:
    return bytes(rng.integers(97, 123, n).astype(np.uint8)).decode()
  pairs = [{'prompt': text(prompt), 'chosen': text(response), 'rejected': text(response)}
           for _ in range(count)]
  with open(f'{directory}/pairs.jsonl', 'w') as f:
    f.writelines(json.dumps(p) + '\n' for p in pairs)
  with open(f'{directory}/sft.jsonl', 'w') as f:
    f.writelines(json.dumps({'text': p['prompt'] + p['chosen']}) + '\n' for p in pairs)
  return f'{directory}/pairs.jsonl', f'{directory}/sft.jsonl'


def with_reference(built, batches: list[dict[str, jax.Array]]) -> list[dict[str, jax.Array]]:
  """The batches with the initial state's reference log-probabilities, as the loop's pass attaches them."""
  with jax.set_mesh(built.mesh):
    state = built.init()
    logp = dpo.reference_pass(built, state, iter(batches), len(batches))
    attached = dpo.WithReference(iter(batches), logp, dpo.batch_sharding(built.mesh, built.rules, 2))
    return [jax.block_until_ready(next(attached)) for _ in batches]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser, 'config override applied to every variant; repeatable')
  parser.add_argument('--steps', type=int, default=5, help='timed steps per variant')
  parser.add_argument('--warmup', type=int, default=3, help='untimed steps after compiling')
  parser.add_argument('--smoke', action='store_true', help='tiny model, one step')
  args = parser.parse_args()

  devices = harness.start_devices()
  path, base = (args.config.resolve(), ()) if args.config else (harness.BENCH_TINY, ())
  base = base + COMMON + tuple(args.override) + (harness.SMOKE if args.smoke else ())
  steps, warmup = (1, 1) if args.smoke else (args.steps, args.warmup)
  rows, shown = [], None
  with tempfile.TemporaryDirectory() as directory:
    pairs, sft = write_pairs(directory, 256, 48, 64)
    for name, overrides in VARIANTS.items():
      source = f'data.path={pairs if overrides else sft}'
      config = harness.load(path, (*base, source, *overrides))
      built = harness.build(config, devices)
      batches = harness.device_batches(built, 2)
      if config.dpo.precompute_reference and config.train.objective == 'dpo':
        batches = with_reference(built, batches)
      compiled = harness.compile_step(built, batches[0])
      times, losses = harness.time_steps(compiled, built, batches, warmup=warmup, steps=steps)
      step_s = statistics.median(times)
      shown = shown or (config, built)
      rows.append([name, f'{compiled.total_s:.1f}', f'{step_s * 1e3:.1f}', harness.spread(times),
                   f'{report.train_flops_per_step(config) / 1e9:.2f}', f'{report.tokens_per_step(config):,}',
                   f'{harness.mib(built.plan.total)}', f'{losses[0]:.4f}'])
      print(f'measured {name}', flush=True)
  config, built = shown
  print(f'\nconfig {harness.describe_config(path, base)}')
  print(f'mesh {harness.describe_mesh(built.mesh)}, {harness.param_count(built):,} parameters; '
        f'{config.train.global_batch_size} pairs (SFT: sequences) of {config.train.seq_len} tokens per step; '
        f'median of {steps} steps after {warmup} warm-up\n')
  print(harness.table(['variant', 'compile_s', 'step_ms', 'spread', 'GFLOP_per_step', 'tokens_per_step',
                       'plan_MiB_per_device', 'loss_at_init'], rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
