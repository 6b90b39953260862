"""Preemption and crashes, with scripts/train.py as a real subprocess."""

import re
import signal
import subprocess
import sys
import time

import helpers
import pytest
from helpers import REPO, script_env, script_flags

from mintrain.checkpoint import checkpoints as ckpt_lib

SMALL = script_flags(*helpers.SMALL, 'train.log_every=1')
# About 8M parameters: an asynchronous save of it (90 MB) takes long enough to be killed mid-write.
BIG = script_flags('model.embed_dim=512', 'model.mlp_dim=2048', 'model.head_dim=64',
                   'train.global_batch_size=8', 'train.seq_len=16', 'train.log_every=1')


def start(workdir, *args):
  env = script_env()
  command = [sys.executable, 'scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir',
             str(workdir)]
  return subprocess.Popen(
      [*command, *args],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(workdir, *args, timeout=180):
  proc = start(workdir, *args)
  out, _ = proc.communicate(timeout=timeout)
  return proc.returncode, out


# SIGINT takes the same path as SIGTERM. Both runs are in the slow set (the default suite's time); the default
# suite stops runs by SIGTERM in-process (test_checkpoint.py) and the cluster set by scancel.
@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_signal_finishes_the_step_saves_and_exits_zero(tmp_path, sig):
  proc = start(tmp_path, *SMALL, '--config.train.steps=100000', '--config.checkpoint.every_steps=100000')
  lines = []
  try:
    for line in proc.stdout:
      lines.append(line)
      if line.startswith('step 3/'):
        proc.send_signal(sig)
        break
    out, _ = proc.communicate(timeout=120)
  finally:
    proc.kill()
  output = ''.join(lines) + out
  assert proc.returncode == 0, output
  match = re.search(rf'Received {sig.name}: finished step (\d+), saved step \1 to ', output)
  assert match, output
  stopped = int(match.group(1))
  assert ckpt_lib.Checkpoints(tmp_path / 'checkpoints', read_only=True).steps() == [stopped]
  code, out = finish(tmp_path, *SMALL, f'--config.train.steps={stopped + 2}')
  assert code == 0, out
  assert f'Resuming from step {stopped} ' in out and f'step {stopped + 2}/{stopped + 2} (100%) | loss' in out


@pytest.mark.slow  # An 8M-parameter model, so that the save lasts long enough to be killed in.
def test_sigkill_during_an_asynchronous_save_keeps_the_previous_checkpoint(tmp_path):
  proc = start(tmp_path, *BIG, '--config.train.steps=40', '--config.checkpoint.every_steps=1',
               '--config.checkpoint.keep=2')
  checkpoints = tmp_path / 'checkpoints'
  killed_during = None
  deadline = time.monotonic() + 240
  try:
    while time.monotonic() < deadline and proc.poll() is None:
      names = [p.name for p in checkpoints.iterdir()] if checkpoints.exists() else []
      complete = [n for n in names if n.isdigit()]
      writing = [n for n in names if 'tmp' in n]
      if complete and writing:
        proc.send_signal(signal.SIGKILL)
        killed_during = writing[0]
        break
      time.sleep(0.005)
  finally:
    proc.kill()
    proc.communicate()
  assert killed_during is not None, 'never saw a save in flight'
  intact = ckpt_lib.Checkpoints(checkpoints, read_only=True).steps()
  assert intact and int(killed_during.split('.')[0]) not in intact  # The half-written step is never listed.
  code, out = finish(tmp_path, *BIG, f'--config.train.steps={max(intact) + 1}',
                     '--config.checkpoint.every_steps=1', '--config.checkpoint.keep=2')
  assert code == 0, out
  assert f'Resuming from step {max(intact)} ' in out
  assert not [p for p in checkpoints.iterdir() if 'tmp' in p.name]


def test_bad_restore_path_is_a_one_line_error(tmp_path):
  code, out = finish(tmp_path / 'run', *SMALL, '--restore_from', str(tmp_path / 'nowhere'))
  assert code == 2
  assert out.strip().splitlines()[-1] == f'error: {tmp_path / "nowhere"}: no such file or directory.'
  assert 'Traceback' not in out
