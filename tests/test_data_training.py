"""Real data in the training loop: iterator state in checkpoints, evaluation, bad input end to end."""

import json
import math
import subprocess
import sys

import helpers
import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, build, load_config, mesh_devices, quiet, script_env

from mintrain import actions
from mintrain import loop as train_loop
from mintrain.checkpoint.checkpoints import Checkpoints
from mintrain.data import pipeline, segments, statistics, tokenizer
from mintrain.data.batches import batch_sharding, make_batches
from mintrain.errors import ConfigError
from mintrain.mesh import make_mesh
from mintrain.partitioning import AxisRules

BYTES = segments.Separators.of(tokenizer.BYTES)  # The byte tokenizer's: BOS starts a document.

TINY = (*helpers.TINY, 'train.log_every=1')


def tiny_corpus(tmp_path):
  root = tmp_path / 'corpus'
  root.mkdir()
  for i in range(40):
    (root / f'doc{i:02d}.txt').write_text(f'document {i}: ' + 'the quick brown fox jumps. ' * (i % 3))
  return str(root / '*.txt')


def tiny_jsonl(tmp_path):
  lines = [json.dumps({'text': f'document {i}: ' + 'the quick brown fox jumps. ' * (3 + i % 5)})
           for i in range(40)]
  (tmp_path / 'corpus.jsonl').write_text('\n'.join(lines) + '\n')
  return str(tmp_path / 'corpus.jsonl')


def test_checkpointed_iterator_state_continues_the_exact_stream(tmp_path):
  config = load_config('dp8', *TINY, 'train.steps=3', 'checkpoint.every_steps=3')
  train_loop.run(config, tmp_path, devices=mesh_devices(config), print_fn=quiet)
  saved = json.loads((tmp_path / 'checkpoints' / '3' / 'data' / 'metadata').read_text())
  mesh = make_mesh(config.mesh.sizes)
  rules = AxisRules.from_config(config.partitioning)
  with jax.set_mesh(mesh):
    straight = make_batches(config, mesh, rules, tokenizer.BYTES)
    for _ in range(3):
      next(straight)
    resumed = make_batches(config, mesh, rules, tokenizer.BYTES)
    resumed.set_state(saved)
    for _ in range(2):
      a, b = next(straight), next(resumed)
      assert a.keys() == b.keys() == {'inputs', 'targets', 'segment_ids', 'positions', 'target_weights'}
      for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


@pytest.mark.parametrize('packing', ['pack', 'pad'])
def test_eval_metrics_match_a_hand_computation_on_a_tiny_corpus(tmp_path, packing):
  config = load_config('single', *TINY, 'data.source=text', f'data.path={tiny_corpus(tmp_path)}',
                       'data.eval_fraction=0.3', 'eval.steps=2', f'data.packing={packing}')
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  rules = AxisRules.from_config(config.partitioning)
  setup = build(config)
  with jax.set_mesh(mesh):
    state = setup.init()
    batches = make_batches(config, mesh, rules, tokenizer.BYTES, split='eval')
    metrics = actions.evaluate(setup, state.params, batches, batches.get_state(),
                                  statistics.bytes_per_token(config.data, tokenizer.BYTES))
    model = nnx.merge(setup.graphdef, state.params)
    forward = jax.jit(lambda inputs, segment_ids, positions: model(  # One program, not one a primitive.
        inputs, segment_ids_BL=segment_ids, positions_BL=positions))
    local = pipeline.make_iterator(config.data, tokenizer.BYTES, split='eval', seq_len=16,
                                   global_batch_size=8, micro_batch_size=8, rows=np.arange(8), seed=0,
                                   separators=BYTES)
    nats, weights, documents = [], [], []
    for _ in range(2):
      batch = next(local)
      logits = np.asarray(forward(batch['inputs'], batch['segment_ids'], batch['positions']), np.float64)
      log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
      picked = np.take_along_axis(logits, batch['targets'][..., None], -1)[..., 0]
      nats.append(log_z - picked)
      weights.append(batch['target_weights'])
      documents.append(batch['segment_ids'].max(axis=1))
  # Packed rows hold several documents; padded rows one, and the batches count different numbers of targets.
  assert (np.max(documents) > 1) == (packing == 'pack')
  if packing == 'pad':
    assert weights[0].sum() != weights[1].sum()
  loss = float(np.sum(np.multiply(nats, weights)) / np.sum(weights))
  np.testing.assert_allclose(metrics['eval_loss'], loss, rtol=1e-5)
  np.testing.assert_allclose(metrics['eval_perplexity'], math.exp(loss), rtol=1e-5)
  np.testing.assert_allclose(metrics['eval_bits_per_token'], loss / math.log(2), rtol=1e-5)
  np.testing.assert_allclose(metrics['eval_bits_per_byte'], loss / math.log(2), rtol=1e-5)  # 1 byte a token.


def test_training_logs_baseline_eval_and_data_wait(tmp_path):
  config = load_config('dp8', *TINY, 'train.steps=4', 'eval.every_steps=2', 'eval.steps=1',
                       'checkpoint.keep=0')
  train_loop.run(config, tmp_path, devices=mesh_devices(config), print_fn=quiet)
  records = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  baseline = [r for r in records if 'unigram_bits_per_byte' in r]
  assert len(baseline) == 1 and 3.0 < baseline[0]['unigram_bits_per_byte'] < 6.0
  assert baseline[0]['unigram_bits_per_token'] == baseline[0]['unigram_bits_per_byte']  # Bytes.
  assert [r['step'] for r in records if 'eval_loss' in r] == [2, 4]
  assert all(0.0 <= r['data_wait_fraction'] <= 1.0 for r in records if 'data_wait_fraction' in r)


def test_eval_steps_0_turns_evaluation_off():
  config = load_config('dp8', *TINY, 'train.steps=4', 'eval.every_steps=2', 'eval.steps=0')
  result = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet)
  assert len(result.losses) == 4 and [r for r in result.records if 'eval_loss' in r] == []
  assert not [key for key in result.summary if key.startswith('final_eval')]


def test_bad_data_path_is_a_one_line_error_from_the_script(tmp_path):
  env = script_env()
  proc = subprocess.run([sys.executable, 'scripts/train.py', '--config', 'mintrain/configs/single.py',
                         '--config.data.source=text', f'--config.data.path={tmp_path}/none/*.txt'],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and 'none/*.txt' in errors[0] and 'Traceback' not in proc.stderr, proc.stderr


@pytest.mark.slow  # ~13 s, two runs: the default suite's time.
def test_restored_checkpoint_with_another_source_does_not_reuse_its_stream(tmp_path):
  config = load_config('single', *TINY, 'train.steps=2', 'data.source=synthetic', 'model.vocab_size=384')
  train_loop.run(config, tmp_path / 'synthetic', devices=mesh_devices(config), print_fn=quiet)
  assert Checkpoints(tmp_path / 'synthetic' / 'checkpoints', read_only=True).steps() == [2]
  other = load_config('single', *TINY, 'train.steps=3')
  result = train_loop.run(other, tmp_path / 'stdlib', devices=mesh_devices(other), print_fn=quiet,
                          restore_from=str(tmp_path / 'synthetic'))
  assert result.first_step == 2 and len(result.losses) == 1


@pytest.mark.parametrize('source', ['synthetic', 'text', 'jsonl'])
def test_batches_sent_ahead_are_on_their_devices_and_not_counted_in_the_saved_position(tmp_path, source):
  data = {'synthetic': ('data.source=synthetic',),
          'text': ('data.source=text', f'data.path={tiny_corpus(tmp_path)}'),
          'jsonl': ('data.source=jsonl', f'data.path={tiny_jsonl(tmp_path)}', 'data.block_bytes=200')}[source]
  ahead_config = load_config('dp8', *TINY, *data, 'data.device_prefetch=2')
  plain_config = load_config('dp8', *TINY, *data, 'data.device_prefetch=0')
  mesh = make_mesh(ahead_config.mesh.sizes)
  rules = AxisRules.from_config(ahead_config.partitioning)
  with jax.set_mesh(mesh):
    ahead, plain = (make_batches(c, mesh, rules, tokenizer.BYTES) for c in (ahead_config, plain_config))
    for _ in range(3):
      a, b = next(ahead), next(plain)
      np.testing.assert_array_equal(np.asarray(a['inputs']), np.asarray(b['inputs']))
    assert len(ahead.ready) == 2 and not plain.ready
    for _, batch in ahead.ready:
      assert batch['inputs'].sharding == batch_sharding(mesh, rules, 3)
    assert ahead.get_state() == plain.get_state()
    resumed = make_batches(ahead_config, mesh, rules, tokenizer.BYTES)
    resumed.set_state(ahead.get_state())
    np.testing.assert_array_equal(np.asarray(next(resumed)['inputs']), np.asarray(next(plain)['inputs']))


def test_negative_device_prefetch_names_the_key():
  # Checked with every other option when the config is read, before any device is touched.
  with pytest.raises(ConfigError, match=r'data.device_prefetch=-1 must be an integer >= 0'):
    load_config('dp8', *TINY, 'data.source=synthetic', 'data.device_prefetch=-1')
