"""Optimizers and schedules: each trains, shards its state like the parameters, restores onto another mesh
and continues with the same losses; the schedules' shapes; Muon's choice of matrices."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import TINY, build, load_config, mesh_devices, quiet

from mintrain import loop as train_loop
from mintrain import optimizer as opt_lib

N = 4


def config_for(mesh, name, *overrides):
  return load_config(mesh, *TINY, f'optimizer.name={name}', 'optimizer.warmup_steps=2',
                     f'train.steps={2 * N}', f'checkpoint.every_steps={N}', 'train.log_every=1', *overrides)


LEARNING_RATES = {'adamw': 3e-3, 'lion': 3e-4, 'adafactor': 1e-2, 'muon': 3e-3, 'sgd': 0.3}


def restore_and_continue(tmp_path, name, source_mesh, target_mesh, *overrides, target_overrides=()):
  """(source's losses, losses of its checkpoint at step N continued on target_mesh)."""
  overrides = (f'optimizer.learning_rate={LEARNING_RATES[name]}', *overrides)
  source = config_for(source_mesh, name, *overrides)
  first = train_loop.run(source, tmp_path / 'a', devices=mesh_devices(source), print_fn=quiet)
  target = config_for(target_mesh, name, *overrides, *target_overrides)
  continued = train_loop.run(target, tmp_path / 'b', devices=mesh_devices(target), print_fn=quiet,
                             restore_from=str(tmp_path / 'a' / 'checkpoints' / str(N)))
  for saved, wanted in zip(jax.tree.leaves(continued.state.opt_state),
                           jax.tree.leaves(build(target).abstract_state.opt_state)):
    assert saved.sharding.is_equivalent_to(wanted.sharding, saved.ndim)
  return first.losses, continued.losses


@pytest.mark.parametrize('name', [pytest.param('muon', marks=pytest.mark.slow),
                                  pytest.param('adafactor', marks=pytest.mark.slow)])
def test_an_optimizer_trains_and_continues_on_another_mesh_with_the_same_losses(tmp_path, name):
  losses, continued = restore_and_continue(tmp_path, name, 'dp4_tp2', 'fsdp8')
  assert losses[-1] < losses[0] - 0.1, losses
  np.testing.assert_allclose(continued, losses[N:], rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['lion', 'sgd', 'adamw'])
@pytest.mark.parametrize('meshes', [('dp4_tp2', 'fsdp8'), ('fsdp4_tp2', 'single')], ids='-'.join)
def test_every_optimizer_trains_and_continues_on_another_mesh(tmp_path, name, meshes):
  losses, continued = restore_and_continue(tmp_path, name, *meshes)
  assert losses[-1] < losses[0] - 0.1, losses
  np.testing.assert_allclose(continued, losses[N:], rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['muon', 'adafactor'])
def test_muon_and_adafactor_on_a_scanned_moe_model(tmp_path, name):
  losses, continued = restore_and_continue(tmp_path, name, 'moe_ep4_dp2', 'moe_ep4_dp2',
                                           'model.scan_layers=True',
                                           target_overrides=('mesh.data=1', 'mesh.expert=1'))
  np.testing.assert_allclose(continued, losses[N:], rtol=1e-4)


def test_bfloat16_first_moments_halve_their_memory_in_the_plan():
  plans = {dtype: build(config_for('dp4_tp2', 'adamw', f'optimizer.mu_dtype={dtype}')).plan
           for dtype in ('', 'bfloat16')}
  params = plans[''].params
  assert plans[''].opt_state == pytest.approx(2 * params, rel=0.01)  # mu and nu in float32.
  assert plans['bfloat16'].opt_state == pytest.approx(1.5 * params, rel=0.01)


def settings(**kwargs):
  base = load_config('single').optimizer
  return dataclasses.replace(base, learning_rate=1.0, warmup_steps=10, end_lr_fraction=0.1, **kwargs)


def test_cosine_is_optax_warmup_cosine_and_the_other_schedules_end_where_they_should():
  cosine = opt_lib.schedule(settings(schedule='cosine'), 110)
  reference = optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, 110, 0.1)
  for step in (0, 5, 10, 50, 110):
    assert float(cosine(step)) == float(reference(step))
  for name in ('linear', 'constant', 'wsd'):
    lr = opt_lib.schedule(settings(schedule=name), 110)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5) and float(lr(10)) == pytest.approx(1.0)
  assert float(opt_lib.schedule(settings(schedule='linear'), 110)(60)) == pytest.approx(0.55)
  assert float(opt_lib.schedule(settings(schedule='constant'), 110)(110)) == 1.0


SQRT_HALFWAY = 1 - 0.9 * 0.5 ** 0.5  # 0.1 + 0.9 * (1 - sqrt(1/2)).


@pytest.mark.parametrize('shape,halfway', [('linear', 0.55), ('cosine', 0.55), ('sqrt', SQRT_HALFWAY)])
def test_wsd_holds_the_peak_then_decays_over_its_last_fraction(shape, halfway):
  lr = opt_lib.schedule(settings(schedule='wsd', decay_fraction=0.2, decay_shape=shape), 110)
  assert [float(lr(s)) for s in (10, 50, 90)] == [1.0, 1.0, 1.0]  # Decay starts at 90 = 110 - 0.2 * 100.
  assert float(lr(100)) == pytest.approx(halfway, abs=1e-6)
  assert float(lr(110)) == pytest.approx(0.1)


def test_muon_takes_the_hidden_matrices_with_their_input_and_output_axes():
  setup = build(load_config('moe_ep4_dp2', 'model.scan_layers=True'))
  dims = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(setup.abstract_state.params,
                                                         is_leaf=lambda x: hasattr(x, 'get_metadata'))[0]:
    found = opt_lib.muon_dims(leaf)
    dims[jax.tree_util.keystr(path)] = None if found is None else (found.reduction_axis, found.output_axis)
  by_name = {key.split("'")[-2]: value for key, value in dims.items()}
  assert by_name['embedding_VD'] is None and by_name['scale'] is None
  assert by_name['wq_DHK'] == ((1,), (2, 3))  # (layers, embed, heads, kv): the layer axis is a batch axis.
  assert by_name['wo_HKD'] == ((1, 2), (3,))
  assert by_name['wi_gate_EDF'] == ((2,), (3,))  # (layers, expert, embed, mlp).
  assert by_name['wo_EFD'] == ((2,), (3,))


@pytest.mark.parametrize('scale', [0.25, 4.0])
def test_clipping_gives_optaxs_gradients_and_state(scale):
  grads = {'w': np.linspace(-3.0, 5.0, 12, dtype=np.float32).reshape(3, 4), 'b': np.float32([3.0, -4.0])}
  max_norm = scale * float(optax.tree.norm(grads))
  ours, theirs = opt_lib.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
  # The same (empty) state: checkpoints written with either restore with the other.
  assert jax.tree.structure(ours.init(grads)) == jax.tree.structure(theirs.init(grads))
  got, want = ours.update(grads, ours.init(grads))[0], theirs.update(grads, theirs.init(grads))[0]
  for name in grads:
    if scale > 1:  # Under the bound: the gradients themselves, bit for bit.
      np.testing.assert_array_equal(got[name], grads[name])
    np.testing.assert_allclose(got[name], want[name], rtol=2e-7)
  assert float(optax.tree.norm(got)) == pytest.approx(min(max_norm, float(optax.tree.norm(grads))), rel=1e-6)
