"""What a run reports: writers that agree, progress and MFU, compile time, profile, memory plan."""

import json
import logging
import time
import tomllib

import helpers
import jax
import numpy as np
import pytest
from google.protobuf import json_format
from helpers import REPO, build, load_config, mesh_devices, quiet, run_script
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from mintrain import errors, metric_writers, metrics, report
from mintrain import loop as train_loop
from mintrain.data import tokenizer

SMALL = (*helpers.SMALL, 'checkpoint.keep=0')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('run')
  config = load_config('dp4_tp2', *SMALL, 'train.steps=8', 'train.log_every=2', 'eval.every_steps=4',
                       'eval.steps=1', 'profile.start_step=5', 'profile.num_steps=2')
  lines = []
  result = train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=lines.append)
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return workdir, result, records, lines


def read_tensorboard(directory):
  """{tag: {step: value}} of the scalar summaries, all tags, and the hyperparameters, read as TensorBoard
  reads them."""
  acc = event_accumulator.EventAccumulator(str(directory), size_guidance={'scalars': 0})
  acc.Reload()
  scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()['scalars']}
  hparams_tags = acc.PluginTagToContent('hparams')
  start = plugin_data_pb2.HParamsPluginData.FromString(hparams_tags['_hparams_/session_start_info'])
  hparams = {k: json_format.MessageToDict(v) for k, v in start.session_start_info.hparams.items()}
  return scalars, [*scalars, *hparams_tags], hparams


def test_metrics_jsonl_and_tensorboard_hold_the_same_values(run):
  workdir, _, records, _ = run
  scalars, tags, hparams = read_tensorboard(workdir / 'tensorboard')
  assert any(tag.startswith('_hparams_') for tag in tags)  # write_hparams ran once.
  compared = 0
  assert {record['attempt'] for record in records} == {1}  # The workdir's first run.
  for record in records:
    for key, value in record.items():
      if key not in ('step', 'attempt'):
        np.testing.assert_allclose(scalars[key][record['step']], value, rtol=1e-6, err_msg=key)
        compared += 1
  assert compared > 20
  saved = json.loads((workdir / 'hparams.json').read_text())
  assert saved['model.embed_dim'] == 64
  assert hparams == saved


def test_the_writer_is_a_context_manager_and_a_second_close_does_nothing(tmp_path):
  lines = []
  with metric_writers.make_writer(tmp_path, is_main=True, total_steps=4, print_fn=lines.append) as writer:
    writer.write_hparams({'model.embed_dim': 64})
    writer.write_scalars(4, {'loss': 2.5})
  writer.close()
  scalars, _, hparams = read_tensorboard(tmp_path / 'tensorboard')
  assert scalars == {'loss': {4: 2.5}} and hparams == {'model.embed_dim': 64}
  assert lines == ['step 4/4 (100%) | loss 2.5000']


def test_every_logged_step_has_throughput_mfu_and_a_positive_eta(run):
  _, _, records, lines = run
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == [2, 4, 6, 8]
  for r in train:
    for key in ('grad_norm', 'learning_rate', 'step_time', 'tokens_per_sec', 'tokens_per_sec_per_device',
                'tflops_per_device', 'mfu'):
      assert r[key] > 0, key
    assert r['eta_sec'] >= 0
  assert train[0]['eta_sec'] > 0 and train[-1]['eta_sec'] == 0
  np.testing.assert_allclose(train[0]['tokens_per_sec_per_device'] * 8, train[0]['tokens_per_sec'])
  assert any(line.startswith('step 2/8 (25%) | loss') and '| ETA 0:' in line for line in lines)


def test_compile_time_is_reported_apart_and_the_summary_closes_the_run(run):
  _, result, _, lines = run
  assert any(line.startswith('compiled the train step in') for line in lines)
  summary = [line for line in lines if line.startswith('summary: ')]
  assert len(summary) == 1
  for part in ('compile', 'mean step', 'tok/s', 'MFU', 'final loss', 'final eval loss'):
    assert part in summary[0]
  assert result.summary['compile_time_sec'] > 0 and result.summary['mfu'] > 0
  assert any(line.startswith('model: ') and 'GFLOP per step' in line and 'peak' in line for line in lines)


def test_the_reported_step_time_includes_the_device_time_of_the_steps():
  """Steps are dispatched ahead of the device; the interval must wait for them before it is timed."""
  # The mesh-invariance test's `single` run (tests/test_train_step.py), whose programs are then cached.
  config = load_config('single', 'train.steps=5', 'train.log_every=5', 'train.global_batch_size=8')
  reported = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet).summary['step_time']
  setup = build(config)
  with jax.set_mesh(setup.mesh):
    state, batches = setup.init(), setup.batches(tokenizer.BYTES)
    batch = next(batches)
    step = setup.train_step.lower(state, batch).compile()
    state, _ = jax.block_until_ready(step(state, batch))
    times = []
    for _ in range(3):
      start = time.perf_counter()
      state, _ = jax.block_until_ready(step(state, next(batches)))
      times.append(time.perf_counter() - start)
  assert reported > 0.5 * min(times), (reported, times)


def test_profiler_writes_a_trace_of_the_requested_steps(run):
  workdir, _, _, lines = run
  traces = list((workdir / 'profile').rglob('*.xplane.pb'))
  assert traces and traces[0].stat().st_size > 0
  assert any(line.startswith('profile: steps 5..6 written to') for line in lines)


def bytes_on(device, tree) -> int:
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def test_memory_plan_matches_the_bytes_of_the_real_sharded_arrays():
  for name in ('fsdp4_tp2', 'dp8'):
    config = load_config(name, *SMALL, 'train.grad_accum_steps=2')
    setup = build(config)
    mesh, plan = setup.mesh, setup.plan
    with jax.set_mesh(mesh):
      state = setup.init()
    device = mesh.devices.flat[0]
    assert plan.params == bytes_on(device, state.params), name
    assert plan.opt_state == bytes_on(device, state.opt_state), name
    assert plan.grads == 2 * plan.params  # Gradients plus the accumulation buffer.
    assert plan.activations > 0


def test_a_run_without_a_workdir_writes_no_profile_and_says_so_once(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config = load_config('single', *SMALL, 'train.steps=3', 'profile.start_step=2', 'profile.num_steps=1')
  lines = []
  train_loop.run(config, None, devices=mesh_devices(config), print_fn=lines.append)
  assert not list(tmp_path.iterdir())
  assert len([line for line in lines if 'profile' in line]) == 1


def test_a_plan_over_the_device_memory_is_refused_before_anything_is_allocated(monkeypatch):
  monkeypatch.setattr(report, 'device_memory_limit', lambda device: (1024, 'a test limit'))
  monkeypatch.setattr(train_loop, 'initial_state', lambda *a, **k: pytest.fail('the state was set up'))
  config = load_config('single', *SMALL, 'train.steps=1')
  lines = []
  with pytest.raises(errors.MemoryPlanError) as error:
    train_loop.run(config, None, devices=mesh_devices(config), print_fn=lines.append)
  assert 'but a device holds 1.0 KiB (a test limit)' in str(error.value) and '\n' not in str(error.value)
  assert not any(line.startswith('compiled') for line in lines)


def test_the_cpu_limit_is_the_host_memory_shared_by_the_cpu_devices(monkeypatch):
  # The host's available memory moves while other tests run beside this one: the split is checked on a
  # fixed reading, the reading itself against /proc/meminfo's total.
  total = next(int(line.split()[1]) * 1024 for line in open('/proc/meminfo') if line.startswith('MemTotal:'))
  assert 0 < report.host_available_bytes() <= total
  monkeypatch.setattr(report, 'host_available_bytes', lambda: 12 * 2**30 + 7)
  limit, source = report.device_memory_limit(jax.devices()[0])
  assert limit == (12 * 2**30 + 7) // 8
  assert source == 'host memory available (12.0 GiB) / 8 CPU devices'


def test_importing_the_train_loop_imports_neither_tensorflow_nor_torch_and_leaves_orbax_grain_for_first_use():
  """Orbax, Grain and the tokenizer libraries are a third of the import time, and a run without a workdir
  or a file source never needs them. torch is installed here (the test extra's reference for
  tests/test_hf.py); tensorboardX would load it. One process for both: each start costs seconds."""
  code = ("import mintrain.loop, sys; print(sorted(m for m in sys.modules if m.startswith(("
          "'orbax.checkpoint.', 'grain.', 'tokenizers', 'sentencepiece', 'pyarrow', 'array_record')))); "
          "assert not {'tensorflow', 'torch'} & set(sys.modules); "
          'import torch')  # And torch still imports afterwards.
  result = run_script('-c', code)
  assert result.returncode == 0, f'`python -X importtime` shows which module imports it.\n{result.stderr}'
  assert result.stdout.strip() == '[]', result.stdout


def test_no_dependency_names_tensorflow():
  project = tomllib.loads((REPO / 'pyproject.toml').read_text())['project']
  requirements = [*project['dependencies'], *sum(project['optional-dependencies'].values(), [])]
  assert requirements and not [r for r in requirements if 'tensorflow' in r.lower()]


def test_the_runs_console_takes_mintrain_log_records_only_while_the_run_lasts(capsys, caplog):
  lines = []
  with metrics.console_logging(lines.append):
    logging.getLogger('mintrain.data.splits').info('data: x ran out')
    logging.getLogger('mintrain.data.records').warning('warning: data.skip_bad_records: skipped y')
  logging.getLogger('mintrain.data.streaming').info('after the run')
  assert lines == ['data: x ran out'] and 'skipped y' in capsys.readouterr().err
  assert not caplog.records  # Not also through the root logger's handlers (absl's would print them again).
  assert not logging.getLogger('mintrain').handlers and logging.getLogger('mintrain').propagate
