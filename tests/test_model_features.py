"""Performance options compute what the reference model computes, on several meshes.

remat, scanned layers, dot-product attention and the overlapped MLP each give the loss and the
gradients of the default model with the same parameters; scanned and unrolled checkpoints
restore into each other.
"""

import contextlib
import io
import math
import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import build as build_run
from helpers import convert_layers, equations, fill, flat, load_config, mesh_devices, quiet

from mintrain import errors, report, train_state
from mintrain import loop as train_loop
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.checkpoint.relayout import Relayout
from mintrain.data import tokenizer
from mintrain.data.batches import make_batches
from mintrain.errors import ConfigError
from mintrain.mesh import make_mesh
from mintrain.models.layers import MATMUL, linear
from mintrain.models.transformer import collective_matmul
from mintrain.models.transformer.attention import attention_kernel
from mintrain.models.transformer.config import REMAT_OPTIONS
from mintrain.objectives.lm import loss as loss_fn
from mintrain.optimizer import decay_mask
from mintrain.partitioning import AxisRules
from mintrain.report import format_report

SMALL = (*helpers.SMALL, 'model.num_layers=2', 'model.vocab_size=128', 'data.source=synthetic',
         'train.global_batch_size=8', 'train.log_every=1', 'optimizer.warmup_steps=1')
MESHES = {'2x4': ('dp4_tp2', 'mesh.data=2', 'mesh.model=4')}  # A model=4 mesh no config file names.


def small(name, *overrides):
  base, *mesh = MESHES.get(name, (name,))
  return load_config(base, *SMALL, *mesh, *overrides)


def build(config):
  """(mesh, rules, run) of `config` on as many simulated devices as its mesh takes."""
  run = build_run(config)
  return run.mesh, run.rules, run


def host(tree) -> dict:
  """A state's arrays on the host by path, with stacked blocks split into layers."""
  return convert_layers({k: np.asarray(v) for k, v in flat(jax.device_get(tree)).items()},
                                 to_scanned=False)


def assert_close(actual: dict, expected: dict, **tolerance):
  assert actual.keys() == expected.keys()
  for path in expected:
    np.testing.assert_allclose(actual[path], expected[path], err_msg=path, **tolerance)


@pytest.fixture(scope='module')
def host_params():
  """Parameters of the unrolled model drawn once; every case moves them to its mesh and layout."""
  config = small('single')
  mesh, _, setup = build(config)
  with jax.set_mesh(mesh):
    return host(setup.init().params)


def loss_and_grads(host_params, name, *overrides):
  """(loss, host gradients by unrolled path) of the first synthetic batch, on `name`'s mesh."""
  config = small(name, *overrides)
  mesh, rules, setup = build(config)
  params = fill(setup.abstract_state.params,
                         convert_layers(host_params, to_scanned=config.model.scan_layers))

  @jax.jit
  def step(params, batch):
    micro = jax.tree.map(lambda x: x[0], batch)
    return jax.value_and_grad(loss_fn, has_aux=True)(params, setup.graphdef, micro, None)

  with jax.set_mesh(mesh):
    (loss, _), grads = step(params, next(make_batches(config, mesh, rules, tokenizer.BYTES)))
  return float(loss), host(grads)


@pytest.fixture(scope='module')
def reference(host_params):
  """The plain model on one device: logits, then cross-entropy."""
  return loss_and_grads(host_params, 'single', 'model.loss_chunks=0')


def check_matches_reference(host_params, reference, name, *overrides):
  loss, grads = loss_and_grads(host_params, name, *overrides)
  np.testing.assert_allclose(loss, reference[0], rtol=1e-5)
  assert_close(grads, reference[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('remat,name', [('full', 'single'), ('full', 'fsdp4_tp2'),
                                        ('save_matmuls', 'single'), ('save_matmuls', 'dp4_tp2')])
def test_remat_gives_the_reference_loss_and_gradients(host_params, reference, remat, name):
  check_matches_reference(host_params, reference, name, f'model.remat={remat}')


@pytest.mark.parametrize('name', ['single', 'fsdp4_tp2'])
def test_scanned_layers_give_the_reference_loss_and_gradients(host_params, reference, name):
  check_matches_reference(host_params, reference, name, 'model.scan_layers=True')


@pytest.mark.parametrize('name', ['single', 'fsdp4_tp2'])
def test_dot_product_attention_gives_the_reference_loss_and_gradients(host_params, reference, name):
  check_matches_reference(host_params, reference, name, 'model.attention=dot_product')


def test_dot_product_attention_asks_for_cudnn_only_on_gpu_in_16_bit():
  assert attention_kernel('cpu', jnp.bfloat16, 64) == 'xla'
  assert attention_kernel('gpu', jnp.float32, 64) == 'xla'  # cuDNN's kernel takes 16-bit inputs only.
  assert attention_kernel('gpu', jnp.bfloat16, 64) == 'cudnn'
  assert attention_kernel('cuda', jnp.float16, 128) == 'cudnn'
  assert attention_kernel('gpu', jnp.bfloat16, 256) == 'xla'  # Head sizes above 128 it does not take.
  assert attention_kernel('tpu', jnp.bfloat16, 64) == 'xla'


@pytest.mark.parametrize('name', ['dp4_tp2', '2x4', 'tp8'])  # Rings of 2, 4 and 8 devices.
def test_overlapped_mlp_gives_the_reference_loss_and_gradients(host_params, reference, name):
  check_matches_reference(host_params, reference, name, 'model.mlp_overlap=True')


@pytest.mark.parametrize('name,chunks', [('single', 1), ('dp4_tp2', 4), ('fsdp4_tp2', 2), ('tp8', 8)])
def test_fused_loss_gives_the_reference_loss_and_gradients(host_params, reference, name, chunks):
  check_matches_reference(host_params, reference, name, f'model.loss_chunks={chunks}')


@pytest.mark.slow  # the default suite's time (7 min)
def test_fused_loss_with_tied_embeddings_matches_on_two_meshes(host_params):
  tied = loss_and_grads(host_params, 'single', 'model.tie_embeddings=True', 'model.loss_chunks=0')
  for name in ('single', 'dp4_tp2'):
    loss, grads = loss_and_grads(host_params, name, 'model.tie_embeddings=True', 'model.loss_chunks=2')
    np.testing.assert_allclose(loss, tied[0], rtol=1e-5)
    assert_close(grads, tied[1], rtol=1e-4, atol=1e-6)


def _mlp_on_ring(n, seq_len):
  """(overlapped, plain) forward and input gradient of the gated MLP on a mesh with `model` = n."""
  config = load_config('dp4_tp2', 'mesh.data=1', f'mesh.model={n}')
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  rules = AxisRules.from_config(config.partitioning)
  bld, rng = ('batch', 'length', 'embed'), np.random.RandomState(n)
  arrays = [(rng.randn(2, seq_len, 16), bld), (rng.randn(16, 8 * n) / 4, ('embed', 'mlp')),
            (rng.randn(16, 8 * n) / 4, ('embed', 'mlp')), (rng.randn(8 * n, 16) / 4, ('mlp', 'embed'))]
  cotangent_BLD = rng.randn(2, seq_len, 16).astype(np.float32)

  def plain(x_BLD, w_gate_DF, w_up_DF, w_down_FD):
    h_BLF = jax.nn.silu(x_BLD @ w_gate_DF) * (x_BLD @ w_up_DF)
    return jnp.einsum('BLF,FD->BLD', h_BLF, w_down_FD, out_sharding=rules.activation_spec(bld))

  def ring(*args):
    return rules.reshard(collective_matmul.gated_mlp(*args, rules), bld)

  results = []
  with jax.set_mesh(mesh):
    args = [jax.device_put(a.astype(np.float32), rules.activation_spec(axes)) for a, axes in arrays]
    for fn in (ring, plain):
      value_and_grad = jax.value_and_grad(lambda *a, fn=fn: jnp.sum(fn(*a) * cotangent_BLD), (0, 1, 3))
      results.append((jax.jit(value_and_grad)(*args), jax.jit(fn).lower(*args).compile().as_text()))
  return results


@pytest.mark.parametrize('n,seq_len', [(8, 24), (4, 8)])  # Chunks of 3 (one-way ring) and of 2 (both ways).
def test_ring_mlp_equals_the_plain_mlp_and_its_forward_talks_by_collective_permutes(n, seq_len):
  ((ring_value, ring_grads), ring_hlo), ((plain_value, plain_grads), _) = _mlp_on_ring(n, seq_len)
  np.testing.assert_allclose(ring_value, plain_value, rtol=1e-5)
  for got, want in zip(ring_grads, plain_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert 'collective-permute' in ring_hlo and 'all-gather' in ring_hlo  # The ring, then the output's gather.
  assert 'all-reduce' not in ring_hlo and 'reduce-scatter' not in ring_hlo


def test_overlap_with_a_sequence_the_ring_does_not_divide_names_the_fix(host_params):
  with pytest.raises(ValueError, match=r'sequence \(length 30\) into 8 chunks over `model`; 30 % 8 != 0'):
    loss_and_grads(host_params, 'tp8', 'model.mlp_overlap=True', 'train.seq_len=30')


def test_stacked_params_declare_the_layers_axis_first_and_the_report_shows_it():
  config = small('fsdp4_tp2', 'model.scan_layers=True')
  mesh, _, setup = build(config)
  infos = {info.path: info for info in setup.layout}
  assert not any(path.startswith('blocks.0.') for path in infos)
  gate = infos['blocks.mlp.wi_gate_DF']
  assert gate.shape == (2, 64, 128) and gate.logical_axes == ('layers', 'embed', 'mlp')
  assert tuple(gate.spec) == ('stage', 'fsdp', 'model') and gate.shard_shape == (2, 16, 64)
  assert infos['blocks.attn_norm.scale'].logical_axes == ('layers', 'embed')
  assert "('layers', 'embed', 'mlp')" in format_report(setup.layout, setup.abstract_state, mesh)


def test_stacked_norm_scales_are_not_weight_decayed():
  masks = {}
  for scan in (False, True):
    config = small('single', f'model.scan_layers={scan}')
    _, _, setup = build(config)
    masks[scan] = {path.removesuffix('.value'): bool(decays) for path, decays in
                   flat(decay_mask(setup.abstract_state.params)).items()}
  assert not masks[True]['blocks.attn_norm.scale'] and masks[True]['blocks.mlp.wo_FD']
  assert {path: decays for path, decays in masks[False].items() if not path.startswith('blocks.1.')} == {
      path.replace('blocks.', 'blocks.0.'): decays for path, decays in masks[True].items()}


def test_performance_options_take_only_known_values():
  with pytest.raises(ConfigError, match=r"remat='some'; choose one of \('none', 'full', 'save_matmuls'\)"):
    load_config('single', 'model.remat=some')
  with pytest.raises(ConfigError, match=r"model.attention='flash'; choose one of"):
    load_config('single', 'model.attention=flash')
  with pytest.raises(ConfigError, match='model.scan_layers expects True or False'):
    load_config('single', 'model.scan_layers=1')
  with pytest.raises(ConfigError, match='loss_chunks=3 must be 0 .* positive divisor of train.seq_len=64'):
    load_config('single', 'model.loss_chunks=3')


def test_activation_estimate_follows_remat_and_loss_chunks():
  def activations(remat, layers, chunks=1):
    config = load_config('dp4_tp2', f'model.remat={remat}', f'model.num_layers={layers}',
                         f'model.loss_chunks={chunks}')
    run = build_run(config)
    return report.activation_bytes(run.config, run.rules, run.mesh)

  assert activations('full', 4) < activations('save_matmuls', 4) < activations('none', 4)
  rows, seq_len, embed_dim, vocab = 32 // 4, 64, 128, 384
  # Under full remat each further layer keeps only its input: batch rows x length x embed values.
  assert activations('full', 4) - activations('full', 2) == 2 * rows * seq_len * embed_dim * 4
  # Fused over 4 chunks, a quarter of the float32 logits and softmax (vocab split over model=2) is live.
  logits_and_softmax = rows * seq_len * 2 * 4 * vocab // 2
  assert activations('none', 4, 1) - activations('none', 4, 4) == logits_and_softmax * 3 // 4


def _saved_residuals(*overrides) -> list[tuple[int, str]]:
  """(elements, description) of what the loss's backward pass keeps, as `print_saved_residuals` lists it."""
  config = load_config('dp4_tp2', 'data.source=synthetic', 'model.num_layers=3', *overrides)
  mesh, rules, setup = build(config)
  listing = io.StringIO()
  with jax.set_mesh(mesh), contextlib.redirect_stdout(listing):
    micro = jax.tree.map(lambda x: x[0], next(make_batches(config, mesh, rules, tokenizer.BYTES)))
    jax.ad_checkpoint.print_saved_residuals(lambda p: loss_fn(p, setup.graphdef, micro, None)[0],
                                            setup.abstract_state.params)
  residuals = []
  for line in listing.getvalue().splitlines():
    shape = re.match(r'\w+\[([^\]]*)\] (.*)', line)
    if shape and 'from the argument' not in shape.group(2):
      dims = [int(d) for d in re.sub(r'@(\([^)]*\)|\w+)', '', shape.group(1)).split(',') if d]
      residuals.append((math.prod(dims), shape.group(2)))
  return residuals


def test_remat_policies_decide_what_the_backward_pass_keeps():
  """save_matmuls keeps the weight matmuls' outputs (`linear` is a custom VJP, which a dots policy
  cannot see, so it names them) and full keeps none of them; each keeps less than no remat."""
  kept = {remat: _saved_residuals(f'model.remat={remat}') for remat in REMAT_OPTIONS}
  named = {remat: [r for r in kept[remat] if f"named '{MATMUL}'" in r[1]] for remat in REMAT_OPTIONS}
  assert len(named['save_matmuls']) >= 3 * 3 and not named['full']  # q/k/v, projection, gate/up per layer.
  total = {remat: sum(n for n, _ in kept[remat]) for remat in REMAT_OPTIONS}
  assert total['full'] < total['save_matmuls'] < total['none']


@pytest.fixture(scope='module')
def unrolled_run(tmp_path_factory):
  """A workdir with the checkpoint of a 3-step run of the default model on dp4_tp2, and its result."""
  workdir = tmp_path_factory.mktemp('unrolled')
  config = small('dp4_tp2', 'train.steps=3')
  return workdir, train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=quiet)


@pytest.mark.slow  # the default suite's time; each option is tested alone there
def test_all_options_together_train_like_the_default_model(unrolled_run):
  options = ('model.remat=save_matmuls', 'model.scan_layers=True', 'model.attention=dot_product',
             'model.mlp_overlap=True', 'train.steps=3')
  config = small('fsdp4_tp2', *options)
  losses = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet).losses
  np.testing.assert_allclose(losses, unrolled_run[1].losses, rtol=1e-5)


def restore_on(config, path):
  """The state `train.py --restore_from path` starts from, and the abstract state it must match."""
  mesh, _, setup = build(config)
  with jax.set_mesh(mesh):
    state, _ = train_loop.initial_state(setup, None, restore_from=str(path), params_only=False,
                                        print_fn=quiet)
  return state, setup.abstract_state


def restore_tree(config, workdir, params_only=False):
  """The newest checkpoint's state tree, read straight into the config's model and mesh."""
  mesh, _, setup = build(config)
  checkpoints = ckpt_lib.Checkpoints(workdir / 'checkpoints', read_only=True)
  with jax.set_mesh(mesh):
    tree = checkpoints.restore(checkpoints.steps()[-1], setup.abstract_state, params_only=params_only).state
  return tree


def assert_same_state(actual, expected):
  for part in ('params', 'opt_state'):
    a, b = host(getattr(actual, part)), host(getattr(expected, part))
    assert a.keys() == b.keys()
    for path in b:
      np.testing.assert_array_equal(a[path], b[path], err_msg=path)
  assert int(actual.step) == int(expected.step)


def test_an_unrolled_checkpoint_restores_into_a_scanned_model_and_back(unrolled_run, tmp_path):
  workdir, saved = unrolled_run[0], unrolled_run[1].state
  scanned, abstract = restore_on(small('fsdp4_tp2', 'model.scan_layers=True'), workdir)
  assert scanned.params['blocks']['mlp']['wo_FD'][...].shape == (2, 128, 64)
  assert scanned.opt_state[1][0].mu['blocks']['mlp']['wo_FD'][...].shape == (2, 128, 64)
  for restored, wanted in zip(jax.tree.leaves(scanned), jax.tree.leaves(abstract)):
    assert restored.sharding == wanted.sharding  # Stacked in the scanned model's own layout.
  assert_same_state(scanned, saved)

  checkpoints = ckpt_lib.Checkpoints(tmp_path / 'checkpoints')  # Saved in the scanned layout ...
  checkpoints.save(3, scanned, data_state={}, metadata={})
  checkpoints.wait()
  checkpoints.close()
  assert 'params.blocks.mlp.wo_FD.value' in ckpt_lib.Checkpoints(tmp_path / 'checkpoints').array_metadata(3)
  unrolled = restore_tree(small('single'), tmp_path)  # ... and restored unrolled.
  assert_same_state(train_state.TrainState(**unrolled), saved)


def test_params_only_restore_converts_the_layout_too(unrolled_run):
  workdir, saved = unrolled_run[0], unrolled_run[1].state
  tree = restore_tree(small('tp8', 'model.scan_layers=True'), workdir, params_only=True)
  assert set(tree) == {'params'}
  a, b = host(tree['params']), host(saved.params)
  assert a.keys() == b.keys()
  for path in b:
    np.testing.assert_array_equal(a[path], b[path], err_msg=path)


def test_a_checkpoint_with_fewer_layers_is_an_error_naming_the_missing_ones(unrolled_run):
  workdir = unrolled_run[0]
  with pytest.raises(errors.CheckpointError, match=r'params.blocks.2.attn.wk_DHK.value: not in the check'):
    restore_tree(small('single', 'model.scan_layers=True', 'model.num_layers=3'), workdir)


@pytest.mark.slow
def test_training_continues_identically_after_restoring_into_the_other_layout(unrolled_run, tmp_path):
  workdir = unrolled_run[0]
  losses = {}
  for scan in (False, True):
    config = small('dp4_tp2', 'train.steps=5', f'model.scan_layers={scan}')
    losses[scan] = train_loop.run(config, tmp_path / str(scan), devices=mesh_devices(config),
                                  restore_from=str(workdir), print_fn=quiet).losses
  np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)


@pytest.mark.parametrize('subscripts,x_axes,w_axes,out_axes', [
    ('BLD,DGF->BLGF', ('batch', 'length', 'embed'), ('embed', None, 'mlp'), None),  # x smaller than dy.
    ('BLF,FD->BLD', ('batch', 'length', 'mlp'), ('mlp', 'embed'), ('batch', 'length', 'embed')),  # dy smaller
])
def test_linear_has_the_einsum_value_and_gradients(subscripts, x_axes, w_axes, out_axes):
  config = load_config('dp4_tp2')
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  rules = AxisRules.from_config(config.partitioning)
  rng = np.random.RandomState(0)
  x_shape, w_shape = (8, 16, 32), ((32, 2, 64) if 'G' in subscripts else (32, 16))
  with jax.set_mesh(mesh):
    x = jax.device_put(rng.randn(*x_shape).astype(np.float32), rules.activation_spec(x_axes))
    w = jax.device_put(rng.randn(*w_shape).astype(np.float32), rules.activation_spec(w_axes))
    out_spec = out_axes and rules.activation_spec(out_axes)

    def summed(fn):
      loss = lambda x, w: jnp.sum(jnp.sin(fn(subscripts, x, w, out_spec)))  # noqa: E731
      return jax.jit(jax.value_and_grad(loss, (0, 1)))

    value, grads = summed(linear)(x, w)
    expected_value, expected_grads = summed(lambda s, x, w, o: jnp.einsum(s, x, w, out_sharding=o))(x, w)
  np.testing.assert_allclose(value, expected_value, rtol=1e-5)
  for got, want in zip(grads, expected_grads):
    assert got.sharding == want.sharding
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_linears_weight_gradient_copies_the_smaller_operand_transposed():
  # XLA:CPU's matmul reads the first operand of a weight gradient (the rows contracted) transposed, a copy.
  # Here dy (B*L x 16) is smaller than x (B*L x 96): dy is the one copied, never x (BENCHMARKS.md).
  rng = np.random.RandomState(0)
  x, w = jnp.asarray(rng.randn(4, 64, 96), jnp.float32), jnp.asarray(rng.randn(96, 16), jnp.float32)
  grads = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(linear('BLF,FD->BLD', x, w))), (0, 1)))
  program = grads.lower(x, w).compile().as_text()
  assert re.search(r'f32\[16,256\]', program) and not re.search(r'f32\[96,256\]', program)
  expected = jax.grad(lambda x, w: jnp.sum(jnp.sin(jnp.einsum('BLF,FD->BLD', x, w))), (0, 1))(x, w)
  for got, want in zip(grads(x, w), expected):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('overrides', [
    ('model.remat=full', 'model.scan_layers=True'),
    ('model.mlp_overlap=True',),
    ('model.num_experts=4', 'model.experts_per_token=2', 'model.moe_every=2'),
    ('model.loss_chunks=0', 'model.num_experts=4', 'model.shared_expert_dim=32',
     'model.shared_expert_gate=True'),
], ids=['scanned_remat', 'ring_mlp', 'experts', 'unfused_loss_shared_expert'])
def test_a_bfloat16_model_sums_every_matmul_of_its_step_in_float32(overrides):
  # XLA:CPU multiplies bfloat16 operands as they are only into a float32 result; asked for bfloat16, it
  # converts both to float32 first (the step took 1.5x as long, BENCHMARKS.md). So on the CPU every matmul
  # of the step, gradients included, asks for float32 (`layers.matmul`).
  config = small('dp4_tp2', 'model.compute_dtype=bfloat16', *overrides)
  _, _, run = build(config)
  with jax.set_mesh(run.mesh):
    batch = jax.tree.map(lambda x: x[0], next(run.batches(tokenizer.load(config.data.tokenizer))))
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss_fn(p, run.graphdef, batch, None)[0]))(
        run.abstract_state.params)
  dots = [eqn for eqn in equations(jaxpr.jaxpr, 'dot_general')
          if any(v.aval.dtype == jnp.bfloat16 for v in eqn.invars)]
  assert len(dots) >= 2 * 3 * config.model.num_layers  # q/k/v, scores, values, output, MLP; twice backward.
  narrow = [str(eqn) for eqn in dots if eqn.params['preferred_element_type'] != jnp.float32]
  assert not narrow, narrow[:3]


def test_the_layer_conversion_frees_each_saved_array_as_soon_as_it_is_converted(host_params):
  """A checkpoint read in the other layout is converted one array at a time: never both layouts at once."""
  mesh, _, run = build(small('fsdp4_tp2', 'model.scan_layers=True'))
  target = flat(run.abstract_state.params)
  axes = train_state.flat_logical_axes(run.abstract_state.params)
  relayout = Relayout.plan({p: (tuple(x.shape), axes[p]) for p, x in target.items()},
                           dict.fromkeys(host_params))
  assert relayout.stack and not relayout.unstack
  layout = relayout.saved_layout(target)
  with jax.set_mesh(mesh):
    saved = {p: jax.device_put(host_params[p], layout[p].sharding) for p in layout}
    consumed = [saved[s] for sources in relayout.stack.values() for s in sources]
    converted = relayout.apply(dict(saved), target)
  assert all(x.is_deleted() for x in consumed)
  assert set(converted) == set(target)
  wanted = convert_layers(host_params, to_scanned=True)
  for path, x in converted.items():
    assert x.sharding == target[path].sharding
    np.testing.assert_array_equal(np.asarray(x), wanted[path], err_msg=path)


QWEN3 = ('model.vocab_size=384', 'data.source=synthetic', 'train.steps=3', 'train.log_every=3',
         'train.seq_len=16', 'train.global_batch_size=8')
QWEN3_MESHES = {'single': ('mesh.data=1', 'mesh.model=1'), 'dp4_tp2': (),
                'tp8': ('mesh.data=1', 'mesh.model=8'),
                'fsdp8': ('mesh.data=1', 'mesh.fsdp=8', 'mesh.model=1')}


@pytest.mark.slow
@pytest.mark.parametrize('meshes', [('dp4_tp2',), ('tp8', 'fsdp8')], ids=['dp4_tp2', 'tp8-fsdp8'])
def test_the_qwen3_config_trains_with_the_same_losses_on_every_mesh(meshes):
  losses = {}
  for name in ('single', *meshes):
    config = load_config('qwen3_dp4_tp2', *QWEN3, *QWEN3_MESHES[name])
    losses[name] = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet).losses
  for name, value in losses.items():
    np.testing.assert_allclose(value, losses['single'], rtol=1e-4, err_msg=name)


def test_the_qwen3_config_counts_its_qk_norm_scales_and_they_are_not_decayed():
  config = load_config('qwen3_dp4_tp2', *QWEN3, *QWEN3_MESHES['single'])
  _, _, run = build(config)
  shapes = {p.path: p.shape for p in run.layout}
  assert shapes['blocks.0.attn.q_norm_K'] == shapes['blocks.0.attn.k_norm_K'] == (32,)
  assert report.param_count(config) == sum(math.prod(shape) for shape in shapes.values())
  decays = {path.removesuffix('.value'): bool(d)
            for path, d in flat(decay_mask(run.abstract_state.params)).items()}
  assert not decays['blocks.0.attn.q_norm_K'] and not decays['blocks.0.attn.k_norm_K']


def test_the_memory_plan_counts_the_scores_its_blocks_of_queries_keep():
  """In blocks of 16 of the 64 queries the einsum scores 5/8 of the (L, L) matrix; the plan's drop is the
  drop of the saved residuals (global float32 values, split over data 4 x model 2)."""
  saved, plan = {}, {}
  for block in (64, 16):
    saved[block] = sum(n for n, _ in _saved_residuals(f'model.attention_block={block}'))
    run = build_run(load_config('dp4_tp2', 'data.source=synthetic', 'model.num_layers=3',
                                f'model.attention_block={block}'))
    plan[block] = report.activation_bytes(run.config, run.rules, run.mesh)
  assert plan[64] - plan[16] == pytest.approx((saved[64] - saved[16]) * 4 / 8, rel=0.01)  # 1.18 MB.
