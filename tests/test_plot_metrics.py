"""scripts/plot_metrics.py turns runs' metrics.jsonl into one PNG, or fails with one clear line."""

import json
import math
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, load_config, mesh_devices

from mintrain import loop
from mintrain.cli import plot_metrics

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def write_run(workdir, speed: float) -> None:
  """Train records every 10 steps, eval records every 50, and a last line cut off mid-write."""
  workdir.mkdir()
  lines = []
  for step in range(10, 201, 10):
    lines.append({'step': step, 'loss': 5 * math.exp(-step / 60), 'tokens_per_sec': speed + step})
    if step % 50 == 0:
      lines.append({'step': step, 'eval_loss': 5.2 * math.exp(-step / 70)})
  lines.append({'step': 10, 'learning_rate': 1e-3})  # No loss and no throughput: plotted nowhere.
  text = ''.join(json.dumps(r) + '\n' for r in lines) + '{"step": 210, "lo'
  (workdir / 'metrics.jsonl').write_text(text)


def plot(*args):
  return subprocess.run([sys.executable, str(REPO / 'scripts' / 'plot_metrics.py'), *map(str, args)],
                        capture_output=True, text=True, timeout=60)


def test_two_runs_plot_to_a_png_in_the_first_workdir(tmp_path):
  write_run(tmp_path / 'dp8', speed=20000)
  write_run(tmp_path / 'fsdp4_tp2', speed=15000)
  result = plot(tmp_path / 'dp8', tmp_path / 'fsdp4_tp2')
  assert result.returncode == 0, result.stderr
  out = tmp_path / 'dp8' / 'metrics.png'
  assert result.stdout.strip() == f'wrote {out}'
  data = out.read_bytes()
  assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_out_sets_the_png_path(tmp_path):
  write_run(tmp_path / 'run', speed=1000)
  result = plot(tmp_path / 'run', '--out', tmp_path / 'plots' / 'loss.png')
  assert result.returncode == 0, result.stderr
  assert (tmp_path / 'plots' / 'loss.png').read_bytes().startswith(PNG_MAGIC)


def test_workdir_without_metrics_is_a_one_line_error(tmp_path):
  write_run(tmp_path / 'good', speed=1000)
  (tmp_path / 'empty').mkdir()
  result = plot(tmp_path / 'good', tmp_path / 'empty')
  assert result.returncode == 2
  assert result.stderr.strip() == (f'error: {tmp_path / "empty"} has no metrics.jsonl; '
                                   f'train with --workdir {tmp_path / "empty"} to write one.')
  assert not (tmp_path / 'good' / 'metrics.png').exists()


@pytest.mark.slow  # a crashed and a resumed run (~12 s): the default suite time.
def test_after_a_crash_and_resume_each_record_names_its_attempt_and_the_plot_takes_the_newest(tmp_path):
  small = ('model.num_layers=1', 'model.embed_dim=64', 'model.mlp_dim=128', 'train.global_batch_size=16',
           'train.seq_len=32', 'train.log_every=1', 'train.steps=4', 'checkpoint.every_steps=2',
           'eval.every_steps=0')
  config = load_config('dp8', *small)
  loop.run(config, tmp_path, devices=mesh_devices(config), print_fn=lambda _: None)
  shutil.rmtree(tmp_path / 'checkpoints' / '4')  # A crash after step 4's record, before its save.
  resumed = load_config('dp8', *small, 'optimizer.learning_rate=0.1')  # Other losses from step 3 on.
  loop.run(resumed, tmp_path, devices=mesh_devices(resumed), print_fn=lambda _: None)
  lines = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  train = [(r['attempt'], r['step']) for r in lines if 'loss' in r]
  assert train == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 3), (2, 4)]
  assert (tmp_path / 'attempt').read_text() == '2\n'
  records = plot_metrics.read_records(tmp_path)
  newest = {r['step']: r['loss'] for r in lines if 'loss' in r and r['attempt'] == 2}
  oldest = {r['step']: r['loss'] for r in lines if 'loss' in r and r['attempt'] == 1}
  assert newest[4] != oldest[4]
  assert plot_metrics.series(records, 'loss') == ([1, 2, 3, 4], [oldest[1], oldest[2], newest[3], newest[4]])
