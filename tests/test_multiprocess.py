"""Several processes on one machine form one mesh through jax.distributed (gloo on CPU).

Every subprocess has a timeout, so a hung collective fails its test instead of the CI run.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import helpers
import jax
import numpy as np
import pytest
from helpers import (
  REPO,
  build,
  free_port,
  load_config,
  mesh_devices,
  quiet,
  script_env,
  script_flags,
)

from mintrain import loop as train_loop
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.mesh import make_mesh

SMALL = (*helpers.SMALL, 'train.log_every=1')
TIMEOUT = 240


def launch(num_processes, workdir, *args):
  """Starts scripts/launch_local.py running scripts/train.py on mintrain/configs/dp4_tp2.py."""
  env = script_env()
  command = [sys.executable, 'scripts/launch_local.py', '--num_processes', str(num_processes), '--',
             sys.executable, 'scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py',
             '--workdir', str(workdir), *script_flags(*SMALL), *args]
  return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def run_launch(num_processes, workdir, *args):
  proc = launch(num_processes, workdir, *args)
  try:
    out, _ = proc.communicate(timeout=TIMEOUT)
  finally:
    proc.kill()
  return proc.returncode, out


def train_losses(workdir):
  lines = (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()
  return [r['loss'] for r in map(json.loads, lines) if 'loss' in r]


def overrides(args):
  return [a[len('--config.'):] for a in args]


@pytest.mark.slow  # the default suite's time (7 min); 18 s
def test_two_processes_train_with_the_losses_of_one(tmp_path):
  code, out = run_launch(2, tmp_path / 'two', '--config.train.steps=4', '--config.checkpoint.keep=0')
  assert code == 0, out
  assert '[0] 2 processes with 4 cpu device(s) each, 8 in all.' in out
  assert not re.search(r'^\[1\] step \d', out, re.M)  # Only process 0 reports.
  config = load_config('dp4_tp2', *SMALL, 'train.steps=4', 'checkpoint.keep=0')
  one = train_loop.run(config, tmp_path / 'one', devices=mesh_devices(config), print_fn=quiet)
  np.testing.assert_allclose(train_losses(tmp_path / 'two'), one.losses, rtol=1e-5)


@pytest.mark.slow  # Two multi-process jobs: about a minute on 2 cores.
def test_two_processes_standing_in_for_slices_train_with_the_losses_of_one(tmp_path):
  """Multi-slice: fsdp goes 2 ways across the processes (DCN) and 2 within each, beside model 2 within;
  the report shows both levels."""
  slices = ['--config.mesh.data=1', '--config.mesh.fsdp=4', '--config.mesh.model=2',
            '--config.mesh.dcn_fsdp=2', '--config.train.steps=4', '--config.checkpoint.keep=0']
  code, out = run_launch(2, tmp_path / 'two', *slices)
  assert code == 0, out
  assert ('[0] across 2 processes (DCN): data=1 x fsdp=2 x model=1; within each (ICI): data=1 x '
          'fsdp=2 x model=2') in out
  config = load_config('dp4_tp2', *SMALL, *overrides(slices), 'mesh.dcn_fsdp=1')
  one = train_loop.run(config, tmp_path / 'one', devices=mesh_devices(config), print_fn=quiet)
  np.testing.assert_allclose(train_losses(tmp_path / 'two'), one.losses, rtol=1e-5)


# `batch` split over fsdp, then data: with 2 processes on data=2 x fsdp=2 x model=2, process 0 (data 0)
# holds rows 0-3 and 8-11 of 16, not one block, so only the mesh can say which rows it must read.
INTERLEAVED = ['--config.mesh.data=2', '--config.mesh.fsdp=2', '--config.mesh.model=2',
               "--config.partitioning.rules=[('batch', ('fsdp', 'data')), ('length', None), ('embed', None), "
               "('mlp', 'model'), ('heads', 'model'), ('kv', None), ('vocab', 'model'), ('classes', None), "
               "('layers', None)]"]


@pytest.mark.slow  # a multi-process job (~16 s): the default suite keeps one.
def test_each_process_reads_the_rows_its_devices_hold_whatever_the_batch_rule(tmp_path):
  code, out = run_launch(2, tmp_path / 'two', *INTERLEAVED, '--config.train.steps=3',
                         '--config.checkpoint.keep=0', '--config.train.grad_accum_steps=2')
  assert code == 0, out
  config = load_config('dp4_tp2', *SMALL, *overrides(INTERLEAVED), 'train.steps=3', 'checkpoint.keep=0',
                       'train.grad_accum_steps=2')
  one = train_loop.run(config, tmp_path / 'one', devices=mesh_devices(config), print_fn=quiet)
  np.testing.assert_allclose(train_losses(tmp_path / 'two'), one.losses, rtol=1e-5)


@pytest.mark.slow  # Three multi-process jobs (2, 1 and 4 processes): about a minute on 2 cores.
def test_checkpoint_of_two_processes_restores_in_one_and_in_four(tmp_path):
  code, out = run_launch(2, tmp_path / 'two', '--config.train.steps=3', '--config.checkpoint.every_steps=3')
  assert code == 0, out
  step_dir = tmp_path / 'two' / 'checkpoints' / '3'
  assert ckpt_lib.Checkpoints(step_dir.parent, read_only=True).metadata(3)['process_count'] == 2

  # One process, 8 devices: the parameters arrive equal to the saved ones, read on a single device.
  def restored(name, *extra):
    config = load_config(name, *SMALL, 'train.steps=5', *extra)
    mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
    setup = build(config)
    with jax.set_mesh(mesh):
      state, _ = train_loop.initial_state(setup, None, restore_from=str(step_dir), params_only=False,
                                          print_fn=quiet)
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]
  for a, b in zip(restored('dp4_tp2'), restored('single')):
    np.testing.assert_array_equal(a, b)

  config = load_config('dp4_tp2', *SMALL, 'train.steps=5', 'checkpoint.keep=0')
  one = train_loop.run(config, tmp_path / 'one', devices=mesh_devices(config), print_fn=quiet,
                       restore_from=str(step_dir))
  code, out = run_launch(4, tmp_path / 'four', '--config.train.steps=5', '--config.checkpoint.keep=0',
                         '--restore_from', str(step_dir))
  assert code == 0, out
  assert 'Restored state of step 3' in out
  # The first loss after the restore is computed from the restored parameters alone.
  np.testing.assert_allclose(train_losses(tmp_path / 'four'), one.losses, rtol=1e-5)


def _child_pids(parent: int) -> dict[int, int]:
  """{JAX process id: OS pid} of the launcher's children."""
  out = {}
  for proc in pathlib.Path('/proc').iterdir():
    try:
      status = (proc / 'status').read_text()
      if f'\nPPid:\t{parent}\n' not in status:
        continue
      env = dict(item.split('=', 1) for item in (proc / 'environ').read_text().split('\0') if '=' in item)
      out[int(env['JAX_PROCESS_ID'])] = int(proc.name)
    except (OSError, KeyError, ValueError):
      continue
  return out


@pytest.mark.slow  # A job killed mid-run, then a second job: about a minute on 2 cores.
def test_a_killed_process_stops_the_job_and_the_next_start_resumes(tmp_path):
  workdir = tmp_path / 'run'
  proc = launch(2, workdir, '--config.train.steps=100000', '--config.checkpoint.every_steps=2',
                '--config.eval.every_steps=0')
  deadline = time.monotonic() + TIMEOUT
  try:
    while time.monotonic() < deadline and proc.poll() is None:
      saved = workdir / 'checkpoints'
      if saved.exists() and any(p.name.isdigit() for p in saved.iterdir()):
        os.kill(_child_pids(proc.pid)[1], signal.SIGKILL)
        break
      time.sleep(0.2)
    out, _ = proc.communicate(timeout=TIMEOUT)
  finally:
    proc.kill()
  assert proc.returncode not in (0, None), out
  assert '[launcher] process 1 exited with code -9; stopping the others' in out
  steps = ckpt_lib.Checkpoints(workdir / 'checkpoints', read_only=True).steps()
  assert steps
  code, out = run_launch(2, workdir, f'--config.train.steps={steps[-1] + 1}')
  assert code == 0, out
  assert f'Resuming from step {steps[-1]} ' in out


# Each process closes its output first, then dies: process 1 (whose output ends first) by SIGKILL, process
# 0 by SIGABRT after it, as a survivor's collective aborts on a dead peer. The launcher sees both outputs
# end before either exit.
DYING = '''import os, signal, sys, time
first = os.environ['JAX_PROCESS_ID'] == '1'
time.sleep(0 if first else 0.3)
os.close(1), os.close(2)
time.sleep(0.6 if first else 0.9)
os.kill(os.getpid(), signal.SIGKILL if first else signal.SIGABRT)
'''


def test_the_launcher_names_the_process_that_died_first_when_every_output_ends_before_an_exit():
  proc = subprocess.run([sys.executable, 'scripts/launch_local.py', '--num_processes', '2', '--',
                         sys.executable, '-c', DYING], cwd=REPO, env=script_env(), capture_output=True,
                        text=True, timeout=TIMEOUT)
  assert '[launcher] process 1 exited with code -9; stopping the others' in proc.stderr, proc.stderr
  assert proc.returncode == 128 + signal.SIGKILL


@pytest.mark.slow  # ~14 s waiting out the join timeout: the default suite's time.
def test_a_process_that_never_joins_is_named_within_the_join_timeout(tmp_path):
  """Process 0 of 2 alone, and process 1 of 2 alone: each gives up after --init_timeout with one line."""
  def alone(process_id):
    address = f'127.0.0.1:{free_port()}'
    env = dict(script_env(), JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES='2',
               JAX_PROCESS_ID=str(process_id), JAX_PLATFORMS='cpu')
    command = [sys.executable, 'scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py',
               '--init_timeout', '6',
               '--workdir', str(tmp_path / str(process_id)), *script_flags(*SMALL)]
    return address, subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
  started = time.monotonic()
  runs = [alone(0), alone(1)]
  outputs = [proc.communicate(timeout=TIMEOUT) for _, proc in runs]
  assert time.monotonic() - started < 6 + 90
  for (address, proc), (out, err) in zip(runs, outputs):
    assert proc.returncode == 2 and 'Traceback' not in out + err, out + err
    errors = [line for line in err.splitlines() if line.startswith('error:')]
    assert len(errors) == 1, err
    assert f'within 6 s at {address}. Check that every process' in errors[0]
  assert 'error: process(es) 1 of 2 did not join' in outputs[0][1]
  assert f'Waiting up to 6 s for 2 processes to join at {runs[0][0]}' in outputs[0][0]
  assert f'error: process 1 found nothing listening at {runs[1][0]}: is process 0 running?' in outputs[1][1]
  assert 'Waiting' not in outputs[1][0]  # Only process 0 speaks.
  assert not (tmp_path / '0').exists()  # Nothing was written.


TO_HOST = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from mintrain.actions import to_host
from mintrain.runtime import distributed
distributed.initialize(distributed.settings(), say=lambda _: None)
mesh = jax.make_mesh((jax.device_count(),), ('data',))
values = np.arange(16, dtype=np.float32)
split = jax.make_array_from_callback((16,), NamedSharding(mesh, P('data')), lambda index: values[index])
copies = jax.make_array_from_callback((16,), NamedSharding(mesh, P()), lambda index: values[index])
print('host values', to_host(split).tolist() == to_host(copies).tolist() == values.tolist())
"""


def test_to_host_gathers_an_array_split_over_processes_and_reads_a_replicated_one_locally():
  command = [sys.executable, 'scripts/launch_local.py', '--num_processes', '2', '--',
             sys.executable, '-c', TO_HOST]
  result = subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
  assert result.returncode == 0, result.stdout[-3000:]
  assert result.stdout.count('host values True') == 2, result.stdout[-3000:]
