"""The command-line entry points, run as real subprocesses."""

import contextlib
import json
import os
import pathlib
import pty
import re
import subprocess
import sys

import pytest
from helpers import REPO, TINY, fresh_compilation_cache, run_script, script_env, script_flags


def test_train_runs_end_to_end_and_writes_metrics(tmp_path):
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir', str(tmp_path),
                    '--config.train.steps=6', '--config.train.log_every=3')
  assert proc.returncode == 0, proc.stderr
  assert 'simulating 8 CPU devices' in proc.stdout
  assert 'mesh data=4 x fsdp=1 x model=2 (8 devices)' in proc.stdout  # The sharding summary comes first.
  assert 'PartitionSpec' not in proc.stdout  # The per-parameter table is in the workdir.
  assert 'blocks.0.attn.wq_DHK' in (tmp_path / 'sharding.txt').read_text()
  startup = proc.stdout.split('compiled the train step')[0].splitlines()
  assert len(startup) <= 16, startup
  records = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == [3, 6]
  for key in ('loss', 'grad_norm', 'learning_rate', 'steps_per_sec', 'tokens_per_sec'):
    assert key in train[-1] and train[-1][key] > 0
  assert [r['step'] for r in records if 'eval_loss' in r] == [6]


@pytest.mark.slow  # ~16 s: a run under a pseudo-terminal; the default suite's time.
def test_on_a_terminal_progress_is_one_live_line_with_a_bar_and_other_lines_end_it(tmp_path):
  master, slave = pty.openpty()
  args = ['scripts/train.py', '--config', 'single',
          *script_flags(*TINY, 'train.steps=4', 'train.log_every=2')]
  proc = subprocess.Popen([sys.executable, *args], stdout=slave, stderr=subprocess.PIPE, cwd=REPO,
                          env=script_env())
  os.close(slave)
  out = b''
  with contextlib.suppress(OSError):  # EIO once the process has closed its end.
    while chunk := os.read(master, 65536):
      out += chunk
  assert proc.wait(timeout=300) == 0, proc.stderr.read()
  text = out.decode()
  assert '\r\x1b[K[##########..........] step 2/4 (50%) | loss' in text
  assert '\r\x1b[K[####################] step 4/4 (100%) | loss' in text
  assert re.search(r'\(100%\) \| loss [^\n]*\r\nsummary: ', text)  # The summary starts a line of its own.


def test_show_config_prints_every_key_with_its_value_and_meaning_and_trains_nothing(tmp_path):
  proc = run_script('scripts/train.py', '--config', 'dp4_tp2', '--workdir', str(tmp_path / 'run'),
                    '--config.optimizer.name=muon', '--show_config')
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert "optimizer.name = 'muon'  # 'adamw'; 'lion'" in proc.stdout
  assert "mesh.model = 2  # Tensor-parallel ways" in proc.stdout
  keys = [line.split(' = ')[0] for line in lines]
  assert len(keys) == len(set(keys)) > 100 and all('  # ' in line for line in lines), [
      line for line in lines if '  # ' not in line]
  assert not (tmp_path / 'run').exists()


FAST_HELP = ['train', 'show_sharding', 'inspect_checkpoint', 'evaluate', 'plot_metrics', 'launch_local',
             'sample', 'export_hf', 'tokenize_corpus']


@pytest.mark.parametrize('script', FAST_HELP)
def test_help_answers_before_jax_is_imported(script):
  probe = ('import runpy, sys\n'
           f'sys.argv = ["scripts/{script}.py", "--help"]\n'
           'try:\n'
           f'  runpy.run_path("scripts/{script}.py", run_name="__main__")\n'
           'except SystemExit as e:\n'
           '  assert e.code == 0, e.code\n'
           'print("jax imported:", "jax" in sys.modules)\n')
  proc = subprocess.run([sys.executable, '-c', probe], cwd=REPO, env=script_env(), capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert 'usage:' in proc.stdout and proc.stdout.rstrip().endswith('jax imported: False')


@pytest.mark.slow  # ~17 s: an install into a fresh environment; the default suite's time.
def test_the_installed_commands_run_outside_a_checkout(tmp_path):
  """pyproject's console scripts: a shipped config by name, from a directory that is no checkout."""
  bin_dir = pathlib.Path(sys.executable).parent
  commands = ['mintrain-train', 'mintrain-export', 'mintrain-sample', 'mintrain-eval', 'mintrain-tokenize',
              'mintrain-show-sharding', 'mintrain-inspect', 'mintrain-plot', 'mintrain-launch']
  for command in commands:
    proc = subprocess.run([bin_dir / command, '--help'], capture_output=True, text=True, cwd=tmp_path,
                          env=script_env(), timeout=60)
    assert proc.returncode == 0 and 'usage:' in proc.stdout, (command, proc.stderr)
  proc = subprocess.run([bin_dir / 'mintrain-train', '--config', 'single', '--workdir', 'run',
                         *script_flags(*TINY, 'train.steps=2')], capture_output=True, text=True, cwd=tmp_path,
                        env=script_env(), timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert (tmp_path / 'run' / 'metrics.jsonl').exists() and 'done: steps 0..2' in proc.stdout


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


@pytest.mark.slow  # ~17 s: the default suite's time; the per-parameter report test stays there.
def test_show_sharding_prints_the_notes_a_training_run_would():
  proc = run_script('scripts/show_sharding.py', '--config', 'mintrain/configs/pp2_dp2_tp2.py',
                    '--config.model.num_kv_heads=1')
  assert proc.returncode == 0, proc.stderr
  assert 'note: model.num_kv_heads=1 key/value heads do not split 2 ways' in proc.stdout
  proc = run_script('scripts/show_sharding.py', '--config', 'mintrain/configs/pp2_dp2_tp2.py')
  assert proc.returncode == 0, proc.stderr
  assert 'pipeline: 2 stages' in proc.stdout and 'note:' not in proc.stdout


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
     r'blocks\.mlp\.wi_gate_EDF +\(94, 128, 4096, 1536\) .*\(stage, expert, fsdp, model\)\s+'
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
  expert_row = r'blocks\.mlp\.wi_gate_EDF .*\(stage, expert, fsdp, model\)\s+\(32, 1, 512, 14336\)'
  assert re.search(expert_row, proc.stdout)
  assert 'per device: parameters 3.4 GiB, optimizer state 6.7 GiB' in proc.stdout
  assert not re.search(r'^\[[123]\] ', proc.stdout, re.M)  # Process 0 prints the plan.


@pytest.mark.slow  # three runs of train.py (~25 s); tests/test_data.py checks the splits in process.
def test_a_one_file_corpus_trains_without_eval_and_evaluates_on_an_eval_path(tmp_path):
  (tmp_path / 'train.txt').write_text('the quick brown fox jumps over the lazy dog. ' * 200)
  (tmp_path / 'held.txt').write_text('a held out sentence about a lazy dog. ' * 50)
  run = ['scripts/train.py', '--config', 'single', *script_flags(*TINY, 'train.steps=2', 'data.source=text',
                                                                   f'data.path={tmp_path / "train.txt"}')]
  refused = run_script(*run, '--workdir', str(tmp_path / 'a'), '--config.eval.steps=1')
  assert refused.returncode == 2 and refused.stderr.count('\n') == 1, refused.stderr
  assert 'holds one file: no eval split can be held out of it; give a held-out corpus as data.eval_path' \
      in refused.stderr and not list((tmp_path / 'a').iterdir())  # Nothing written.
  assert run_script(*run, '--workdir', str(tmp_path / 'b')).returncode == 0  # eval.steps=0: no eval split.
  held = run_script(*run, '--workdir', str(tmp_path / 'c'), '--config.eval.steps=1',
                    f'--config.data.eval_path={tmp_path / "held.txt"}')
  assert held.returncode == 0, held.stderr
  records = [json.loads(line) for line in (tmp_path / 'c' / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in records if 'eval_loss' in r] == [2]


@pytest.mark.slow  # ~15 s; tests/test_streaming.py reads saved datasets in process.
def test_training_reads_a_hugging_face_dataset_saved_to_disk(tmp_path):
  import datasets
  texts = [f'document {i}: ' + 'the lazy dog sleeps in the sun. ' * (5 + i % 7) for i in range(200)]
  saved = datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': texts})})
  saved.save_to_disk(str(tmp_path / 'ds'))
  proc = run_script('scripts/train.py', '--config', 'single', '--workdir', str(tmp_path / 'run'),
                    *script_flags(*TINY, 'train.steps=3', 'train.log_every=1', 'data.source=hf_datasets',
                                  f'data.path={tmp_path / "ds"}', 'data.block_bytes=2000'))
  assert proc.returncode == 0, proc.stderr
  records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in records if 'loss' in r] == [1, 2, 3]


@pytest.mark.slow  # Three runs of the script: the default suite's time; test_hardware checks the directory.
def test_a_rerun_loads_its_compiled_programs_from_the_machines_cache(tmp_path):
  cache = tmp_path / 'cache'
  env = fresh_compilation_cache(cache)

  def train(name: str, *flags: str) -> tuple[str, list]:
    proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir',
                      str(tmp_path / name), *script_flags(*TINY, 'train.steps=2', 'train.log_every=1'),
                      *flags, env_extra=env)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / name / 'metrics.jsonl').read_text().splitlines()]
    return proc.stderr, [r['loss'] for r in records if 'loss' in r]

  _, off = train('off', '--config.train.compilation_cache=False')
  assert not (cache / 'xla').exists()
  first, losses = train('first')
  [machine] = (cache / 'xla').iterdir()
  assert [p for p in machine.iterdir() if p.name.startswith('jit_step_fn')]
  assert "cache hit for 'jit_step_fn'" not in first
  again, losses_again = train('again')
  assert "cache hit for 'jit_step_fn'" in again
  assert losses == losses_again == off
