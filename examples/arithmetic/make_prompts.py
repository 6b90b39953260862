"""Writes the arithmetic task's prompt records: `{"prompt": "23+58=", "answer": "81"}`, one a line.

  python examples/arithmetic/make_prompts.py --out examples/arithmetic/prompts.jsonl --count 2000
"""

from __future__ import annotations

import argparse
import json
import random


def records(count: int, max_operand: int, seed: int) -> list[dict[str, str]]:
  """`count` sums and differences of operands in [0, max_operand], with their exact answers."""
  rng = random.Random(seed)
  out = []
  for _ in range(count):
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice('+-')
    out.append({'prompt': f'{a}{op}{b}=', 'answer': str(a + b if op == '+' else a - b)})
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--out', default='examples/arithmetic/prompts.jsonl', help='the JSONL file to write')
  parser.add_argument('--count', type=int, default=2000, help='prompts to write')
  parser.add_argument('--max_operand', type=int, default=99, help='largest operand')
  parser.add_argument('--seed', type=int, default=0, help='seed of the draws')
  args = parser.parse_args()
  with open(args.out, 'w', encoding='utf-8') as f:
    for record in records(args.count, args.max_operand, args.seed):
      f.write(json.dumps(record) + '\n')


if __name__ == '__main__':
  main()
