"""The sharded train step: types, mesh invariance, gradient accumulation, learning, NaN."""

import dataclasses
import re

import helpers
import jax
import numpy as np
import pytest
from flax import nnx
from helpers import MESH_CONFIGS, build, convert_layers, flat, load_config, mesh_devices, quiet, spec_entries

from mintrain import loop as train_loop
from mintrain import train_state
from mintrain.data import tokenizer
from mintrain.data.batches import make_batches
from mintrain.errors import NonFiniteLossError
from mintrain.mesh import make_mesh
from mintrain.models.layers import ParamKeys
from mintrain.objectives.lm import loss as loss_fn
from mintrain.optimizer import schedule
from mintrain.partitioning import AxisRules
from mintrain.train_step import make_train_step

INVARIANCE = ('train.steps=5', 'train.log_every=5', 'train.global_batch_size=8')


def run(name, *overrides):
  config = load_config(name, *overrides)
  return train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet)


def test_params_grads_and_optimizer_state_carry_the_resolved_specs_at_trace_time():
  config = load_config('fsdp4_tp2')
  mesh = make_mesh(config.mesh.sizes)
  rules = AxisRules.from_config(config.partitioning)
  setup = build(config)
  expected = {info.path: spec_entries(info.spec) for info in setup.layout}
  seen = {}

  def check(state, batch):
    micro = jax.tree.map(lambda x: x[0], batch)
    grads = jax.grad(loss_fn, has_aux=True)(state.params, setup.graphdef, micro, None)[0]
    _, opt_state = setup.tx.update(grads, state.opt_state, state.params)
    for name, tree in (('params', state.params), ('grads', grads), ('mu', opt_state[1][0].mu),
                       ('nu', opt_state[1][0].nu)):
      for path, var in nnx.to_flat_state(tree):
        seen[(name, train_state.path_str(path))] = spec_entries(jax.typeof(var[...]).sharding.spec)
    return grads

  with jax.set_mesh(mesh):
    state = setup.init()
    batch = next(make_batches(config, mesh, rules, tokenizer.load(config.data.tokenizer)))
    jax.jit(check).trace(state, batch)
  assert len(seen) == 4 * len(expected)
  for (kind, path), spec in seen.items():
    assert spec == expected[path], (kind, path, spec)


# Data, tensor, fsdp and context splits in the default suite (fsdp x model, data x context x model); every
# other mesh in the slow set.
FAST_MESHES = ('single', 'fsdp4_tp2', 'cp2_dp2_tp2')


def check_losses_are_the_same(short_docs, meshes):
  # 8 rows, one per device of the widest data split: the programs differ by mesh, not by batch size.
  # Rows of two or three documents each, which attend only within themselves.
  losses = {name: np.array(run(name, *INVARIANCE, *short_docs).losses) for name in ('single', *meshes)}
  reference = losses['single']
  assert reference.shape == (5,)
  for name, value in losses.items():
    np.testing.assert_allclose(value, reference, rtol=1e-4, err_msg=name)


def test_losses_are_the_same_on_data_tensor_fsdp_and_context_meshes(short_docs):
  check_losses_are_the_same(short_docs, FAST_MESHES[1:])


@pytest.mark.slow
def test_losses_are_the_same_on_every_other_mesh(short_docs):
  check_losses_are_the_same(short_docs, [m for m in MESH_CONFIGS if m not in FAST_MESHES])


def test_padded_rows_give_the_same_losses_on_two_meshes(short_docs):
  # The programs of the mesh test's `single` and `fsdp4_tp2` runs: packed and padded batches differ in
  # their data only.
  padded = (*INVARIANCE, *short_docs, 'data.packing=pad')
  losses = [run(name, *padded).losses for name in ('single', 'fsdp4_tp2')]
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)


@pytest.mark.slow  # the default suite's time (7 min); dropout keys are tested alone
def test_dropout_masks_are_the_same_on_every_mesh(short_docs):
  # The run without dropout is the mesh test's `single` run, whose compiled programs are then cached.
  overrides = (*INVARIANCE, *short_docs, 'model.dropout_rate=0.2')
  single = run('single', *overrides).losses
  sharded = run('fsdp4_tp2', *overrides).losses
  no_dropout = run('single', *INVARIANCE, *short_docs).losses
  np.testing.assert_allclose(sharded, single, rtol=1e-4)
  assert not np.allclose(single, no_dropout, rtol=1e-4)


@pytest.mark.slow  # the default suite's time; test_mintrain_keys_... checks the keys' bits
def test_dropout_keys_do_not_depend_on_the_default_prng_implementation(short_docs):
  overrides = (*INVARIANCE, *short_docs, 'model.dropout_rate=0.2', 'model.num_layers=1')
  default = run('single', *overrides).losses
  with jax.default_prng_impl('rbg'):  # Its keys would not fit a saved threefry key.
    np.testing.assert_array_equal(run('single', *overrides).losses, default)


def test_mintrain_keys_give_the_bits_of_jax_threefry_and_compile_without_loops():
  # Draws of every width and shape, splits and fold-ins, and sharded draws as the initialiser makes them.
  spec = jax.sharding.PartitionSpec(('data', 'fsdp'), 'model')

  def draws(k):
    out = [jax.random.key_data(jax.random.fold_in(k, d)) for d in (0, 1, 12345, 2**32 - 1)]
    for shape in ((), (1,), (5,), (3, 7), (2, 3, 5), (1, 1, 4)):
      out += [jax.random.bits(k, shape, dtype) for dtype in (np.uint8, np.uint16, np.uint32)]
      out.append(jax.random.key_data(jax.random.split(k, shape)))
    return (*out, jax.random.normal(k, (16, 12), out_sharding=spec),
            jax.random.truncated_normal(jax.random.split(k)[1], -2, 2, (16, 12), out_sharding=spec))

  with jax.set_mesh(make_mesh({'data': 2, 'fsdp': 2, 'model': 2})):
    ours, theirs = jax.jit(draws).lower(train_state.key(0)).compile(), jax.jit(draws)
    for seed in (0, 2**31 - 1):
      threefry = jax.random.key(seed, impl='threefry2x32')
      np.testing.assert_array_equal(jax.random.key_data(train_state.key(seed)), jax.random.key_data(threefry))
      for a, b in zip(ours(train_state.key(seed)), theirs(threefry), strict=True):
        np.testing.assert_array_equal(a, b)
  assert ' while(' not in ours.as_text()


def test_parameter_keys_are_those_of_nnx_rngs_from_the_seed():
  for seed in (0, 7, 2**31 - 1):
    rngs, counted = nnx.Rngs(params=train_state.key(seed)), ParamKeys(base=train_state.key(seed))
    expected = [jax.random.key_data(rngs.params()) for _ in range(20)]
    given = ParamKeys(given=train_state.draw_keys(seed, 20))
    for want in expected:
      np.testing.assert_array_equal(jax.random.key_data(counted.params()), want)
      np.testing.assert_array_equal(given.params(), want)
    assert counted.count == given.count == 20


def _fused_computations(hlo: str) -> set[str]:
  """The distinct fused computations of a compiled module, with their output shapes and no names."""
  bodies, name, lines = {}, None, []
  for line in hlo.splitlines():
    if line.startswith('%fused_computation'):
      name, lines = line.split(' ')[0][1:], []
    elif name and line == '}':
      bodies[name], name = '\n'.join(lines), None
    elif name:
      lines.append(re.sub(r'metadata=\{[^}]*\}', '', re.sub(r'%[\w.\-]+', '%', line)))
  shapes = re.findall(r'= (\S+) fusion\(.*calls=%(fused_computation[\w.]*)', hlo)
  return {f'{shape} {bodies[called]}' for shape, called in shapes}


# Scanned: the default suite's time (7 min); unrolled draws the same keys through the same path.
@pytest.mark.parametrize('scanned', [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_initialiser_compiles_one_program_per_kind_of_draw_and_draws_the_seeds_parameters(scanned):
  # Its keys are arguments, so like draws are one computation to XLA (a key folded inside the program is a
  # constant of its draw, and every draw a kernel of its own to compile); unrolled, the 3 layers' like
  # parameters share one compiled program each, run once per parameter, and the rest (embedding, output)
  # are drawn in the state's program. The parameters are bit for bit those of the unrolled model built
  # from `nnx.Rngs(params=key(seed))`; scanned (each parameter of all layers one vmapped draw, in the
  # state's program), those same layers stacked.
  setup = build(load_config('test_small', 'model.num_layers=3', f'model.scan_layers={scanned}'))
  make = setup.config.family.make
  unrolled = dataclasses.replace(setup.config.model, scan_layers=False)
  with jax.set_mesh(setup.mesh):
    compiled = setup.init.compile()
    drawn = convert_layers(flat(jax.device_get(compiled().params)), to_scanned=False)
    reference = flat(jax.device_get(jax.jit(lambda: nnx.state(make(
        unrolled, setup.rules, setup.placement, nnx.Rngs(params=train_state.key(setup.config.seed))),
        nnx.Param))()))
  shapes = len({info.shard_shape for info in setup.layout})
  apart = [len(kind) for kind in compiled.kinds]
  assert all(n >= train_state.APART for n in apart), apart
  if scanned:  # The layers' draws are vmapped; what is left is one of each kind.
    assert apart == []
  else:
    assert len(apart) < sum(apart) < len(setup.layout) == len(setup.init.draws), apart
  kernels = set().union(*(_fused_computations(program.as_text()) for program in compiled.draws))
  kernels |= _fused_computations(compiled.build.as_text())
  assert len(kernels) <= shapes + 2, sorted(kernels)[:2]
  assert drawn.keys() == reference.keys()
  for path, x in reference.items():
    np.testing.assert_array_equal(drawn[path], x, err_msg=path)


@pytest.mark.parametrize('packing', [pytest.param('pack', marks=pytest.mark.slow), 'pad'])
def test_four_micro_batches_equal_one_four_times_larger_batch(short_docs, packing):
  # Packed stdlib rows count every target; padded short documents a different number per micro-batch,
  # and the step is still the mean over all of them.
  data = () if packing == 'pack' else (*short_docs, 'data.packing=pad')
  results = {}
  for accum in (1, 4):
    config = load_config('dp4_tp2', *helpers.SMALL, 'train.global_batch_size=32',
                         f'train.grad_accum_steps={accum}', *data)
    mesh = make_mesh(config.mesh.sizes)
    rules = AxisRules.from_config(config.partitioning)
    setup = build(config)
    with jax.set_mesh(mesh):
      state = setup.init()
      step = make_train_step(setup.graphdef, setup.tx, schedule(config.optimizer, 10), use_dropout=False)
      batches = make_batches(config, mesh, rules, tokenizer.load(config.data.tokenizer))
      batch = next(batches)
      assert batch['inputs'].shape[:2] == (accum, 32 // accum)
      counts = np.asarray(batch['target_weights']).sum(axis=(1, 2))
      assert (len(set(counts.tolist())) > 1) == (packing == 'pad' and accum == 4), counts
      state, _ = step(state, batch)
      state, metrics = step(state, next(batches))
      results[accum] = (float(metrics['loss']), float(metrics['grad_norm']),
                        [np.asarray(x) for x in jax.tree.leaves(state.params)])
  (loss1, norm1, params1), (loss4, norm4, params4) = results[1], results[4]
  np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
  np.testing.assert_allclose(norm4, norm1, rtol=1e-4)
  for a, b in zip(params1, params4):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # the default suite's time (7 min); the README run trains in test_scripts
def test_loss_falls_in_a_short_run():
  losses = run('dp4_tp2', 'train.steps=60', 'train.log_every=20', 'train.global_batch_size=16').losses
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


@pytest.mark.slow  # the default suite's time (7 min)
def test_mlp_learns_its_teacher_under_tensor_parallelism():
  losses = run('mlp_dp4_tp2', 'train.steps=40', 'train.log_every=20').losses
  assert np.mean(losses[-5:]) < 0.2 * np.mean(losses[:5])


def test_nan_loss_stops_the_run_and_names_the_step():
  config = load_config('dp8', *helpers.TINY, 'train.steps=6', 'train.log_every=3')
  config = config.replace(optimizer=dataclasses.replace(config.optimizer, learning_rate=float('nan')))
  with pytest.raises(NonFiniteLossError, match=r'Non-finite .*param_norm=nan at step 1'):
    train_loop.run(config, None, print_fn=quiet)
