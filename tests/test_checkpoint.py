"""Checkpoints: exact resume, restore onto other meshes, faults and bad input."""

import dataclasses
import itertools
import json
import shutil
import signal
import threading

import helpers
import jax
import numpy as np
import pytest
from helpers import MESH_CONFIGS, build, load_config, mesh_devices, quiet

from mintrain import errors
from mintrain import loop as train_loop
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.errors import NonFiniteLossError
from mintrain.mesh import make_mesh

# A small model keeps the many compiles of this file cheap; N steps, then N more.
SMALL = (*helpers.SMALL, 'train.log_every=1', 'optimizer.warmup_steps=2', 'checkpoint.keep=5')
N = 4
TWO_BY_FOUR = ('mesh.data=2', 'mesh.fsdp=1', 'mesh.model=4')  # A mesh no config file names.
# Targets that are a config file on another mesh: (config, mesh overrides). The MoE model (8 experts) out
# of its expert 4 x data 2 split onto one device and onto expert 2 x model 2 x fsdp 2; a dense model into
# an expert split (its batch over `expert` too).
TARGETS = {
    '2x4': ('dp4_tp2', TWO_BY_FOUR),
    'moe_single': ('moe_ep4_dp2', ('mesh.data=1', 'mesh.expert=1')),
    'moe_ep2_tp2_fsdp2': ('moe_ep4_dp2', ('mesh.data=1', 'mesh.fsdp=2', 'mesh.expert=2', 'mesh.model=2')),
    'dense_ep4_dp2': ('dp4_tp2', ('mesh.data=2', 'mesh.expert=4', 'mesh.model=1')),
    # The grouped-matmul experts' checkpoint continued by the slot path (every expert L slots a sequence).
    'moe_slots_ep2_tp2': ('moe_ep4_dp2', ('mesh.data=2', 'mesh.expert=2', 'mesh.model=2',
                                          'model.grouped_matmul=off')),
}


# A name `lora_X` is config X with LoRA adapters (rank 4) on an NF4 base: only the adapters are saved.
LORA = ('lora.rank=4', 'lora.base_dtype=nf4', 'lora.nf4_block_size=16')


def small(name, *overrides):
  if name.startswith('lora_'):
    return load_config(name.removeprefix('lora_'), *SMALL, *LORA, *overrides)
  return load_config(name, *SMALL, *overrides)


def train(config, workdir=None, *, stop_at=None, **kwargs):
  """Runs in-process; `stop_at` raises SIGTERM during step `stop_at`, like a preemption.

  The signal is raised while step `stop_at - 1` is logged; the loop then finishes the step in
  flight (`stop_at`), saves and stops, as it does for a signal that arrives mid-step.
  """
  def print_fn(line):
    if stop_at is not None and line.startswith(f'step {stop_at - 1}/'):
      signal.raise_signal(signal.SIGTERM)
  return train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=print_fn, **kwargs)


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_bitwise_equal(a, b):
  a, b = host(a), host(b)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def restore_on(config, path, params_only=False):
  """The state `train.py --restore_from path` would start from, on the config's mesh."""
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  setup = build(config)
  with jax.set_mesh(mesh):
    state, _ = train_loop.initial_state(setup, None, restore_from=str(path),
                                        params_only=params_only, print_fn=quiet)
  return state, setup


class Source:
  """A run on `name` stopped by SIGTERM after N steps, then resumed to 2N in the same workdir."""

  def __init__(self, name, workdir, *overrides):
    self.config = small(name, f'train.steps={2 * N}', f'checkpoint.every_steps={N}', *overrides)
    self.workdir = workdir
    first = train(self.config, workdir, stop_at=N)
    assert first.stopped_by == 'SIGTERM' and int(first.state.step) == N
    self.state_at_n = jax.device_get(first.state)
    self.resumed = train(self.config, workdir)
    self.losses = first.losses + self.resumed.losses

  @property
  def checkpoint_n(self):
    return self.workdir / 'checkpoints' / str(N)


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
  cache = {}

  def get(name):
    if name not in cache:
      cache[name] = Source(name, tmp_path_factory.mktemp(name))
    return cache[name]
  return get


def test_resume_after_sigterm_is_bit_identical_to_a_straight_run(sources, tmp_path):
  source = sources('dp4_tp2')
  straight = train(source.config, tmp_path)
  assert source.resumed.first_step == N
  assert source.losses == straight.losses  # Exact float equality, step by step.
  assert_bitwise_equal(source.resumed.state, straight.state)


def test_checkpoint_holds_state_data_position_and_metadata(sources):
  source = sources('dp4_tp2')
  checkpoints = ckpt_lib.Checkpoints(source.workdir / 'checkpoints', read_only=True)
  assert checkpoints.steps() == [N, 2 * N]
  meta = checkpoints.metadata(N)
  assert meta['mesh'] == {'stage': 1, 'data': 4, 'fsdp': 1, 'expert': 1, 'context': 1, 'model': 2}
  assert meta['config']['model']['embed_dim'] == 64 and meta['config']['train']['steps'] == 2 * N
  assert set(meta['versions']) >= {'mintrain', 'jax', 'flax', 'optax', 'orbax-checkpoint'}
  data_file = checkpoints.step_dir(N) / 'data' / 'metadata'
  data_state = json.loads(data_file.read_text())
  assert data_state['source'] == 'stdlib' and data_state['iterator']  # Grain's iterator state.
  arrays = checkpoints.array_metadata(N)
  assert tuple(arrays['params.embedding_VD.value'].shape) == (384, 64)
  assert {'step', 'rng', 'opt_state.1.0.count'} <= set(arrays)


# Into fsdp, onto a mesh no config file names, onto and from a mesh with `context`; the slow set has every
# other pair.
REPRESENTATIVE = [('dp4_tp2', 'fsdp8'), ('dp4_tp2', 'cp2_dp2_tp2'), ('cp2_dp2_tp2', 'dp4_tp2')]
ALL_PAIRS = [pair for pair in itertools.permutations(MESH_CONFIGS + ('2x4',), 2)
             if pair[0] != '2x4' and pair not in REPRESENTATIVE]
ALL_PAIRS += [('moe_ep4_dp2', 'moe_ep2_tp2_fsdp2'), ('dp4_tp2', 'dense_ep4_dp2'),
              ('moe_ep4_dp2', 'moe_single'), ('moe_ep4_dp2', 'moe_slots_ep2_tp2')]
ALL_PAIRS += [('lora_dp4_tp2', f'lora_{name}') for name in MESH_CONFIGS if name != 'dp4_tp2']
ALL_PAIRS += [('lora_tp8', 'lora_single'), ('lora_fsdp4_tp2', 'lora_cp2_dp2_tp2')]


def _target(name, *overrides):
  if name.startswith('lora_'):
    return small(name, *overrides)
  if name in TARGETS:
    config, mesh = TARGETS[name]
    return small(config, *mesh, *overrides)
  return small(name, *overrides)


def check_restore_onto(sources, source_name, target_name):
  source = sources(source_name)
  target = _target(target_name, f'train.steps={2 * N}')
  state, setup = restore_on(target, source.checkpoint_n)
  assert_bitwise_equal(state.params, source.state_at_n.params)
  assert_bitwise_equal(state.opt_state, source.state_at_n.opt_state)
  assert int(state.step) == N
  for restored, wanted in zip(jax.tree.leaves(state), jax.tree.leaves(setup.abstract_state)):
    assert restored.sharding == wanted.sharding  # The target mesh's layout, not the saved one.
  continued = train(target, restore_from=str(source.checkpoint_n))
  np.testing.assert_allclose(continued.losses, source.resumed.losses, rtol=1e-4)


@pytest.mark.parametrize('source_name,target_name', REPRESENTATIVE)
def test_restore_onto_another_mesh_gives_saved_state_and_same_losses(sources, source_name, target_name):
  check_restore_onto(sources, source_name, target_name)


@pytest.mark.slow
@pytest.mark.parametrize('source_name,target_name', ALL_PAIRS)
def test_restore_between_every_pair_of_meshes(sources, source_name, target_name):
  check_restore_onto(sources, source_name, target_name)


def test_a_checkpoint_from_before_the_context_axis_restores_onto_a_context_mesh(sources, tmp_path):
  """Its metadata and config name three mesh axes and keep `length` whole (('length', None))."""
  source = sources('dp4_tp2')
  old = tmp_path / 'checkpoints' / str(N)
  shutil.copytree(source.checkpoint_n, old)
  meta_file = old / 'metadata' / 'metadata'
  meta = json.loads(meta_file.read_text())
  for sizes in (meta['mesh'], meta['config']['mesh']):
    del sizes['context']
  partitioning = meta['config']['partitioning']
  partitioning['rules'] = [[name, None if name == 'length' else axes] for name, axes in partitioning['rules']]
  meta_file.write_text(json.dumps(meta))
  state, _ = restore_on(_target('cp2_dp2_tp2', f'train.steps={2 * N}'), old)
  assert_bitwise_equal(state.params, source.state_at_n.params)
  assert_bitwise_equal(state.opt_state, source.state_at_n.opt_state)


def test_params_only_restore_starts_fresh_optimizer_and_step(sources):
  source = sources('dp4_tp2')
  config = small('fsdp8', f'train.steps={2 * N}')
  state, setup = restore_on(config, source.checkpoint_n, params_only=True)
  assert_bitwise_equal(state.params, source.state_at_n.params)
  assert int(state.step) == 0
  with jax.set_mesh(setup.abstract_state.step.sharding.mesh):
    fresh = setup.init()
  assert_bitwise_equal(state.opt_state, fresh.opt_state)


@pytest.mark.slow  # the default suite's time (7 min)
def test_keep_deletes_older_checkpoints_and_zero_disables_saving(tmp_path):
  train(small('single', 'train.steps=8', 'checkpoint.every_steps=2', 'checkpoint.keep=2'), tmp_path / 'a')
  assert ckpt_lib.Checkpoints(tmp_path / 'a' / 'checkpoints').steps() == [6, 8]
  train(small('single', 'train.steps=2', 'checkpoint.keep=0'), tmp_path / 'b')
  assert not (tmp_path / 'b' / 'checkpoints').exists()


def test_a_relative_workdir_saves_and_resumes(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  train(small('single', 'train.steps=2', 'checkpoint.every_steps=2'), 'run')
  result = train(small('single', 'train.steps=3'), 'run')
  assert result.first_step == 2 and (tmp_path / 'run' / 'checkpoints' / '3').is_dir()


def test_leftover_temporary_directories_are_removed_and_never_read(tmp_path):
  train(small('single', 'train.steps=2', 'checkpoint.every_steps=2'), tmp_path)
  leftover = tmp_path / 'checkpoints' / '3.orbax-checkpoint-tmp-1234567890'
  (leftover / 'state').mkdir(parents=True)
  result = train(small('single', 'train.steps=3', 'checkpoint.every_steps=2'), tmp_path)
  assert result.first_step == 2
  assert not leftover.exists()


def test_checkpoints_closed_before_any_save_leave_no_thread_behind(tmp_path):
  """Orbax's clean-up thread used to outlive a run that failed before its first save, and raise at exit."""
  (tmp_path / '3.orbax-checkpoint-tmp-1234567890').mkdir()
  before = set(threading.enumerate())
  ckpt_lib.Checkpoints(tmp_path).close()
  assert not list(tmp_path.iterdir())  # Removed before the constructor returned.
  assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []


def _damage(step_dir, how):
  files = sorted((step_dir / 'state').rglob('ocdbt.process_0/d/*'), key=lambda p: p.stat().st_size)
  biggest = files[-1]
  if how == 'truncate':
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
  else:
    biggest.unlink()


@pytest.mark.parametrize('how', ['truncate', 'delete'])
def test_damaged_checkpoint_is_an_error_naming_step_and_array(tmp_path, how):
  config = small('dp8', 'train.steps=4', 'checkpoint.every_steps=2', 'checkpoint.fallback_to_previous=False')
  train(config, tmp_path)
  _damage(tmp_path / 'checkpoints' / '4', how)
  with pytest.raises(errors.CheckpointError) as e:
    train(small('dp8', 'train.steps=6', 'checkpoint.every_steps=2', 'checkpoint.fallback_to_previous=False'),
          tmp_path)
  message = str(e.value)
  assert 'step 4' in message and 'is damaged' in message
  assert 'params.' in message or 'opt_state.' in message  # Names at least one array.
  assert 'fallback_to_previous=True to restore step 2' in message


def test_damaged_checkpoint_falls_back_to_the_previous_one_with_a_warning(tmp_path):
  train(small('dp8', 'train.steps=4', 'checkpoint.every_steps=2'), tmp_path)
  _damage(tmp_path / 'checkpoints' / '4', 'truncate')
  lines = []
  result = train_loop.run(small('dp8', 'train.steps=6', 'checkpoint.every_steps=2'), tmp_path,
                          print_fn=lines.append)
  assert result.first_step == 2
  warnings = [line for line in lines if line.startswith('warning: Checkpoint step 4')]
  assert len(warnings) == 1 and 'Falling back to step 2' in warnings[0]


@pytest.mark.slow  # the default suite's time (7 min); the fallback itself stays in it
def test_a_damaged_step_fallen_back_from_is_moved_aside_and_saved_anew_keeping_the_intact_one(tmp_path):
  steps = ('checkpoint.every_steps=2', 'checkpoint.keep=2')
  train(small('dp8', 'train.steps=4', *steps), tmp_path)
  directory = tmp_path / 'checkpoints'
  _damage(directory / '4', 'truncate')
  lines = []
  result = train_loop.run(small('dp8', 'train.steps=6', *steps), tmp_path, devices=mesh_devices(small('dp8')),
                          print_fn=lines.append)
  assert result.first_step == 2
  assert sorted(p.name for p in directory.iterdir()) == ['4', '4.damaged', '6']
  assert any(line.startswith('Moved the damaged checkpoint step 4 aside') for line in lines)
  _damage(directory / '6', 'delete')  # The new step 4 is the intact one a second fallback finds.
  lines = []
  result = train_loop.run(small('dp8', 'train.steps=6', *steps), tmp_path, devices=mesh_devices(small('dp8')),
                          print_fn=lines.append)
  assert result.first_step == 4
  assert sorted(p.name for p in directory.iterdir()) == ['4', '4.damaged', '6', '6.damaged']


def test_a_restore_error_that_is_not_damage_is_raised_naming_the_step_without_falling_back(tmp_path,
                                                                                           monkeypatch):
  train(small('dp8', 'train.steps=4', 'checkpoint.every_steps=2'), tmp_path)
  restore = ckpt_lib.ocp.CheckpointManager.restore

  def out_of_memory(self, step, args=None):
    if 'state' in args:
      raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.')
    return restore(self, step, args=args)

  monkeypatch.setattr(ckpt_lib.ocp.CheckpointManager, 'restore', out_of_memory)
  lines = []
  with pytest.raises(RuntimeError, match='RESOURCE_EXHAUSTED') as e:
    train_loop.run(small('dp8', 'train.steps=6', 'checkpoint.every_steps=2'), tmp_path, print_fn=lines.append)
  assert not isinstance(e.value, errors.CheckpointError)
  notes = e.value.__notes__
  assert any('checkpoint step 4' in note and 'no older checkpoint was tried' in note for note in notes)
  assert not [line for line in lines if 'Falling back' in line]


def test_shape_mismatch_lists_the_mismatched_parameters(tmp_path):
  train(small('dp8', 'train.steps=2'), tmp_path)
  config = small('dp8', 'train.steps=4', 'model.embed_dim=32')
  with pytest.raises(errors.CheckpointError) as e:
    restore_on(config, tmp_path)
  message = str(e.value)
  assert 'does not match the configured model' in message
  assert 'params.embedding_VD.value: saved (384, 64), expected (384, 32)' in message
  assert 'Traceback' not in message and '\n' not in message


def test_bad_restore_paths_give_one_line_errors(tmp_path):
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'other').mkdir()
  (tmp_path / 'other' / 'notes.txt').write_text('hello')
  cases = {tmp_path / 'missing': 'no such file or directory',
           tmp_path / 'empty': 'holds no complete checkpoint',
           tmp_path / 'other': 'is not a mintrain checkpoint'}
  for path, expected in cases.items():
    with pytest.raises(errors.CheckpointError, match=expected) as e:
      ckpt_lib.find_run_checkpoints(path)
    assert '\n' not in str(e.value)


def test_nan_stops_the_run_and_keeps_the_newest_good_checkpoint(tmp_path):
  train(small('dp8', 'train.steps=2', 'checkpoint.every_steps=2'), tmp_path)
  poisoned = small('dp8', 'train.steps=6', 'checkpoint.every_steps=1')
  poisoned = poisoned.replace(optimizer=dataclasses.replace(poisoned.optimizer, learning_rate=float('nan')))
  with pytest.raises(NonFiniteLossError, match='at step 3'):
    train(poisoned, tmp_path)
  checkpoints = ckpt_lib.Checkpoints(tmp_path / 'checkpoints', read_only=True)
  assert checkpoints.steps() == [2]
  state, _ = restore_on(small('dp8', 'train.steps=6'), tmp_path)
  assert all(np.isfinite(x).all() for x in host(state.params))


def test_a_restore_initialises_only_what_the_checkpoint_lacks(tmp_path):
  config = small('dp4_tp2', 'train.steps=2', 'checkpoint.every_steps=2')
  saved = train(config, tmp_path).state

  def fail():
    raise AssertionError('a full fresh state was initialised before restoring')

  run = dataclasses.replace(build(small('fsdp4_tp2', 'train.steps=2')), init=fail)
  with jax.set_mesh(run.mesh):
    state, data = train_loop.initial_state(run, None, restore_from=str(tmp_path), params_only=False,
                                           print_fn=quiet)
    assert int(state.step) == 2 and data['source'] == 'stdlib'
    assert_bitwise_equal(state, saved)
    fresh, data = train_loop.initial_state(run, None, restore_from=str(tmp_path), params_only=True,
                                           print_fn=quiet)
  assert int(fresh.step) == 0 and data == {}
  assert_bitwise_equal(fresh.params, saved.params)
  adam = fresh.opt_state[1][0]
  assert all(not np.asarray(x).any() for x in jax.tree.leaves((adam.mu, adam.nu)))  # A fresh optimizer.
  for x, wanted in zip(jax.tree.leaves(fresh), jax.tree.leaves(run.abstract_state)):
    assert x.sharding == wanted.sharding
