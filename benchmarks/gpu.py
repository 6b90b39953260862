#!/usr/bin/env python
"""What one accelerator gets out of mintrain: the MFU of a ~1B Llama, and dropless experts on its grouped
matmul. Written for an NVIDIA GPU (an H100 or H200 has its peak in `mintrain.runtime.hardware`); `--smoke`
runs every part at toy sizes anywhere, the CPU included.

Parts (`--part`, repeatable; default all, in this order):

  mfu      mintrain/configs/llama3_1b.py and variants of it (scanned layers; MaxText's shipped choice of
           scanned layers and full remat; XLA's attention instead of cuDNN's): compile seconds, step time,
           model TFLOP/s, MFU against the device table's peak and against a bfloat16 matmul measured in the
           same run, the compiler's memory for the step, and how many cuDNN attention calls the step has.
           With --profile DIR, one more step of the first variant is traced and broken down by op
           (benchmarks/op_profile.py); DIR gets its HLO and trace.
  kernels  `grouped.gated_mlp` through `ragged_dot` (the GPU's grouped matmul) and through the CPU's tiles,
           values and gradients against a per-row reference (float32 at full precision: the GPU's default
           float32 matmul is TF32); then each kernel timed forward and backward in bfloat16 against a dense
           gated MLP of the same FLOPs, with (on a GPU) `mosaic_gpu`, JAX's Mosaic GPU grouped matmuls,
           whose values and gradients are checked there against the tiles' in bfloat16.
  moe      the 1B's width with 4 layers: the dense step against 8 experts top-2 (each half as wide) and 64
           experts top-4 (a quarter), the same active parameters, through ragged_dot, tiles, mosaic_gpu and
           the slots of the capacity path (every expert a whole sequence's slots: E / k the work).

Model FLOPs are `report.train_flops_per_step` (matmuls, causal attention halved), as the training loop's
MFU; steps are timed as benchmarks/step.py times them (compiled ahead, each until `block_until_ready`).
A part that fails prints its error and the next one runs: on a lent machine every part's figure counts.

  python benchmarks/gpu.py                          # on a GPU host: every part
  python benchmarks/gpu.py --part mfu --budget_s 300
  python benchmarks/gpu.py --part mfu --profile /tmp/gpu_profile
  python benchmarks/gpu.py --part moe --variant '8e top-2 tiles'   # the dense step and the named ones
  python benchmarks/gpu.py --smoke                  # toy sizes, two variants a part, one step each
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import harness
import jax
import jax.numpy as jnp
import numpy as np
import op_profile

from mintrain import configs, report
from mintrain import mesh as mesh_lib
from mintrain.models.transformer import grouped
from mintrain.runtime import hardware

LLAMA_1B = configs.path('llama3_1b')
MFU_VARIANTS = {
    'as configured (unrolled, no remat)': (),
    'scanned layers': ('model.scan_layers=True',),
    'scanned, full remat, batch 16': ('model.scan_layers=True', 'model.remat=full',
                                      'train.global_batch_size=16'),
    "XLA's attention (einsum)": ('model.attention=einsum',),
}
MOE_BASE = ('model.num_layers=4',)
E8 = ('model.num_experts=8', 'model.experts_per_token=2', 'model.expert_mlp_dim=4096')
E64 = ('model.num_experts=64', 'model.experts_per_token=4', 'model.expert_mlp_dim=2048')
MOE_VARIANTS = {
    'dense': (),
    '8e top-2 ragged_dot': (*E8, 'model.grouped_matmul=ragged_dot'),
    '8e top-2 tiles': (*E8, 'model.grouped_matmul=tiles'),  # The platform's automatic tiles.
    '8e top-2 slots (E/k the work)': (*E8, 'model.grouped_matmul=off'),
    '64e top-4 tiles': (*E64, 'model.grouped_matmul=tiles'),
    '8e top-2 mosaic_gpu': (*E8, 'model.grouped_matmul=mosaic_gpu'),
    '64e top-4 mosaic_gpu': (*E64, 'model.grouped_matmul=mosaic_gpu'),
}
PARTS = ('mfu', 'kernels', 'moe')
# Toy sizes for --smoke, on top of every model variant.
SMOKE = ('model.vocab_size=512', 'model.embed_dim=64', 'model.num_layers=2', 'model.num_heads=4',
         'model.num_kv_heads=2', 'model.head_dim=16', 'model.mlp_dim=128', 'train.seq_len=32',
         'train.global_batch_size=4', 'mesh.data=1')
SMOKE_EXPERTS = ('model.expert_mlp_dim=32',)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--part', action='append', choices=PARTS, default=[],
                      help='what to run; repeatable (default: all)')
  parser.add_argument('--variant', action='append', default=[], metavar='NAME',
                      help="run only this model variant of mfu or moe (and moe's dense); repeatable")
  parser.add_argument('--steps', type=int, default=10, help='timed steps per variant')
  parser.add_argument('--warmup', type=int, default=3, help='untimed steps after compiling')
  parser.add_argument('--budget_s', type=float, default=float('inf'),
                      help='start no new variant after this many seconds (a lent machine is timed)')
  parser.add_argument('--profile', type=pathlib.Path, default=None, metavar='DIR',
                      help="trace one more step of mfu's first variant and break it down by op")
  parser.add_argument('--smoke', action='store_true', help='toy sizes, two variants a part, one step each')
  args = parser.parse_args()
  mesh_lib.simulate_cpu_devices(harness.DEVICES)  # Without an accelerator; else the accelerators.
  devices, _ = mesh_lib.pick_devices(None)
  device = devices[0]
  print(f'jax {jax.__version__} on {len(jax.devices())} {device.platform} device(s): {device.device_kind}',
        flush=True)
  deadline = time.perf_counter() + args.budget_s
  if args.profile is not None:
    args.profile.mkdir(parents=True, exist_ok=True)
  steps, warmup = (1, 1) if args.smoke else (args.steps, args.warmup)
  failed = 0
  for part in args.part or PARTS:
    print(f'\n## {part}\n', flush=True)
    try:
      if part == 'kernels':
        kernels(device, smoke=args.smoke)
      else:
        variants = MFU_VARIANTS if part == 'mfu' else MOE_VARIANTS
        if args.smoke:
          variants = dict(list(variants.items())[:2])
        if args.variant:
          variants = {name: o for name, o in variants.items() if name in args.variant or name == 'dense'}
        base = MOE_BASE if part == 'moe' else ()
        extra = (SMOKE + (SMOKE_EXPERTS if part == 'moe' else ())) if args.smoke else ()
        models(variants, base + extra, devices, steps=steps, warmup=warmup, deadline=deadline,
               against_first=part == 'moe', profile=args.profile if part == 'mfu' else None)
    except Exception:  # A part's failure is reported; the other parts still run.
      traceback.print_exc()
      failed += 1
  return 1 if failed else 0


def models(variants: dict[str, tuple[str, ...]], base: Sequence[str], devices: Sequence[jax.Device], *,
           steps: int, warmup: int, deadline: float, against_first: bool,
           profile: pathlib.Path | None = None) -> None:
  """Each variant of llama3_1b compiled and timed alone, one after another; a table at the end. With
  `profile`, the first variant's step is also traced once and broken down by op."""
  device = devices[0]
  peak, source = hardware.peak_tflops(device, 'bfloat16')
  matmul = matmul_tflops(device)
  print(f'peak {peak:.1f} TFLOP/s per device ({source}); bfloat16 8192^3 matmul measured {matmul:.1f}',
        flush=True)
  rows, first_s = [], None
  for name, overrides in variants.items():
    if time.perf_counter() > deadline:
      print(f'skipping {name}: past --budget_s', flush=True)
      continue
    try:
      config = harness.load(LLAMA_1B, (*base, *overrides))
      compiled, built, batches = harness.prepare(config, devices)
      text = compiled.compiled.as_text()
      memory = harness.memory_analysis(compiled)
      trace = profile / 'trace' if profile is not None and not rows else None
      times, losses = harness.time_steps(compiled, built, batches, warmup=warmup, steps=steps, trace=trace)
    except Exception as e:  # Out of memory, or a variant this platform cannot compile: the others run.
      print(f'{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}', flush=True)
      continue
    step_s = statistics.median(times)
    first_s = first_s or step_s
    tflops = report.train_flops_per_step(config) / built.mesh.size / step_s / 1e12
    rows.append([name, f'{compiled.total_s:.1f}', f'{step_s * 1e3:.1f}', harness.spread(times),
                 f'{report.tokens_per_step(config) / step_s:,.0f}', f'{tflops:.1f}', f'{tflops / peak:.1%}',
                 f'{tflops / matmul:.1%}', f'{(memory["argument"] + memory["temp"]) / 2**30:.1f}',
                 str(text.count('__cudnn$fmha')), f'{losses[0]:.3f}']
                + ([f'{step_s / first_s:.2f}'] if against_first else []))
    print(f'{name}: {step_s * 1e3:.1f} ms per step, MFU {tflops / peak:.1%}', flush=True)
    if trace is not None:
      by_op(text, trace, profile)
    del compiled, built, batches, text
  if not rows:
    raise RuntimeError('no variant ran')
  config = harness.load(LLAMA_1B, tuple(base))
  print(f'\nconfig {harness.describe_config(LLAMA_1B, base)}: {config.model.param_count():,} parameters, '
        f'{report.tokens_per_step(config):,} tokens and {report.train_flops_per_step(config) / 1e12:.1f} '
        f'model TFLOP per step, compute {config.model.compute_dtype}; median of {steps} steps after {warmup}')
  print(f'MFU: model TFLOP/s per device over the peak ({peak:.1f}); of matmul: over the measured '
        f'bfloat16 matmul ({matmul:.1f}); memory: the compiler\'s arguments + temporaries; cuDNN: its '
        'attention calls in the compiled step\n')
  print(harness.table(['variant', 'compile_s', 'step_ms', 'spread', 'tokens_per_s', 'model_TFLOP_s', 'MFU',
                       'of matmul', 'memory_GiB', 'cuDNN', 'loss_at_init']
                      + (['step / first'] if against_first else []), rows), flush=True)


def by_op(hlo: str, trace: pathlib.Path, profile: pathlib.Path) -> None:
  """The traced step by op (op_profile), its HLO and trace kept flat in `profile`, and its longest ops."""
  try:
    found = op_profile.newest_trace(trace)
    shutil.copy(found, profile / 'step.xplane.pb')
    (profile / 'step.hlo.txt').write_text(hlo)
    b = op_profile.breakdown(hlo, found)
    header, table = op_profile.rows({'step': b})
    print(f'\none traced step by op ({b.unmatched_ms:.1f} ms of events named no op of the step)\n')
    print(harness.table(header, table))
    print('\nlongest ops\n')
    print(harness.table(['op', 'row', 'pass', 'runs', 'ms', 'matmul GFLOP/s'], b.longest(25)), flush=True)
  except Exception as e:  # The profile is a bonus; the timings stand without it.
    print(f'profile: failed: {type(e).__name__}: {e}', flush=True)


def matmul_tflops(device: jax.Device) -> float:
  size = 1024 if device.platform == 'cpu' else 8192
  return hardware.measure_matmul_tflops('bfloat16', size=size, seconds=1.0, device=device)


# How the grouped matmul is computed: (kernel, rows of a tile; 0: the platform's automatic size). JAX's
# Pallas Triton lowering of ragged_dot (`jax_ragged_dot_use_gpu_pallas_triton_lowering`) is not in its
# 0.11.2 wheels (BENCHMARKS.md).
GROUPED = {
    'ragged_dot': ('ragged_dot', 0),
    'tiles of 256 rows': ('tiles', 256),
    'tiles, automatic': ('tiles', 0),
}
# Kernels for a GPU's bfloat16 only: timed, and checked against the automatic tiles (`speed`).
GPU_GROUPED = {'mosaic_gpu': ('mosaic_gpu', 0)}


def kernels(device: jax.Device, *, smoke: bool) -> None:
  """The grouped matmul's values on this device, then its speed."""
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  rows, groups, d, f = 512, 8, 64, 96
  failed = []
  with jax.default_device(device), jax.default_matmul_precision('highest'):
    x_RD = jax.random.normal(keys[0], (rows, d))
    group_R = jax.random.randint(keys[1], (rows,), 0, groups + 1)  # Some rows (id G) in no group.
    shapes = ((groups, d, f),) * 2 + ((groups, f, d),)
    w = tuple(jax.random.normal(k, s) / 8 for k, s in zip(keys[2:], shapes))

    def loss(mlp, *a):
      return jnp.sum(jnp.sin(mlp(*a)))

    def reference(x, *w):
      return grouped.per_row_mlp(x, group_R, *w, jax.nn.silu)
    want = reference(x_RD, *w)
    want_grads = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2, 3))(x_RD, *w)
    rows_out = []
    for name, (kernel, tile) in GROUPED.items():
      mlp = grouped_mlp(group_R, kernel, grouped.tile_rows(rows, groups, tile, device.platform))
      got = jax.jit(mlp)(x_RD, *w)
      grads = jax.jit(jax.grad(functools.partial(loss, mlp), argnums=(0, 1, 2, 3)))(x_RD, *w)
      errors = [relative_error(got, want)] + [relative_error(g, r) for g, r in zip(grads, want_grads)]
      rows_out.append([name, *(f'{e:.1e}' for e in errors), 'yes' if max(errors) < 1e-5 else 'NO'])
      if max(errors) >= 1e-5:
        failed.append(name)
  print('float32 at full precision, against a per-row reference; relative error ||got - want|| / ||want||\n')
  print(harness.table(['kernel', 'values', 'd x', 'd w_gate', 'd w_up', 'd w_down', 'within 1e-5'], rows_out))
  failed += speed(device, smoke=smoke)
  if failed:
    raise AssertionError(f'off the reference on this device: {", ".join(failed)}')


def grouped_mlp(group_R: jax.Array, kernel: str, tile: int) -> Callable:
  return lambda x, *w: grouped.gated_mlp(x, group_R, *w, jax.nn.silu, kernel=kernel, tile=tile)


def relative_error(got: jax.Array, want: jax.Array) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def speed(device: jax.Device, *, smoke: bool) -> list[str]:
  """Forward and backward of each kernel in bfloat16 at the 1B's width (16k tokens, k choices each, random
  routing), against a dense gated MLP of the same FLOPs (the tokens x k rows through one expert's shape).
  Returns what failed its check."""
  kernels = {**GROUPED, **(GPU_GROUPED if device.platform == 'gpu' else {})}
  failed = []
  shapes = [(256, 8, 2, 64, 32)] if smoke else [(16384, 8, 2, 2048, 4096), (16384, 64, 4, 2048, 2048)]
  header = ['problem', 'dense ms', 'dense TFLOP/s']
  rows_out = []
  for tokens, groups, k, d, f in shapes:
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    with jax.default_device(device):
      x_RD = jax.random.normal(keys[0], (tokens * k, d), jnp.bfloat16)
      group_R = jax.random.randint(keys[1], (tokens * k,), 0, groups)
      w = tuple((jax.random.normal(kk, s) / 32).astype(jnp.bfloat16)
                for kk, s in zip(keys[2:], ((groups, d, f),) * 2 + ((groups, f, d),)))
      dense = tuple(x[:1] for x in w)
    flop = 3 * 2 * 3 * tokens * k * d * f  # Three matmuls, forward and twice backward.
    dense_s = time_grad(per_row_dense, x_RD, *dense)
    line = [f'{tokens} x {k} rows, {groups} groups, {d} x {f}', f'{dense_s * 1e3:.2f}',
            f'{flop / dense_s / 1e12:.1f}']
    tiles = None  # The automatic tiles' values and gradients: what GPU_GROUPED's kernels are checked against.
    for name, (kernel, tile) in kernels.items():
      try:
        mlp = grouped_mlp(group_R, kernel, grouped.tile_rows(tokens * k, groups, tile, device.platform))
        s = time_grad(mlp, x_RD, *w)
        line += [f'{s * 1e3:.2f}', f'{s / dense_s:.2f}']
        if name == 'tiles, automatic':
          tiles = values_and_grads(mlp, x_RD, *w)
        elif name in GPU_GROUPED:
          error = max(relative_error(g, t) for g, t in zip(values_and_grads(mlp, x_RD, *w), tiles))
          line.append(f'{error:.1e}')
          if error > 2e-2:
            failed.append(f'{name} at {line[0]}: relative error {error:.1e} against the tiles')
      except Exception as e:  # Out of memory: XLA's masked ragged_dot holds (rows, groups, width).
        print(f'{name} at {line[0]}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}', flush=True)
        line += ['failed', '-'] + (['-'] if name in GPU_GROUPED else [])
    rows_out.append(line)
  for name in kernels:
    header += [f'{name} ms', 'x dense'] + (['vs tiles'] if name in GPU_GROUPED else [])
  print('\nbfloat16, forward and backward (median ms); x dense: over the dense gated MLP with the same rows '
        '(its TFLOP/s: the routed rows\' matmuls over its time); vs tiles: the largest relative error of the '
        'values and gradients against the automatic tiles\'\n')
  print(harness.table(header, rows_out), flush=True)
  return failed


def values_and_grads(fn: Callable, x: jax.Array, *w: jax.Array) -> list[jax.Array]:
  """fn's values and the gradients of their sum over x and w."""
  def total(*a):
    y = fn(*a)
    return jnp.sum(y.astype(jnp.float32)), y
  grads, y = jax.jit(jax.grad(total, argnums=tuple(range(1 + len(w))), has_aux=True))(x, *w)
  return [y, *grads]


def per_row_dense(x_RD, w_gate_1DF, w_up_1DF, w_down_1FD):
  h_RF = jax.nn.silu(x_RD @ w_gate_1DF[0]) * (x_RD @ w_up_1DF[0])
  return h_RF @ w_down_1FD[0]


def time_grad(fn: Callable, x: jax.Array, *w: jax.Array, repeats: int = 20) -> float:
  """Median seconds of fn's forward and backward (the gradients of a sum over x and w)."""
  step = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=tuple(range(1 + len(w)))))
  jax.block_until_ready(step(x, *w))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(x, *w))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


if __name__ == '__main__':
  sys.exit(main())
