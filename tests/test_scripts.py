"""The command-line entry points, run as real subprocesses."""

import json
import re
import sys

import pytest
from helpers import run_script


def test_train_runs_end_to_end_and_writes_metrics(tmp_path):
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir', str(tmp_path),
                    '--config.train.steps=6', '--config.train.log_every=3')
  assert proc.returncode == 0, proc.stderr
  assert 'simulating 8 CPU devices' in proc.stdout
  assert 'PartitionSpec' in proc.stdout  # The sharding report comes first.
  records = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == [3, 6]
  for key in ('loss', 'grad_norm', 'learning_rate', 'steps_per_sec', 'tokens_per_sec'):
    assert key in train[-1] and train[-1][key] > 0
  assert [r['step'] for r in records if 'eval_loss' in r] == [6]


def test_unknown_config_key_is_a_one_line_error_with_close_matches():
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--config.train.step=3')
  assert proc.returncode != 0
  assert "Unknown config key 'train.step'" in proc.stderr and 'steps' in proc.stderr
  assert 'Traceback' not in proc.stderr


def test_mesh_that_does_not_fit_the_devices_is_a_clear_error():
  # The user fixed the device count; the scripts simulate only when the count is left to them.
  proc = run_script('scripts/show_sharding.py', '--config', 'mintrain/configs/dp4_tp2.py',
                    '--config.mesh.data=2',
                    '--config.mesh.fsdp=2', '--config.mesh.model=4',
                    env_extra={'XLA_FLAGS': '--xla_force_host_platform_device_count=8'})
  assert proc.returncode == 2
  assert 'needs 16 devices but this run has 8 cpu device(s)' in proc.stderr
  assert 'XLA_FLAGS=--xla_force_host_platform_device_count) to 16 per process' in proc.stderr
  assert 'Traceback' not in proc.stderr


def test_any_mesh_shape_gets_the_simulated_devices_it_needs():
  proc = run_script('scripts/show_sharding.py', '--config', 'mintrain/configs/dp4_tp2.py',
                    '--config.mesh.data=2',
                    '--config.mesh.fsdp=2', '--config.mesh.model=4')
  assert proc.returncode == 0, proc.stderr
  assert 'simulating 16 CPU devices' in proc.stdout
  assert 'data=2 x fsdp=2 x model=4 (16 devices)' in proc.stdout


def test_show_sharding_prints_one_row_per_parameter_and_totals():
  proc = run_script('scripts/show_sharding.py', '--config', 'mintrain/configs/fsdp4_tp2.py')
  assert proc.returncode == 0, proc.stderr
  assert 'blocks.1.attn.wo_HKD' in proc.stdout and '(model, -, fsdp)' in proc.stdout
  assert 'per device: parameters' in proc.stdout and 'optimizer state' in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize('config,devices,parameters,expert_row', [
    ('deepseek_v3_671b_256', 256, '671,026,419,200',
     r'blocks\.3\.mlp\.wi_gate_EDF +\(256, 7168, 2048\) .*\(expert, fsdp, model\)\s+\(32, 224, 2048\)'),
    ('deepseek_v3_671b_256', 512, '671,026,419,200',
     r'blocks\.3\.mlp\.wi_gate_EDF +\(256, 7168, 2048\) .*\(expert, fsdp, model\)\s+\(32, 112, 2048\)'),
    ('qwen3_235b_256', 256, '235,093,634,560',
     r'blocks\.mlp\.wi_gate_EDF +\(94, 128, 4096, 1536\) .*\(-, expert, fsdp, model\)\s+'
     r'\(94, 16, 128, 1536\)'),
])
def test_show_sharding_plans_deepseek_v3_and_qwen3_moe_sized_models_on_256_and_512_devices(
    config, devices, parameters, expert_row):
  fsdp = devices // 8  # expert 8 within each of 4 slices, fsdp the rest.
  proc = run_script('scripts/launch_local.py', '--num_processes', '4', '--devices', str(devices), '--',
                    sys.executable, 'scripts/show_sharding.py', '--config', f'mintrain/configs/{config}.py',
                    f'--config.mesh.fsdp={fsdp}', f'--config.train.global_batch_size={devices}', timeout=900)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  mesh = f'mesh data=1 x fsdp={fsdp} x expert=8 x model=1 ({devices} devices), {parameters} parameters'
  assert mesh in proc.stdout
  assert re.search(expert_row, proc.stdout)


@pytest.mark.slow  # Four processes of 64 simulated devices each; about 15 s.
def test_show_sharding_plans_a_mixtral_8x7b_sized_model_on_256_devices_in_4_slices_without_allocating():
  proc = run_script('scripts/launch_local.py', '--num_processes', '4', '--devices', '256', '--',
                    sys.executable, 'scripts/show_sharding.py',
                    '--config', 'mintrain/configs/mixtral_8x7b_256.py')
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert 'mesh data=4 x fsdp=8 x expert=8 x model=1 (256 devices), 46,702,792,704 parameters' in proc.stdout
  assert ('across 4 processes (DCN): data=4 x fsdp=1 x model=1; within each (ICI): data=1 x fsdp=8 x '
          'expert=8 x model=1') in proc.stdout
  # Each expert's (D, F) weights on one `expert` device, its D split 8 ways over `fsdp`.
  expert_row = r'blocks\.mlp\.wi_gate_EDF .*\(-, expert, fsdp, model\)\s+\(32, 1, 512, 14336\)'
  assert re.search(expert_row, proc.stdout)
  assert 'per device: parameters 3.4 GiB, optimizer state 6.7 GiB' in proc.stdout
  assert not re.search(r'^\[[123]\] ', proc.stdout, re.M)  # Process 0 prints the plan.
