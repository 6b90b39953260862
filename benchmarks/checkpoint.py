#!/usr/bin/env python
"""What a checkpoint costs the train loop on the dp4_tp2 mesh, and what restoring it costs on any mesh.

An asynchronous save should block the loop only while arrays are copied off the devices; the write
then runs in the background. This measures that block against a train step and against the time
until the checkpoint is durable, the bytes one checkpoint takes, and the restore time on the saving
mesh and on meshes with another layout (where each device reads only its own shard).

  python benchmarks/checkpoint.py          # dp4_tp2's model and one ~10x larger (~90 s on 2 CPU cores)
  python benchmarks/checkpoint.py --smoke  # a tiny model, one repetition: checks that it still runs
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys
import tempfile
import time

import harness
import jax

from mintrain import configs
from mintrain import mesh as mesh_lib
from mintrain.actions import checkpoint_metadata
from mintrain.build import Run
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.configs import test_small
from mintrain.data import tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]


SAVE_MESH = 'dp4_tp2'
RESTORE_MESHES = ('dp4_tp2', 'fsdp8', 'tp8', 'single')  # Config names; the first is the saving mesh.
DEVICES = 8

# Synthetic batches: they cost nothing to read, so step times are the model's alone.
COMMON = ('data.source=synthetic',)
# Model name -> config overrides on top of each mesh's config. Heads stay divisible by tp8's 8 ways.
MODELS = {
    'default': (),
    'x10': ('model.embed_dim=256', 'model.num_heads=16', 'model.mlp_dim=1024', 'model.num_layers=5'),
}
SMOKE_MODELS = {'tiny': test_small.OVERRIDES}


@dataclasses.dataclass
class Row:
  model: str
  params: int
  step_s: float  # Median train step, compiled, batch already on device.
  first_blocked_s: float  # The run's first save also compiles Orbax's per-shard copies.
  blocked_s: float  # Median time `Checkpoints.save` holds the loop.
  total_s: float  # Median time from the save call until `wait()` returns.
  bytes_written: int  # One step directory on disk.
  restore_s: dict[str, float]  # Mesh config name -> median restore time, until the arrays are ready.


def build(mesh_name: str, overrides: tuple[str, ...], devices: list) -> Run:
  """The run of mintrain/configs/MESH_NAME.py with `overrides`."""
  return harness.build(harness.load(configs.DIR / f'{mesh_name}.py', COMMON + overrides), devices)


def dir_bytes(path: pathlib.Path) -> int:
  return sum(f.stat().st_size for f in pathlib.Path(path).rglob('*') if f.is_file())  # A local folder.


def measure(name: str, overrides: tuple[str, ...], devices: list, workdir: pathlib.Path, *, saves: int,
            steps_between: int, restores: int) -> Row:
  """Trains on dp4_tp2 with `saves` saves in between, then restores the last one on every mesh."""
  run = build(SAVE_MESH, overrides, devices)
  checkpoints = ckpt_lib.Checkpoints(workdir / name, keep=saves)  # Keep all: no deletion mid-measurement.
  step_times, blocked, total = [], [], []
  with jax.set_mesh(run.mesh):
    state = run.init()
    step_fn = run.train_step
    batches = run.batches(tokenizer.load(run.config.data.tokenizer))
    state, metrics = step_fn(state, next(batches))  # Compiles.
    jax.block_until_ready((state, metrics))
    for _ in range(saves):
      for _ in range(steps_between):
        batch = jax.block_until_ready(next(batches))
        start = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready((state, metrics))
        step_times.append(time.perf_counter() - start)
      step = int(state.step)
      metadata = checkpoint_metadata(run, step)
      start = time.perf_counter()
      checkpoints.save(step, state, data_state=batches.get_state(), metadata=metadata)
      blocked.append(time.perf_counter() - start)
      checkpoints.wait()
      total.append(time.perf_counter() - start)
  bytes_written = dir_bytes(checkpoints.step_dir(step))

  restore_s = {}
  for mesh_name in RESTORE_MESHES:
    target = build(mesh_name, overrides, devices)
    times = []
    with jax.set_mesh(target.mesh):
      for _ in range(restores):
        start = time.perf_counter()
        tree = checkpoints.restore(step, target.abstract_state).state
        jax.block_until_ready(tree)
        times.append(time.perf_counter() - start)
        assert int(tree['step']) == step, (int(tree['step']), step)
    restore_s[mesh_name] = statistics.median(times)
  checkpoints.close()
  params = sum(math.prod(p.shape) for p in run.layout)
  return Row(name, params, statistics.median(step_times), blocked[0], statistics.median(blocked),
             statistics.median(total), bytes_written, restore_s)


def table(rows: list[Row]) -> str:
  """A Markdown table, so the output pastes into BENCHMARKS.md as it is."""
  header = ['model', 'params', 'step_ms', 'first_save_blocked_ms', 'save_blocked_ms', 'save_total_ms',
            'ckpt_MiB', *(f'restore_{m}_ms' for m in RESTORE_MESHES)]
  lines = [header, ['---'] * len(header)]
  for r in rows:
    lines.append([r.model, f'{r.params:,}', f'{r.step_s * 1e3:.1f}', f'{r.first_blocked_s * 1e3:.1f}',
                  f'{r.blocked_s * 1e3:.1f}', f'{r.total_s * 1e3:.1f}', f'{r.bytes_written / 2**20:.2f}',
                  *(f'{r.restore_s[m] * 1e3:.1f}' for m in RESTORE_MESHES)])
  return '\n'.join('| ' + ' | '.join(cells) + ' |' for cells in lines)


def ratios(rows: list[Row]) -> str:
  same = RESTORE_MESHES[0]
  out = []
  for r in rows:
    other = ', '.join(f'{m} {r.restore_s[m] / r.restore_s[same]:.2f}x' for m in RESTORE_MESHES[1:])
    out.append(f'- {r.model}: blocked / total save {r.blocked_s / r.total_s:.2f}; blocked / step '
               f'{r.blocked_s / r.step_s:.2f} (first save {r.first_blocked_s / r.step_s:.1f}); '
               f'restore vs {same}: {other}')
  return '\n'.join(out)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--smoke', action='store_true', help='tiny model, one repetition (a few seconds)')
  args = parser.parse_args()

  from absl import logging
  logging.set_verbosity(logging.ERROR)  # Orbax logs routine decisions at WARNING.
  mesh_lib.simulate_cpu_devices(DEVICES)  # Before the first device query starts the backend.
  devices, note = mesh_lib.pick_devices(DEVICES)
  if note:
    print(note, flush=True)

  models = SMOKE_MODELS if args.smoke else MODELS
  reps = dict(saves=1, steps_between=1, restores=1) if args.smoke else dict(saves=7, steps_between=3,
                                                                            restores=5)
  rows = []
  with tempfile.TemporaryDirectory(prefix='mintrain_ckpt_bench_') as workdir:
    for name, overrides in models.items():
      rows.append(measure(name, overrides, devices, pathlib.Path(workdir), **reps))
      print(f'measured {name}', flush=True)
  print(f'\nSaved on {SAVE_MESH}; medians of {reps["saves"]} saves ({reps["steps_between"]} train steps '
        f'before each) and {reps["restores"]} restores per mesh.\n')
  print(table(rows))
  print()
  print(ratios(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
