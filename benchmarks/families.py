#!/usr/bin/env python
"""The newer model families' step time against a Llama of the same active size.

One shape for all (bench_tiny's width, 6 layers, a 4k vocabulary, 4-way data x 2-way tensor): Llama as it
is; Gemma 2 (GeGLU, (1 + w) norms, post-norms, local layers of a 128 window every other one, soft-caps);
Gemma 3 (Gemma 2's without soft-caps, QK-norm, five local layers to one global); Qwen3-MoE (QK-norm, 8
experts of half the MLP width, 2 per token, dropless); DeepSeek-V3 (latent attention, one dense block, then
8 experts of a quarter of the width, 2 per token, and a shared expert of half: the MLP's active width).
All are compiled first, then timed in turns (one step of each, again and again), so a shared machine's
load slows them alike. The GFLOP column is the analytic count (active experts only).

  python benchmarks/families.py            # ~10 min on a loaded 2-core CPU machine
  python benchmarks/families.py --smoke    # tiny models, one step each
"""

from __future__ import annotations

import argparse
import statistics
import sys

import harness

from mintrain import report

BASE = ('model.vocab_size=4096', 'model.num_layers=6')
GEMMA = ('model.norm_plus_one=True', 'model.embed_scale=True', 'model.mlp_activation=gelu_tanh',
         'model.post_norms=True', 'model.sliding_window=128')
VARIANTS = {
    'llama': (),
    'gemma2': (*GEMMA, 'model.global_every=2', 'model.attn_softcap=50.0', 'model.final_softcap=30.0'),
    'gemma3': (*GEMMA, 'model.global_every=6', 'model.qk_norm=True', 'model.rope_local_base=10000.0'),
    'qwen3_moe': ('model.qk_norm=True', 'model.num_experts=8', 'model.experts_per_token=2',
                  'model.expert_mlp_dim=512'),
    'deepseek_v3': ('model.kv_lora_rank=128', 'model.q_lora_rank=192', 'model.qk_nope_head_dim=64',
                    'model.head_dim=32', 'model.v_head_dim=64', 'model.num_experts=8',
                    'model.experts_per_token=2', 'model.expert_mlp_dim=256', 'model.shared_expert_dim=512',
                    'model.shared_expert_gate=False', 'model.dense_layers=(0,)', 'model.router_score=sigmoid',
                    'model.router_groups=4', 'model.router_group_topk=2', 'model.routed_scaling_factor=2.5',
                    'model.load_balance_loss_weight=0.0', 'model.router_z_loss_weight=0.0'),
}
SMOKE = {'gemma2': ('model.sliding_window=8',), 'gemma3': ('model.sliding_window=8',),
         'qwen3_moe': ('model.expert_mlp_dim=64',),
         'deepseek_v3': ('model.kv_lora_rank=16', 'model.q_lora_rank=16', 'model.qk_nope_head_dim=8',
                         'model.head_dim=8', 'model.v_head_dim=8', 'model.expert_mlp_dim=32',
                         'model.shared_expert_dim=64')}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser, 'config override applied to every variant; repeatable')
  parser.add_argument('--only', nargs='+', choices=sorted(VARIANTS), default=None, help='variants to run')
  parser.add_argument('--steps', type=int, default=6, help='timed steps per variant')
  parser.add_argument('--warmup', type=int, default=2, help='untimed steps per variant after compiling')
  parser.add_argument('--smoke', action='store_true', help='tiny models, one step each')
  args = parser.parse_args()
  devices = harness.start_devices()
  path, base = (args.config.resolve(), ()) if args.config else harness.bench_tiny()
  base = (*base, *BASE, *args.override, *(harness.SMOKE if args.smoke else ()))
  steps, warmup = (1, 1) if args.smoke else (args.steps, args.warmup)
  names = args.only or list(VARIANTS)
  runs = []
  for name in names:
    config = harness.load(path, (*base, *VARIANTS[name], *(SMOKE.get(name, ()) if args.smoke else ())))
    runs.append(harness.prepare(config, devices))
    print(f'compiled {name}', flush=True)
  times = [t.wall for t in harness.time_interleaved(runs, warmup=warmup, steps=steps)]
  first = statistics.median(times[0])
  rows = []
  for name, (compiled, built, _), step_times in zip(names, runs, times):
    step_s = statistics.median(step_times)
    gflop = report.train_flops_per_step(built.config) / 1e9
    rows.append([name, f'{harness.param_count(built):,}', f'{gflop:.1f}', f'{compiled.total_s:.1f}',
                 f'{step_s * 1e3:.1f}', harness.spread(step_times), f'{step_s / first:.2f}'])
  print(f'\nconfig {harness.describe_config(path, base)}')
  print(f'mesh {harness.describe_mesh(runs[0][1].mesh)}; median of {steps} steps after {warmup} warm-up, '
        f'variants in turns; step / {names[0]}: against the first variant\n')
  print(harness.table(['family', 'parameters', 'GFLOP per step (active)', 'compile_s', 'step_ms', 'spread',
                       f'step / {names[0]}'], rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
