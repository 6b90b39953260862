"""Pipeline parallelism over the mesh axis `stage`: the same losses and gradients as one device, its config
checks, checkpoints across pipelined and unpipelined meshes, and the collectives of the compiled step."""

import re

import jax
import numpy as np
import pytest
from helpers import TINY, build, equations, load_config, mesh_devices, quiet

from mintrain import loop as train_loop
from mintrain.data import tokenizer
from mintrain.errors import ConfigError
from mintrain.objectives.lm import loss as loss_fn

# Four stacked layers, so that two stages hold two each, four one each, or (repeats=2) two of four blocks.
PIPELINED = (*TINY, 'model.num_layers=4', 'model.scan_layers=True')
SINGLE = ('mesh.stage=1', 'mesh.data=1', 'mesh.fsdp=1', 'mesh.model=1')
MESHES = {
    'stage2_data2_model2': ('mesh.stage=2', 'mesh.data=2', 'mesh.fsdp=1', 'mesh.model=2'),
    'stage4_data2': ('mesh.stage=4', 'mesh.data=2', 'mesh.fsdp=1', 'mesh.model=1'),
    'stage2_fsdp2_model2': ('mesh.stage=2', 'mesh.data=1', 'mesh.fsdp=2', 'mesh.model=2'),
    'stage2_data2_model2_repeats2': ('mesh.stage=2', 'mesh.data=2', 'mesh.fsdp=1', 'mesh.model=2',
                                     'pipeline.repeats=2'),
    'stage2_fsdp2_model2_repeats2': ('mesh.stage=2', 'mesh.data=1', 'mesh.fsdp=2', 'mesh.model=2',
                                     'pipeline.repeats=2'),
}


def loss_and_grads(*overrides, grads=True):
  """The loss (and gradients) of the seed's parameters on the first batch, as host values."""
  config = load_config('dp4_tp2', *PIPELINED, 'data.source=synthetic', *overrides)
  run = build(config)
  with jax.set_mesh(run.mesh):
    state = run.init()
    batch = jax.tree.map(lambda x: x[0], next(run.batches(tokenizer.load(config.data.tokenizer))))
    if not grads:
      return float(jax.jit(loss_fn, static_argnums=1)(state.params, run.graphdef, batch, None)[1][1]['loss'])
    grads, (_, metrics) = jax.jit(jax.grad(loss_fn, has_aux=True), static_argnums=1)(
        state.params, run.graphdef, batch, None)
  return float(metrics['loss']), {k: np.asarray(v) for k, v in jax.tree.leaves_with_path(grads)}


def test_gpipe_gives_the_loss_of_one_device():
  # Two layers, one a stage, and the forward pass alone: the smallest pipelined compile.
  loss = loss_and_grads(*MESHES['stage2_data2_model2'], 'pipeline.microbatches=2', 'model.num_layers=2',
                        grads=False)
  np.testing.assert_allclose(loss, loss_and_grads(*SINGLE, 'model.num_layers=2', grads=False), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('mesh', sorted(MESHES))
def test_the_schedule_gives_the_gradients_of_one_device(mesh):
  # Without remat: the circular schedule's layers then recompute only their round's weights.
  loss, grads = loss_and_grads(*MESHES[mesh], 'pipeline.microbatches=2')
  ref_loss, ref_grads = loss_and_grads(*SINGLE)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert grads.keys() == ref_grads.keys() and len(grads) > 5
  for path, grad in grads.items():
    np.testing.assert_allclose(grad, ref_grads[path], rtol=1e-4, atol=1e-6, err_msg=str(path))


def run_losses(*overrides):
  config = load_config('dp4_tp2', *PIPELINED, 'train.steps=3', 'train.log_every=1', *overrides)
  return np.array(train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet).losses)


@pytest.mark.slow
@pytest.mark.parametrize('mesh', sorted(MESHES))
def test_training_gives_the_losses_of_one_device(mesh):
  # Remat and two accumulated micro-batches take part.
  common = ('model.remat=full', 'train.grad_accum_steps=2')
  pipelined = run_losses(*MESHES[mesh], 'pipeline.microbatches=2', *common)
  reference = run_losses(*SINGLE, *common)
  assert reference.shape == (3,)
  np.testing.assert_allclose(pipelined, reference, rtol=1e-5)


@pytest.mark.parametrize('overrides, message', [
    (('model.scan_layers=False',), r'mesh.stage=2 pipelines the stacked layers; set model.scan_layers=True'),
    (('model.num_layers=3',), r'model.num_layers=3 does not split into mesh.stage=2 x pipeline.repeats=1'),
    (('pipeline.repeats=4',), r'model.num_layers=4 does not split into mesh.stage=2 x pipeline.repeats=4'),
    (('pipeline.microbatches=3',), r'pipeline.microbatches=3 must divide the 4 rows each device holds'),
    (('pipeline.repeats=2', 'pipeline.microbatches=1'), r'needs pipeline.microbatches >= mesh.stage=2'),
    (('mesh.data=1', 'mesh.context=2'), r'does not combine with a split `length`'),
    (('model.num_experts=4',), r'does not run mixture-of-experts'),
    (('model.dropout_rate=0.1',), r'would draw other dropout masks than one batch does'),
    (('model.mlp_overlap=True',), r'does not run the overlapped MLP \(model.mlp_overlap\) inside its stages'),
])
def test_unsupported_pipelines_are_config_errors_before_compiling(overrides, message):
  config = load_config('dp4_tp2', *PIPELINED, *MESHES['stage2_data2_model2'], *overrides)
  with pytest.raises(ConfigError, match=message):
    build(config)


def test_the_memory_plan_counts_a_stages_activations_split_over_model_with_or_without_remat():
  # Tensor parallelism inside a stage splits the activations the schedule keeps, as it does without a
  # pipeline: model 2 halves the heads' and MLP's share of them.
  def run(mesh: tuple[str, ...], remat: str):
    return build(load_config('dp4_tp2', *PIPELINED, *mesh, f'model.remat={remat}'))

  model2 = MESHES['stage2_data2_model2']
  model1 = ('mesh.stage=2', 'mesh.data=2', 'mesh.fsdp=1', 'mesh.model=1')  # The same rows per device.
  split = run(model2, 'none')
  assert split.plan.activations < 0.75 * run(model1, 'none').plan.activations
  assert run(model2, 'full').plan.activations <= run(model1, 'full').plan.activations
  assert not [n for n in split.notes if 'tensor split' in n]


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.slow
@pytest.mark.parametrize('source, target', [('pipelined', 'single'), ('single', 'pipelined')])
def test_checkpoints_restore_between_pipelined_and_unpipelined_meshes_bit_for_bit(tmp_path, source, target):
  meshes = {'pipelined': (*MESHES['stage2_data2_model2'], 'pipeline.microbatches=2'), 'single': SINGLE}
  steps = ('train.steps=2', 'checkpoint.every_steps=2', 'data.source=synthetic')
  saved = train_loop.run(load_config('dp4_tp2', *PIPELINED, *steps, *meshes[source]), tmp_path,
                         devices=mesh_devices(load_config('dp4_tp2', *meshes[source])), print_fn=quiet)
  config = load_config('dp4_tp2', *PIPELINED, *steps, *meshes[target])
  run = build(config)
  with jax.set_mesh(run.mesh):
    state, _ = train_loop.initial_state(run, None, restore_from=str(tmp_path / 'checkpoints' / '2'),
                                        params_only=False, print_fn=quiet)
  assert int(state.step) == 2
  for restored, wanted in zip(host(state.params) + host(state.opt_state),
                              host(saved.state.params) + host(saved.state.opt_state), strict=True):
    np.testing.assert_array_equal(restored, wanted)
  for restored, wanted in zip(jax.tree.leaves(state), jax.tree.leaves(run.abstract_state)):
    assert restored.sharding == wanted.sharding  # The target mesh's layout, not the saved one.


@pytest.mark.slow
@pytest.mark.parametrize('mesh, stacks', [
    # Tensor parallelism inside a stage gathers nothing: the activations the schedule keeps for the
    # backward pass stay split over `model`, and its weights enter the schedule as they are stored.
    (MESHES['stage2_data2_model2'], None),
    # Over fsdp alone, a stage's stack of weights gathered before the schedule would show; each layer
    # gathers its own inside it.
    (('mesh.stage=2', 'mesh.data=1', 'mesh.fsdp=4', 'mesh.model=1'), {'6', '3'}),
])
@pytest.mark.parametrize('remat', ['none', 'full'])
def test_the_compiled_step_passes_activations_between_stages_and_gathers_no_stack_of_layers(mesh, stacks,
                                                                                           remat):
  # Six layers, three a stage: no activation has a leading dimension of 6 or 3, so a gathered stack of all
  # layers, or of a stage's, would show as one.
  config = load_config('dp4_tp2', *PIPELINED, 'model.num_layers=6', 'data.source=synthetic',
                       *mesh, 'pipeline.microbatches=2', f'model.remat={remat}')
  run = build(config)
  with jax.set_mesh(run.mesh):
    state = run.init()
    batch = next(run.batches(tokenizer.load(config.data.tokenizer)))
    hlo = run.train_step.lower(state, batch).compile().as_text()
  assert 'collective-permute' in hlo
  gathered = re.findall(r'= \w+\[(\d+)[,\]][^\n]*? all-gather(?:-start)?\(', hlo)
  if stacks is None:
    assert not gathered, f'all-gathers of {len(gathered)} arrays'
  else:
    assert gathered, "expected the fsdp all-gathers of each layer's weights"
    assert not stacks & set(gathered), 'an all-gather of a stack of layers'


@pytest.mark.slow
def test_a_pipelined_model_samples_on_its_mesh_as_on_one_device():
  from helpers import fill

  from mintrain import train_state
  from mintrain.models.transformer import sampling
  generated = {}
  params = None
  pipelined = (*MESHES['stage2_data2_model2'], 'pipeline.microbatches=2')
  for name, mesh in (('single', SINGLE), ('pipelined', pipelined)):
    run = build(load_config('dp4_tp2', *PIPELINED, 'data.source=synthetic', *mesh))
    with jax.set_mesh(run.mesh):
      if params is None:
        params = {train_state.path_str(p): x for p, x in
                  jax.tree_util.tree_flatten_with_path(jax.device_get(run.init().params))[0]}
      model = run.model(fill(run.abstract_state.params, params))
      prompt_BP = np.random.RandomState(0).randint(0, 256, (8, 5)).astype(np.int32)
      generated[name] = np.asarray(sampling.generate(model, prompt_BP, 6))
  np.testing.assert_array_equal(generated['pipelined'], generated['single'])


@pytest.mark.slow
@pytest.mark.parametrize('mesh, microbatches', [('stage2_data2_model2', 2), ('stage4_data2', 4)])
def test_the_memory_plan_counts_what_xla_keeps_for_the_pipelined_step(mesh, microbatches):
  # Rows and tokens enough for the schedule's activations to outweigh the step's fixed workspace.
  config = load_config('dp4_tp2', *PIPELINED, 'data.source=synthetic', 'train.global_batch_size=32',
                       'train.seq_len=32', *MESHES[mesh], f'pipeline.microbatches={microbatches}')
  run = build(config)
  with jax.set_mesh(run.mesh):
    state = run.init()
    batch = next(run.batches(tokenizer.load(config.data.tokenizer)))
    temp = run.train_step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  assert 1 / 1.5 <= run.plan.activations / temp <= 1.5, (run.plan.activations, temp)


@pytest.mark.parametrize('mesh, remat', [
    ('stage2_data2_model2', 'none'),
    ('stage2_data2_model2_repeats2', 'full'),
    ('stage2_data2_model2_repeats2', 'none'),
    ('stage2_fsdp2_model2', 'none'),  # Gathered inside the block: still kept once.
    ('stage2_fsdp2_model2_repeats2', 'none'),
])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_the_schedule_keeps_no_copy_of_its_stages_weights_per_step(mesh, remat, dtype):
  # Autodiff stacks, for each step of the schedule, what the backward pass needs of the block that step ran:
  # its activations, all with a dimension of the tokens (24 here, no weight's). A GPipe stage's block is
  # the same at every step, so its weights (and the q/k/v and gate/up stacks formed from them) are kept
  # once; the circular schedule's differ by round, so each layer selects, gathers, casts and stacks its
  # own again in the backward pass, with remat or without.
  config = load_config('dp4_tp2', *PIPELINED, 'data.source=synthetic', 'train.seq_len=24', *MESHES[mesh],
                       'pipeline.microbatches=2', f'model.remat={remat}', f'model.compute_dtype={dtype}')
  run = build(config)
  with jax.set_mesh(run.mesh):
    batch = jax.tree.map(lambda x: x[0], next(run.batches(tokenizer.load(config.data.tokenizer))))
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss_fn(p, run.graphdef, batch, None)[0]))(
        run.abstract_state.params)
  iterations = run.placement.pipeline.iterations
  schedules = [eqn for eqn in equations(jaxpr.jaxpr, 'scan') if eqn.params['length'] == iterations]
  kept = [v.aval.shape for eqn in schedules for v in eqn.outvars[eqn.params['num_carry']:]]
  assert kept and all(shape[0] == iterations for shape in kept)
  weights = [shape for shape in kept if len(shape) > 2 and 24 not in shape]
  assert not weights, weights
