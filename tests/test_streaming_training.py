"""Streamed sources and mixtures in real runs of scripts/train.py: exact resume, on any process count."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, SCRIPT_DEFAULTS, TINY, script_env, script_flags
from test_multiprocess import run_launch, train_losses
from test_streaming import documents, write_jsonl, write_parquet

SMALL = script_flags(*TINY, 'train.log_every=1', 'optimizer.warmup_steps=2', 'data.block_bytes=1500',
                     'data.eval_fraction=0.2')
TIMEOUT = 300


def mixture(tmp_path: pathlib.Path) -> list[str]:
  """A JSONL + Parquet mixture, 2:1, as a user types it."""
  a = write_jsonl(tmp_path / 'jsonl', documents(150, tag='jsonl'))
  b = write_parquet(tmp_path / 'parquet', documents(150, seed=1, tag='parquet'))
  return ['--config.data.source=mixture',
          f"--config.data.mixture=[({{'source': 'jsonl', 'path': '{a}'}}, 2), "
          f"({{'source': 'parquet', 'path': '{b}'}}, 1)]"]


def train(workdir, *args, stop_after: int | None = None) -> subprocess.CompletedProcess | str:
  """scripts/train.py on dp4_tp2; `stop_after`: SIGTERM once step N is logged (it stops at a saved step)."""
  command = [sys.executable, 'scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir',
             str(workdir),
             *SMALL, *args]
  proc = subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  out = []
  try:
    for line in proc.stdout:
      out.append(line)
      if stop_after is not None and line.startswith(f'step {stop_after}/'):
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=TIMEOUT)
  finally:
    proc.kill()
  assert proc.returncode == 0, ''.join(out)
  return ''.join(out)


@pytest.mark.slow  # ~25 s: the default suite time; tests/test_streaming.py resumes mixtures in process.
def test_a_mixture_run_stopped_and_resumed_gives_the_losses_of_a_straight_run(tmp_path):
  data = mixture(tmp_path)
  args = [*data, '--config.train.steps=8', '--config.checkpoint.every_steps=100']
  train(tmp_path / 'straight', *args)
  out = train(tmp_path / 'resumed', *args, stop_after=3)
  stopped = [line for line in out.splitlines() if 'finished step' in line]
  assert stopped and 'saved step' in stopped[0], out
  out = train(tmp_path / 'resumed', *args)
  assert 'Restored' in out or 'resum' in out.lower(), out
  straight, resumed = train_losses(tmp_path / 'straight'), train_losses(tmp_path / 'resumed')
  assert len(straight) == 8 and resumed == straight  # Bit-identical, step by step.
  records = [json.loads(line) for line in (tmp_path / 'straight' / 'metrics.jsonl').read_text().splitlines()]
  fractions = [(r['data_fraction_0'], r['data_fraction_1']) for r in records if 'data_fraction_0' in r]
  assert len(fractions) == 8 and all(abs(a + b - 1) < 1e-9 for a, b in fractions)
  assert 0.5 < np.mean([a for a, _ in fractions]) < 0.85  # About 2/3 from the JSONL source.
  saved = sorted((tmp_path / 'resumed' / 'checkpoints').iterdir(), key=lambda p: int(p.name))[0]
  state = json.loads((saved / 'data' / 'metadata').read_text())
  assert state['source'] == 'mixture' and sorted(map(int, state['iterator']['rows'])) == list(range(8))


@pytest.mark.slow  # Three runs; tests/test_streaming.py resumes a Hugging Face stream's rows in process.
def test_a_hugging_face_stream_stopped_and_resumed_gives_the_losses_of_a_straight_run(tmp_path):
  corpus = write_jsonl(tmp_path / 'corpus', documents(300), files=12)  # load_dataset's 12 shards.
  args = ['--config.data.source=hf_datasets', '--config.data.hf_streaming=True',
          f'--config.data.path={corpus}', '--config.train.steps=8', '--config.checkpoint.every_steps=100',
          '--config.eval.steps=1', '--config.eval.every_steps=4']
  train(tmp_path / 'straight', *args)
  out = train(tmp_path / 'resumed', *args, stop_after=3)
  stopped = [line for line in out.splitlines() if 'finished step' in line]
  assert stopped and 'saved step' in stopped[0], out
  train(tmp_path / 'resumed', *args)
  straight, resumed = train_losses(tmp_path / 'straight'), train_losses(tmp_path / 'resumed')
  assert len(straight) == 8 and resumed == straight  # Bit-identical, step by step.
  evals = [[r['eval_loss'] for line in (tmp_path / run / 'metrics.jsonl').read_text().splitlines()
            if 'eval_loss' in (r := json.loads(line))] for run in ('straight', 'resumed')]
  assert evals[0] and evals[1][-len(evals[0]):] == evals[0]  # The held-out shards, read the same way.


@pytest.mark.slow
def test_a_shard_added_before_a_resume_is_said_and_the_run_continues_its_batches(tmp_path):
  corpus = write_jsonl(tmp_path / 'corpus', documents(300))
  args = ['--config.data.source=jsonl', f'--config.data.path={corpus}', '--config.train.steps=8',
          '--config.checkpoint.every_steps=100']
  train(tmp_path / 'straight', *args)
  train(tmp_path / 'resumed', *args, stop_after=3)
  new = ''.join(json.dumps({'text': d}) + '\n' for d in documents(100, seed=7, tag='new'))
  (tmp_path / 'corpus' / 'part3.jsonl').write_text(new)
  out = train(tmp_path / 'resumed', *args)
  assert 'data: jsonl' in out and 'changed since the checkpoint: 1 file(s) added (part3.jsonl)' in out, out
  assert 'Traceback' not in out
  assert train_losses(tmp_path / 'resumed') == train_losses(tmp_path / 'straight')  # Exact where it can be.


@pytest.mark.slow  # Two multi-process jobs and a one-process one: about a minute on 2 cores.
def test_a_checkpoint_of_two_processes_continues_the_same_batches_in_one(tmp_path):
  corpus = write_jsonl(tmp_path / 'corpus', documents(300))
  data = ['--config.data.source=jsonl', f'--config.data.path={corpus}', '--config.checkpoint.every_steps=3']
  launch_args = [a for a in SMALL if a not in SCRIPT_DEFAULTS]
  code, out = run_launch(2, tmp_path / 'two', *launch_args, *data, '--config.train.steps=6')
  assert code == 0, out
  state = json.loads((tmp_path / 'two' / 'checkpoints' / '3' / 'data' / 'metadata').read_text())
  assert sorted(map(int, state['iterator']['rows'])) == list(range(8))  # Both processes' rows.
  train(tmp_path / 'one', *data, '--config.train.steps=6', '--restore_from',
        str(tmp_path / 'two' / 'checkpoints' / '3'))
  np.testing.assert_allclose(train_losses(tmp_path / 'one'), train_losses(tmp_path / 'two')[3:], rtol=1e-5)
