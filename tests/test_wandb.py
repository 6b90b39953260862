"""Weights & Biases: a run in W&B's offline mode writes the scalars, config, sharding report and memory plan
that a reader of its .wandb files gets back, and a resumed run continues the same W&B run."""

import json
import os
import signal
import struct

import pytest
from helpers import TINY, load_config, mesh_devices

from mintrain import errors, metric_writers
from mintrain import loop as train_loop

wandb = pytest.importorskip('wandb')  # The test extra installs it; without it only this file is skipped.
from wandb.proto import wandb_internal_pb2  # noqa: E402

BLOCK, HEADER = 32768, 7  # W&B's transaction log: LevelDB's log format after a 7-byte file header.


def records(path):
  """The protobuf records of a .wandb file, read as LevelDB's log format (FULL, FIRST, MIDDLE, LAST)."""
  data = path.read_bytes()
  assert data[:4] == b':W&B', data[:7]
  offset, pending = HEADER, b''
  while offset + 7 <= len(data):
    if BLOCK - offset % BLOCK < 7:  # A block's tail too short for a record header is padding.
      offset += BLOCK - offset % BLOCK
      continue
    _, length, kind = struct.unpack('<IHB', data[offset:offset + 7])
    chunk = data[offset + 7:offset + 7 + length]
    offset += 7 + length
    if kind in (1, 2):
      pending = chunk
    else:
      pending += chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      yield record


def read_runs(workdir):
  """[(run id, {step: scalars}, config)] of every W&B run file under the workdir, oldest first."""
  runs = []
  for run_file in sorted((workdir / 'wandb').glob('offline-run-*/run-*.wandb')):
    run_id, history, config = None, {}, {}
    for record in records(run_file):
      kind = record.WhichOneof('record_type')
      if kind == 'run':
        run_id = record.run.run_id
        config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
      elif kind == 'history':
        items = {item.key or '/'.join(item.nested_key): json.loads(item.value_json)
                 for item in record.history.item}
        history.setdefault(items.pop('_step'), {}).update(items)
      elif kind == 'config':
        config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    runs.append((run_id, history, config))
  return runs


WANDB = ('metrics.wandb_project=mintrain-test', 'metrics.wandb_mode=offline', 'metrics.wandb_tags=a,b',
         'train.log_every=1', 'train.steps=4', 'checkpoint.every_steps=2')


@pytest.mark.slow  # ~20 s: two runs of the script; the default suite's time.
def test_an_offline_run_writes_scalars_config_and_report_and_a_resume_continues_the_same_run(tmp_path):
  os.environ.pop('WANDB_MODE', None)
  config = load_config('single', *TINY, *WANDB)
  workdir = tmp_path / 'run'

  def stop_after_step_2(line):
    if line.startswith('step 1/'):
      signal.raise_signal(signal.SIGTERM)  # The loop finishes step 2, saves and stops.

  first = train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=stop_after_step_2)
  assert first.stopped_by == 'SIGTERM'
  train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=lambda _: None)

  (first_id, first_history, first_config), (second_id, second_history, _) = read_runs(workdir)
  assert first_id == second_id == (workdir / metric_writers.WANDB_RUN_ID).read_text().strip()
  trained = [sorted(step for step, items in history.items() if 'loss' in items)
             for history in (first_history, second_history)]
  assert trained == [[1, 2], [3, 4]]
  jsonl = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  for record in jsonl:  # Every scalar of metrics.jsonl (as TensorBoard gets them), in its attempt's run.
    step, attempt = record.pop('step'), record.pop('attempt')
    logged = (first_history, second_history)[attempt - 1].get(step, {})
    scalars = record
    for key, value in scalars.items():
      assert logged.get(key) == pytest.approx(value, rel=1e-6), (step, key)
  assert first_config['model.embed_dim'] == 32 and first_config['metrics.wandb_project'] == 'mintrain-test'
  assert 'model' in first_config['sharding_report'] or 'embedding' in first_config['sharding_report']
  assert first_config['memory_plan_bytes_per_device']['params'] > 0


def test_without_wandb_installed_a_project_is_a_one_line_config_error(monkeypatch):
  config = load_config('single', *TINY, 'metrics.wandb_project=p')
  real = metric_writers.importlib.util.find_spec
  monkeypatch.setattr(metric_writers.importlib.util, 'find_spec',
                      lambda name: None if name == 'wandb' else real(name))
  with pytest.raises(errors.ConfigError, match=r"pip install -e '\.\[wandb\]'"):
    metric_writers.check_wandb(config.metrics)
