"""A checkpoint written by mintrain before the package layout changed (commit ded0bca) resumes bit-exactly."""

import json
import pathlib
import shutil

import pytest
from helpers import SCRIPT_DEFAULTS, run_script

# tests/data/run_before_layout/checkpoints/4: written by ded0bca's scripts/train.py with these options and
# train.steps=4; the same code resumed it to step 6 with the losses below (under the XLA flags of
# `conftest.script_env`, as here: other flags round differently); the AMD EPYC VMs of later sessions gave
# them exactly. Other processors' XLA:CPU kernels round the same step differently by an ulp or two (an
# Intel Sapphire Rapids-class VM: step 5 5.934064865 for 5.934063911, step 6 equal), so the losses are
# compared to one part in a million;
# a checkpoint read wrongly (a weight, an Adam moment, the data position) moves them by orders more.
# Bit-exact resume on one machine is tested in tests/test_checkpoint.py.
SAVED = pathlib.Path(__file__).parent / 'data' / 'run_before_layout'
OPTIONS = ('model.num_layers=1', 'model.embed_dim=32', 'model.mlp_dim=64', 'model.num_heads=2',
           'model.head_dim=16', 'train.global_batch_size=8', 'train.seq_len=32', 'train.log_every=1',
           'checkpoint.every_steps=2')
LOSSES_FROM_DED0BCA = {5: 5.934063911437988, 6: 5.577324867248535}
ROUNDING = 1e-6  # Relative: float32's epsilon is 1.2e-7.


@pytest.mark.slow  # ~19 s: a resumed run of the script; the default suite's time.
def test_a_checkpoint_from_before_the_layout_change_resumes_with_the_same_losses(tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(SAVED, workdir)
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir', str(workdir),
                    *SCRIPT_DEFAULTS, *(f'--config.{o}' for o in OPTIONS), '--config.train.steps=6')
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  losses = {r['step']: r['loss'] for r in rows if 'loss' in r}
  assert losses == pytest.approx(LOSSES_FROM_DED0BCA, rel=ROUNDING)
