"""Faults met through scripts/train.py: the console holds mintrain's one line, the details go to the run's
log file (WORKDIR/logs/run.log)."""

from __future__ import annotations

from conftest import SCRIPT_DEFAULTS, run_script

SMALL = tuple(f'--config.{item}' for item in (
    'data.source=synthetic', 'model.num_layers=1', 'model.embed_dim=64', 'model.mlp_dim=128',
    'train.log_every=1', 'eval.every_steps=0', 'checkpoint.every_steps=2'))


def train(workdir, steps: int):
  return run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', *SCRIPT_DEFAULTS, *SMALL,
                    f'--config.train.steps={steps}', '--workdir', str(workdir))


def test_a_fallback_past_a_damaged_checkpoint_prints_one_warning_and_logs_orbax_details_to_the_run_log(
    tmp_path):
  workdir = tmp_path / 'run'
  assert train(workdir, 4).returncode == 0
  files = sorted((workdir / 'checkpoints' / '4' / 'state').rglob('ocdbt.process_0/d/*'),
                 key=lambda p: p.stat().st_size)
  files[-1].write_bytes(files[-1].read_bytes()[: files[-1].stat().st_size // 2])
  proc = train(workdir, 6)
  assert proc.returncode == 0, proc.stderr[-3000:]
  console = (proc.stdout + proc.stderr).splitlines()
  assert len(proc.stderr.splitlines()) == 0, proc.stderr[-3000:]
  assert not [line for line in console if 'Traceback' in line or 'Exception ignored' in line]
  assert len([line for line in console if line.startswith('warning: Checkpoint step 4')]) == 1
  details = (workdir / 'logs' / 'run.log').read_text()
  assert 'Traceback' in details and 'Encountered error while reading array index' in details
