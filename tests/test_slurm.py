"""mintrain under a real SLURM: `srun` starts the processes and JAX finds its peers in SLURM's variables.

Needs a cluster, such as the one-node cluster `.ci/slurm_up` brings up (8 CPUs declared, partition with
OverSubscribe=YES); CI runs `pytest -m cluster` after it. srun hands the tasks this process's environment
(`--export=ALL`), so the scripts get the tests' XLA flags and shared compilation cache. Every subprocess
has a timeout and every job a time limit, and a job a failed test leaves behind is cancelled, so a hung
collective fails its test instead of hanging the suite or holding the node.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from helpers import REPO, SCRIPT_DEFAULTS, script_env

from mintrain.checkpoint import checkpoints as ckpt_lib

pytestmark = pytest.mark.cluster

TIMEOUT = 300  # Seconds for one job, start-up and compilation included, on a busy 2-core machine.
TRAIN = [sys.executable, 'scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py']
# Every step's loss in metrics.jsonl, and one evaluation, at the end.
FAST = ['--config.train.log_every=1', *SCRIPT_DEFAULTS, '--config.eval.every_steps=0',
        '--config.eval.steps=1']
# A constant learning rate: with warmup and cosine decay, the rate of a step depends on train.steps, so a
# run stopped early and resumed with fewer steps could not match a straight run of those steps.
CONSTANT_LR = ['--config.optimizer.warmup_steps=0', '--config.optimizer.end_lr_fraction=1.0']


def _cluster_problem() -> str | None:
  """Why the tests cannot run here, or None."""
  if not (shutil.which('srun') and shutil.which('sinfo') and shutil.which('scancel')):
    return 'no SLURM client (srun, sinfo, scancel): run .ci/slurm_up (as root) to bring up a one-node cluster'
  try:
    out = subprocess.run(['sinfo', '--noheader', '--format=%t'], capture_output=True, text=True, timeout=30)
  except subprocess.TimeoutExpired:
    return 'sinfo did not answer within 30 s: run .ci/slurm_up to (re)start the cluster'
  states = {s.rstrip('*~#!%$@^-') for s in out.stdout.split()}
  if out.returncode or not states & {'idle', 'mix', 'alloc'}:
    said = out.stdout.strip() or out.stderr.strip()
    return f'the SLURM cluster does not answer or has no node up (sinfo: {said}): run .ci/slurm_up'
  return None


@pytest.fixture(scope='module', autouse=True)
def _cluster():
  problem = _cluster_problem()
  if problem:
    pytest.skip(problem)


class Job:
  """One `srun` of scripts/train.py in its own SLURM job, output labelled with each task's rank."""

  def __init__(self, tasks: int, workdir: pathlib.Path, *args: str):
    self.name = f'mintrain-test-{uuid.uuid4().hex[:12]}'
    command = ['srun', f'--ntasks={tasks}', '--nodes=1', '--oversubscribe', '--export=ALL', '--label',
               f'--job-name={self.name}', '--time=10', '--kill-on-bad-exit=1',
               *TRAIN, '--workdir', str(workdir), *FAST, *args]
    self.proc = subprocess.Popen(command, cwd=REPO, env=dict(script_env(), PYTHONUNBUFFERED='1'),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  def job_id(self, timeout: float = 60) -> str:
    """The id SLURM gave the job, once the job exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      out = subprocess.run(['squeue', '--noheader', f'--name={self.name}', '--format=%i'],
                           capture_output=True, text=True, timeout=30).stdout.split()
      if out:
        return out[0]
      time.sleep(0.2)
    raise AssertionError(f'job {self.name} never appeared in squeue')

  def communicate(self, timeout: float = TIMEOUT) -> str:
    return self.proc.communicate(timeout=timeout)[0]

  def cancel(self) -> str:
    """Kills the job's tasks and ends the job (killing srun alone would leave them running); returns
    all the output."""
    if self.proc.poll() is None:
      for extra in (['--signal=KILL'], []):
        subprocess.run(['scancel', f'--name={self.name}', *extra], capture_output=True, timeout=30)
      self.proc.kill()
    return self.proc.communicate(timeout=60)[0]


@contextlib.contextmanager
def job(tasks: int, workdir: pathlib.Path, *args: str) -> Iterator[Job]:
  j = Job(tasks, workdir, *args)
  try:
    yield j
  finally:
    j.cancel()


def srun(tasks: int, workdir: pathlib.Path, *args: str) -> tuple[int, str]:
  """(srun's exit status, the tasks' labelled output) of a job run to the end."""
  with job(tasks, workdir, *args) as j:
    out = j.communicate()
  return j.proc.returncode, out


def losses(workdir: pathlib.Path) -> dict[int, float]:
  """{step: training loss} from metrics.jsonl, whose last line may be half-written while the run goes
  on; a resumed run appends to it."""
  path = workdir / 'metrics.jsonl'
  lines = path.read_text().split('\n')[:-1] if path.exists() else []
  return {r['step']: r['loss'] for r in map(json.loads, lines) if 'loss' in r}


def test_srun_with_1_2_and_4_tasks_trains_with_the_same_losses(tmp_path):
  args = ['--config.train.steps=6', '--config.checkpoint.every_steps=3']
  jobs = {n: Job(n, tmp_path / f'n{n}', *args) for n in (1, 2, 4)}  # At once: 7 of the node's 8 CPUs.
  try:
    outputs = {n: j.communicate() for n, j in jobs.items()}
  finally:
    for j in jobs.values():
      j.cancel()
  for n, j in jobs.items():
    assert j.proc.returncode == 0, f'srun -n {n}:\n{outputs[n]}'
    saved = ckpt_lib.Checkpoints(tmp_path / f'n{n}' / 'checkpoints', read_only=True)
    assert saved.metadata(6)['process_count'] == n, f'srun -n {n} did not form one run of {n} processes'
  reference = losses(tmp_path / 'n1')
  assert sorted(reference) == list(range(1, 7))
  # Bit for bit: under srun every run, one process too, joins jax.distributed and reduces through gloo.
  for n in (2, 4):
    assert losses(tmp_path / f'n{n}') == reference, f'srun -n {n} against srun -n 1'


def test_srun_only_process_0_prints_the_final_line(tmp_path):
  # The smallest run: the lines at the end do not depend on the model.
  code, out = srun(2, tmp_path, '--config.train.steps=1', '--config.checkpoint.keep=0',
                   '--config.model.num_layers=1')
  assert code == 0, out
  done = re.findall(r'^(\d+): done: ', out, re.M)
  assert done == ['0'], f'"done:" printed by processes {done}:\n{out}'


def test_scancel_term_stops_every_process_at_one_saved_step_and_the_rerun_resumes_exactly(tmp_path):
  workdir = tmp_path / 'run'
  args = [*CONSTANT_LR, '--config.checkpoint.every_steps=100000']  # The only save is the one the stop makes.
  with job(2, workdir, '--config.train.steps=400', *args) as j:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and j.proc.poll() is None and max(losses(workdir), default=0) < 3:
      time.sleep(0.2)
    assert j.proc.poll() is None and max(losses(workdir), default=0) >= 3, j.cancel()
    # To the tasks of every step of the job; srun itself, and a batch shell if there were one, are spared.
    subprocess.run(['scancel', '--signal=TERM', j.job_id()], check=True, timeout=30)
    signalled = time.monotonic()
    try:
      out = j.communicate(timeout=90)
    except subprocess.TimeoutExpired:
      pytest.fail(f'the job still ran 90 s after SIGTERM; killed it:\n{j.cancel()}')
    took = time.monotonic() - signalled
  assert j.proc.returncode == 0, out
  assert took < 30, f'the processes took {took:.0f} s to exit after SIGTERM:\n{out}'
  saved = ckpt_lib.Checkpoints(workdir / 'checkpoints', read_only=True).steps()
  assert len(saved) == 1, f'checkpoints {saved}:\n{out}'
  stopped = saved[0]
  assert re.search(rf'^0: .*finished step {stopped}, saved step {stopped} to ', out, re.M), out

  code, out = srun(2, workdir, f'--config.train.steps={stopped + 4}', *args)
  assert code == 0, out
  assert f'0: Resuming from step {stopped} ' in out, out

  # One process straight through the same steps, also under srun: its collectives are gloo's, as in the
  # 2-process run (a run outside SLURM, without jax.distributed, rounds differently: relative 1e-7).
  code, out = srun(1, tmp_path / 'straight', f'--config.train.steps={stopped + 4}', *args)
  assert code == 0, out
  expected = losses(tmp_path / 'straight')
  assert sorted(expected) == list(range(1, stopped + 5))
  assert losses(workdir) == expected
