"""Faults a run meets: the console holds mintrain's one line, the details go to the run's log file
(WORKDIR/logs/run.log)."""

from __future__ import annotations

import subprocess

import pytest
from helpers import SCRIPT_DEFAULTS, load_config, mesh_devices, run_script

from mintrain import errors, loop
from mintrain.checkpoint import checkpoints as ckpt_lib

pytestmark = pytest.mark.slow  # Real runs through the script: CI runs them after the default suite.

SMALL = tuple(f'--config.{item}' for item in (
    'data.source=synthetic', 'model.num_layers=1', 'model.embed_dim=64', 'model.mlp_dim=128',
    'train.log_every=1', 'eval.every_steps=0', 'checkpoint.every_steps=2'))


def train(workdir, steps: int, env_extra: dict[str, str] | None = None):
  return run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', *SCRIPT_DEFAULTS, *SMALL,
                    f'--config.train.steps={steps}', '--workdir', str(workdir), env_extra=env_extra)


def test_a_fallback_past_a_damaged_checkpoint_prints_one_warning_and_logs_orbax_details_to_the_run_log(
    tmp_path):
  workdir = tmp_path / 'run'
  assert train(workdir, 4).returncode == 0
  files = sorted((workdir / 'checkpoints' / '4' / 'state').rglob('ocdbt.process_0/d/*'),
                 key=lambda p: p.stat().st_size)
  files[-1].write_bytes(files[-1].read_bytes()[: files[-1].stat().st_size // 2])
  # Orbax's failed reads report their details when the garbage collector takes them; with its automatic
  # runs off, they reach the run's log only if the fallback collects them itself.
  (tmp_path / 'no_gc').mkdir()
  (tmp_path / 'no_gc' / 'sitecustomize.py').write_text('import gc\ngc.disable()\n')
  proc = train(workdir, 6, env_extra={'PYTHONPATH': str(tmp_path / 'no_gc')})
  assert proc.returncode == 0, proc.stderr[-3000:]
  console = (proc.stdout + proc.stderr).splitlines()
  assert len(proc.stderr.splitlines()) == 0, proc.stderr[-3000:]
  assert not [line for line in console if 'Traceback' in line or 'Exception ignored' in line]
  assert len([line for line in console if line.startswith('warning: Checkpoint step 4')]) == 1
  details = (workdir / 'logs' / 'run.log').read_text()
  assert 'Checkpoint step 4 could not be read' in details
  assert 'Traceback' in details and 'Encountered error while reading array index' in details


@pytest.fixture
def small_disk(tmp_path):
  """A 600 KiB tmpfs: room for the run's metrics, not for one checkpoint."""
  path = tmp_path / 'disk'
  path.mkdir()
  proc = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=600k', 'tmpfs', str(path)], capture_output=True,
                        text=True, timeout=30)
  if proc.returncode:
    pytest.skip(f'cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}')
  yield path
  subprocess.run(['umount', '--lazy', str(path)], check=True, timeout=60)


def test_a_disk_that_fills_during_a_save_is_one_error_and_nothing_on_stderr(small_disk, monkeypatch, capfd):
  monkeypatch.setattr(ckpt_lib, 'free_bytes', lambda path: None)  # Past the check before the save.
  config = load_config('dp4_tp2', *(item.removeprefix('--config.') for item in SMALL), 'train.steps=2',
                       'checkpoint.every_steps=1')
  with pytest.raises(errors.DiskFullError, match='Saving checkpoint step 1 .* ran out of disk space'):
    loop.run(config, small_disk / 'run', devices=mesh_devices(config), print_fn=lambda _: None)
  assert capfd.readouterr().err == ''
  assert not list((small_disk / 'run' / 'checkpoints').iterdir())  # The partial save was removed.
