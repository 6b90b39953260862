"""Mixture of experts: routing and capacity, the same losses on expert-parallel meshes, all-to-all
dispatch, routing statistics in the metrics, FLOPs, and the config's checks."""

import functools
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, build, load_config, mesh_devices, quiet, script_env

from mintrain import loop as train_loop
from mintrain import report, train_state
from mintrain.data import tokenizer
from mintrain.data.batches import make_batches
from mintrain.errors import ConfigError
from mintrain.mesh import make_mesh
from mintrain.models.transformer import config as transformer_config
from mintrain.models.transformer import grouped, moe
from mintrain.objectives.lm import loss as loss_fn
from mintrain.optimizer import schedule
from mintrain.partitioning import AxisRules
from mintrain.train_step import make_train_step

# One block whose MLP has 4 experts, 2 per token; 8 rows of 16 tokens.
TINY = ('model.num_experts=4', 'model.experts_per_token=2', 'model.expert_mlp_dim=64', 'model.num_layers=1',
        'train.seq_len=16', 'train.global_batch_size=8', 'train.steps=3', 'train.log_every=1')
MESHES = {
    'single': ('mesh.data=1', 'mesh.fsdp=1', 'mesh.expert=1', 'mesh.model=1'),
    'expert4_data2': ('mesh.data=2', 'mesh.fsdp=1', 'mesh.expert=4', 'mesh.model=1'),
    'expert2_model2_fsdp2': ('mesh.data=1', 'mesh.fsdp=2', 'mesh.expert=2', 'mesh.model=2'),
    # The sequence split too: MoE layers gather it (capacity is per sequence), attention splits it.
    'expert2_context2_model2': ('mesh.data=1', 'mesh.fsdp=1', 'mesh.expert=2', 'mesh.context=2',
                                'mesh.model=2'),
}
NO_DROPS = 'model.capacity_factor=2.0'  # C = ceil(2 * 16 * 2 / 4) = 16 = L: no choice can be dropped.
SMALL = 'model.capacity_factor=0.5'  # C = 4 slots per expert for 32 choices per sequence.


def run(mesh, *overrides):
  config = load_config('moe_ep4_dp2', *TINY, *MESHES[mesh], *overrides)
  return train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet)


@functools.cache
def step_metrics(mesh, *overrides):
  """The metrics of one train step, and its compiled text (cached: several tests read the same step)."""
  config = load_config('moe_ep4_dp2', *TINY, *MESHES[mesh], *overrides)
  mesh_ = make_mesh(config.mesh.sizes, mesh_devices(config))
  setup = build(config)
  with jax.set_mesh(mesh_):
    step = make_train_step(setup.graphdef, setup.tx, schedule(config.optimizer, 4), use_dropout=False)
    rules = AxisRules.from_config(config.partitioning)
    batch = next(make_batches(config, mesh_, rules, tokenizer.load(config.data.tokenizer)))
    compiled = step.lower(setup.abstract_state, batch).compile()
    _, metrics = compiled(setup.init(), batch)
  return {k: float(v) for k, v in metrics.items()}, compiled.as_text()


def test_top_k_router_renormalises_the_chosen_probabilities_only_when_asked():
  logits = jnp.log(jnp.array([[[0.1, 0.2, 0.3, 0.4]]]))
  probs, weights, experts = moe.route(logits, 2, norm_topk=True)
  np.testing.assert_allclose(probs[0, 0], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
  assert experts[0, 0].tolist() == [3, 2]
  np.testing.assert_allclose(weights[0, 0], [4 / 7, 3 / 7], rtol=1e-6)  # Softmax over the top-k logits.
  np.testing.assert_allclose(moe.route(logits, 2, norm_topk=False)[1][0, 0], [0.4, 0.3], rtol=1e-6)


def test_slots_fill_first_choices_in_position_order_then_second_choices():
  # One sequence of 3 tokens, 2 choices each, over 3 experts with 2 slots each.
  experts = jnp.array([[[0, 1], [0, 2], [0, 1]]])
  slot, kept = moe.slots(experts, num_experts=3, cap=2)
  # Expert 0: first choices of tokens 0, 1 fill it; token 2's first choice is dropped.
  # Expert 1: token 0's second choice, then token 2's. Expert 2: token 1's second choice.
  assert slot[0].tolist() == [[0, 2], [1, 4], [2, 3]]
  assert kept[0].tolist() == [[True, True], [True, True], [False, True]]


def test_capacity_is_the_factor_times_the_even_share_and_dropless_is_the_whole_sequence():
  assert moe.capacity(16, 4, 2, 1.0) == 8
  assert moe.capacity(16, 8, 2, 1.25) == 5
  assert moe.capacity(16, 4, 2, 0.0) == 16
  assert moe.capacity(16, 4, 2, 3.0) == 16


# Three steps of training, in the slow set: both kernels and the slot path, a capacity that drops nothing,
# every expert mesh and the sequence split over `context`. The default suite compares one step's loss,
# statistics and gradients on the expert split (test_dropless_grouped_experts_give_the_slot_paths_...).
INVARIANCE_SLOW = [('dropless', 'expert4_data2'), ('capacity', 'expert2_context2_model2'),
                   ('dropless', 'expert2_model2_fsdp2'),
                   ('dropless', 'expert2_context2_model2'), ('dropless_ragged_dot', 'expert4_data2'),
                   ('dropless_slots', 'expert4_data2'), ('capacity', 'expert4_data2'),
                   ('capacity', 'expert2_model2_fsdp2')]
MODES = {'dropless': (), 'dropless_ragged_dot': ('model.grouped_matmul=ragged_dot',),
         'dropless_slots': ('model.grouped_matmul=off',), 'capacity': (NO_DROPS,)}


@pytest.mark.slow
@pytest.mark.parametrize('capacity,mesh', INVARIANCE_SLOW)
def test_losses_on_expert_meshes_equal_one_device_in_every_mode(capacity, mesh):
  overrides = MODES[capacity]
  single = run('single', *overrides)
  assert len(single.losses) == 3
  logged = [r['moe_dropped_fraction'] for r in single.records if 'moe_dropped_fraction' in r]
  assert logged == [0.0] * 3  # The routing statistics reach the logged metrics; nothing was dropped.
  np.testing.assert_allclose(run(mesh, *overrides).losses, single.losses, rtol=1e-4)


@pytest.mark.slow  # ~15 s: the default suite time; the capacity path's invariance stays in the default set.
def test_a_small_capacity_drops_choices_reports_them_and_stays_mesh_invariant():
  single, _ = step_metrics('single', SMALL)
  sharded, _ = step_metrics('expert4_data2', SMALL)
  # 4 slots per expert for 32 choices per sequence: at least half of them are dropped.
  assert single['moe_dropped_fraction'] >= 0.5
  for key in single:
    if key.startswith('moe_') or key == 'loss':
      np.testing.assert_allclose(sharded[key], single[key], rtol=1e-4, err_msg=key)


def padded_batch(noise: int) -> dict[str, np.ndarray]:
  """8 rows of one document each, of 16 to 3 inputs, then padding (segment 0) filled with `noise`."""
  rng = np.random.default_rng(0)
  lengths = np.array([16, 12, 9, 5, 16, 3, 10, 7])[:, None]
  real_BL = np.arange(16)[None, :] < lengths
  tokens_BL = np.where(np.arange(17) <= lengths, rng.integers(0, 256, (8, 17)), noise).astype(np.int32)
  return {'inputs': tokens_BL[:, :-1], 'targets': tokens_BL[:, 1:], 'segment_ids': real_BL.astype(np.int32),
          'positions': np.where(real_BL, np.arange(16), 0).astype(np.int32),
          'target_weights': real_BL.astype(np.float32)}


def loss_statistics_and_grads(mesh, batch, *overrides):
  config = load_config('moe_ep4_dp2', *TINY, *MESHES[mesh], *(overrides or (SMALL,)))
  setup = build(config)
  rules = AxisRules.from_config(config.partitioning)
  with jax.set_mesh(make_mesh(config.mesh.sizes, mesh_devices(config))):
    layout = rules.activation_spec(('batch', 'length'))
    step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, setup.graphdef, b, None), has_aux=True))
    (_, (count, metrics)), grads = step(setup.init().params,
                                        {k: jax.device_put(v, layout) for k, v in batch.items()})
  grads = {train_state.path_str(p): np.asarray(g)
           for p, g in jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0]}
  return float(count), {k: float(v) for k, v in metrics.items()}, grads


@pytest.mark.slow  # ~22 s: the default suite's time; the dropless tiles test below pads its rows too.
def test_padding_takes_no_expert_slot_and_changes_neither_loss_statistics_nor_gradients():
  """With 4 slots per expert for 32 choices a sequence, padding that queued for slots would push real
  tokens' choices out, and what it holds would change the loss; it is not routed at all."""
  count, metrics, grads = loss_statistics_and_grads('single', padded_batch(noise=1))
  assert count == 78 and metrics['moe_dropped_fraction'] > 0.2
  for mesh in ('single', 'expert4_data2'):
    noisy_count, noisy_metrics, noisy_grads = loss_statistics_and_grads(mesh, padded_batch(noise=77))
    assert noisy_count == count and noisy_metrics.keys() == metrics.keys()
    for key, want in metrics.items():
      np.testing.assert_allclose(noisy_metrics[key], want, rtol=1e-5, err_msg=f'{mesh} {key}')
    for path, want in grads.items():
      np.testing.assert_allclose(noisy_grads[path], want, rtol=1e-4, atol=1e-6, err_msg=f'{mesh} {path}')


def test_routing_statistics_and_auxiliary_losses_are_in_the_metrics():
  metrics, _ = step_metrics('single', SMALL)
  model = load_config('moe_ep4_dp2', *TINY).model
  shares = [metrics[f'moe_expert_share_{e}'] for e in range(4)]
  assert math.isclose(sum(shares), 1.0, rel_tol=1e-5)
  assert math.isclose(metrics['moe_expert_load_max'], 4 * max(shares), rel_tol=1e-6)
  assert metrics['moe_load_balance_loss'] >= 1.0 - 1e-5  # E * sum f_e p_e, 1 only when balanced.
  assert metrics['moe_router_z_loss'] > 0
  weighted = (model.load_balance_loss_weight * metrics['moe_load_balance_loss']
              + model.router_z_loss_weight * metrics['moe_router_z_loss'])
  assert math.isclose(metrics['aux_loss'], weighted, rel_tol=1e-5)


@pytest.mark.slow
def test_auxiliary_losses_are_trained_on_with_their_weights():
  plain = run('single', 'model.router_z_loss_weight=0', 'model.load_balance_loss_weight=0').losses
  weighted = run('single', 'model.router_z_loss_weight=1', 'model.load_balance_loss_weight=1').losses
  assert plain[0] == weighted[0]  # `loss` is the cross-entropy; the weights change only the gradients.
  assert plain[1:] != weighted[1:]


def test_expert_parallel_step_dispatches_tokens_with_all_to_all():
  _, sharded = step_metrics('expert4_data2', SMALL)
  _, single = step_metrics('single', SMALL)
  # The tokens to their experts' devices and back, forward; the same again for the gradients.
  assert sharded.count('all-to-all(') >= 4
  assert 'all-to-all(' not in single


@pytest.mark.parametrize('router', ['softmax', 'sigmoid in groups'])
def test_the_router_chooses_on_each_devices_own_tokens(router):
  # XLA's partitioner gathers a split top-k's operand onto every device: the global batch's scores.
  groups = {} if router == 'softmax' else {'bias_E': jnp.linspace(0, 0.1, 8), 'groups': 4, 'group_topk': 2}
  logits_BLE = jax.random.normal(jax.random.key(0), (8, 16, 8))
  route = jax.jit(lambda x: moe.route(x, 2, norm_topk=True, **groups))
  expected = route(logits_BLE)
  mesh = make_mesh({'data': 2, 'expert': 4})
  with jax.set_mesh(mesh):
    split = jax.device_put(logits_BLE, jax.P(('data', 'expert')))
    compiled = route.lower(split).compile()
    got = compiled(split)
  assert 'all-gather' not in compiled.as_text()
  for a, b in zip(got, expected):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # ~12 s: the default suite's time; the dropless count's test below stays there.
def test_analytic_flops_count_active_experts_and_agree_with_xla():
  """With capacity factor 1 (L * k / E slots per expert), the experts compute exactly the active FLOPs;
  dispatch and combine are gathers and scatters, not matmuls. As in tests/test_flops.py, the rest XLA
  counts is elementwise work and the optimizer: 3.54e9 against the analytic 3.43e9 (3.3% over). Dropless
  (E x L slots: E / k = 2 times the active experts' FLOPs here) XLA counts 5.97e9, 1.74x."""
  from test_flops import xla_train_step_flops
  heavy = ('model.embed_dim=256', 'model.num_heads=4', 'model.head_dim=64', 'model.expert_mlp_dim=512',
           'model.vocab_size=256', 'model.num_layers=2', 'train.seq_len=64', 'train.global_batch_size=4',
           'data.source=synthetic')  # Any of the 256 ids (the byte tokenizer's BOS is a 257th).
  config = load_config('moe_ep4_dp2', *TINY, *MESHES['single'], *heavy, 'model.capacity_factor=1.0')
  analytic = report.train_flops_per_step(config, causal_half=False)
  # k = 2 active experts of width 512 cost one dense MLP of width 1024; the router adds D x E per layer.
  dense = load_config('single', *TINY[4:], *heavy, 'model.mlp_dim=1024')
  router = 3 * 2 * (2 * 256 * 4) * 4 * 64  # 3x forward, 2 layers, per token, 4 x 64 tokens.
  assert analytic == report.train_flops_per_step(dense, causal_half=False) + router
  xla = xla_train_step_flops(config)
  assert abs(xla / analytic - 1) < 0.10, (xla, analytic)


def test_param_count_counts_every_expert_and_the_shared_one():
  config = load_config('moe_ep4_dp2', *TINY, *MESHES['single'], 'model.shared_expert_dim=32',
                       'model.moe_every=2', 'model.num_layers=4')
  assert report.param_count(config) == sum(math.prod(p.shape) for p in build(config).layout)


@pytest.mark.slow
def test_moe_every_second_block_with_dense_blocks_between_trains_on_an_expert_mesh():
  single = run('single', 'model.moe_every=2', 'model.num_layers=2').losses
  sharded = run('expert2_model2_fsdp2', 'model.moe_every=2', 'model.num_layers=2').losses
  np.testing.assert_allclose(sharded, single, rtol=1e-4)
  config = load_config('moe_ep4_dp2', *TINY, 'model.moe_every=2', 'model.num_layers=2')
  paths = {p.path for p in build(config).layout}
  assert 'blocks.0.mlp.wi_gate_DF' in paths and 'blocks.1.mlp.wi_gate_EDF' in paths


def test_experts_split_over_the_expert_axis_in_the_sharding_report():
  layout = {p.path: p for p in build(load_config('moe_ep4_dp2', *TINY)).layout}
  info = layout['blocks.0.mlp.wi_gate_EDF']
  assert info.shape == (4, 128, 64) and info.shard_shape == (1, 128, 64)
  assert tuple(info.spec)[0] == 'expert'


@pytest.mark.slow
def test_scanned_moe_layers_give_the_same_losses():
  two = 'model.num_layers=2'
  scanned = run('expert4_data2', two, 'model.scan_layers=True').losses
  np.testing.assert_allclose(scanned, run('single', two).losses, rtol=1e-4)


@pytest.mark.parametrize('overrides,match', [
    (('model.experts_per_token=5',), 'experts_per_token=5 must be at most model.num_experts=4'),
    (('model.scan_layers=True', 'model.moe_every=2', 'model.num_layers=2'),
     'some are dense and some MoE. Set model.scan_layers'),
    (('model.dense_layers=(5,)',), r'model.dense_layers=\(5,\) names blocks \[5\] of a model with'),
    (('model.mlp_overlap=True',), 'mlp_overlap is for dense MLPs'),
])
def test_bad_moe_options_are_one_line_errors(overrides, match):
  with pytest.raises(ConfigError, match=match):
    load_config('moe_ep4_dp2', *TINY, *overrides)


def test_experts_that_do_not_split_over_the_mesh_name_the_fix():
  from mintrain.errors import PartitioningError
  with pytest.raises(PartitioningError, match=r'`expert` \(dim 0 of `blocks.0.mlp.wi_gate_EDF`, size 6\)'):
    build(load_config('moe_ep4_dp2', *TINY, 'model.num_experts=6'))


def test_a_batch_rule_that_leaves_out_the_expert_axis_names_the_rules_to_change():
  rules = ["partitioning.rules=[('batch', ('data', 'fsdp')), ('length', None), ('embed', None), "
           "('mlp', 'model'), ('heads', 'model'), ('kv', None), ('vocab', 'model'), ('expert', 'expert')]"]
  match = r'`batch` split over the mesh axes of `expert` \(expert\).*split `batch` over data x fsdp\.'
  with pytest.raises(ValueError, match=match):
    step_metrics.__wrapped__('expert4_data2', *rules)


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['full', 'save_matmuls'])
def test_rematerialised_moe_layers_give_the_same_losses(remat):
  np.testing.assert_allclose(run('expert4_data2', f'model.remat={remat}').losses, run('single').losses,
                             rtol=1e-4)


def per_row_mlp(x_RD, group_R, *w):
  return grouped.per_row_mlp(x_RD, group_R, *w, jax.nn.silu)


def random_expert_inputs(seed: int, rows: int, groups: int, d: int, f: int, scale: float):
  """Rows x_RD, their groups group_R (id `groups`: in no group) and each group's gate, up and down
  matrices, drawn at `scale`."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  x_RD = jax.random.normal(keys[0], (rows, d))
  group_R = jax.random.randint(keys[1], (rows,), 0, groups + 1)
  w = (jax.random.normal(keys[2], (groups, d, f)) * scale, jax.random.normal(keys[3], (groups, d, f)) * scale,
       jax.random.normal(keys[4], (groups, f, d)) * scale)
  return x_RD, group_R, w


@pytest.fixture
def mosaic_stand_in(monkeypatch):
  """The CPU taken for a Hopper GPU, with `grouped_matmul=mosaic_gpu`'s kernels (JAX's Mosaic GPU grouped
  matmuls, which run on GPUs only) replaced by XLA's ragged products, which compute what they do: this
  checks mintrain's VJP and wiring around them, not the kernels (benchmarks/gpu.py checks those on a GPU)."""
  monkeypatch.setattr(grouped, 'MOSAIC_GPU', grouped.XLA)
  monkeypatch.setattr(transformer_config, 'MOSAIC_GPU_DTYPES', {'gpu': ('bfloat16',),
                                                                'cpu': ('float32', 'bfloat16')})


@pytest.mark.parametrize('kernel,tile', [('ragged_dot', 0), ('tiles', 0), ('tiles', 8), ('tiles', 3),
                                         ('mosaic_gpu', 0)])
def test_grouped_matmul_gives_each_row_its_groups_mlp_values_and_gradients(kernel, tile, request):
  if kernel == 'mosaic_gpu':
    request.getfixturevalue('mosaic_stand_in')
  groups = 5
  x_RD, group_R, w = random_expert_inputs(0, rows=100, groups=groups, d=8, f=12, scale=1 / 3)

  def values_and_grads(mlp):  # One program each: eager, every primitive compiles on its own.
    def f(*args):
      return mlp(*args), jax.grad(lambda *a: jnp.sum(jnp.sin(mlp(*a))), argnums=(0, 1, 2, 3))(*args)
    return jax.jit(f)(x_RD, *w)

  got, grads = values_and_grads(
      lambda x_RD, *w: grouped.gated_mlp(x_RD, group_R, *w, jax.nn.silu, kernel=kernel, tile=tile))
  want, wanted = values_and_grads(lambda x_RD, *w: per_row_mlp(x_RD, group_R, *w))
  assert np.all(np.asarray(got)[np.asarray(group_R) == groups] == 0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for g, want in zip(grads, wanted):
    # Weight gradients sum over a group's rows in another order than the reference: an entry that cancels
    # to 0.016 keeps float32's rounding of its O(1) terms (1.2e-6 seen with ragged_dot on one CPU).
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


def test_every_product_of_the_tiles_kernel_and_its_gradient_compiles_into_a_fusion():
  """XLA:CPU runs a product left outside a fusion with Eigen, slower than its XNNPACK fusions and
  allocating at every call; the tiles' weight gradients are written so that none is left there."""
  x_RD, group_R, w = random_expert_inputs(0, rows=100, groups=5, d=8, f=12, scale=1.0)

  def loss(x_RD, *w):
    return jnp.sum(grouped.gated_mlp(x_RD, group_R, *w, jax.nn.silu, kernel='tiles', tile=8))

  lines = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x_RD, *w).compile().as_text().splitlines()
  products = [line for line in lines if ' dot(' in line]
  assert len(products) == 6  # Forward: gate/up and down; backward: dh, dx and the two weight gradients.
  assert all(line.lstrip().startswith('ROOT ') for line in products), [p for p in products if 'ROOT' not in p]


@pytest.mark.slow  # ~12 s each: the default suite's time; the float32 kernel test stays there.
@pytest.mark.parametrize('kernel', ['ragged_dot', 'tiles'])
def test_grouped_matmul_in_bfloat16_keeps_the_dtype_and_the_float32_values_to_its_precision(kernel):
  x_RD, group_R, w = random_expert_inputs(1, rows=64, groups=4, d=16, f=8, scale=1 / 4)

  def loss(mlp, x_RD, *w):
    return jnp.sum(jnp.sin(mlp(x_RD, *w)).astype(jnp.float32))

  def grouped_mlp(x_RD, *w):
    return grouped.gated_mlp(x_RD, group_R, *w, jax.nn.silu, kernel=kernel, tile=8)

  def reference(x_RD, *w):
    return per_row_mlp(x_RD, group_R, *w)

  low = [a.astype(jnp.bfloat16) for a in (x_RD, *w)]
  got = grouped_mlp(*low)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), reference(*[a.astype(jnp.float32) for a in low]),
                             rtol=3e-2, atol=3e-2)
  grads = jax.grad(functools.partial(loss, grouped_mlp), argnums=(0, 1, 2, 3))(*low)
  wanted = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2, 3))(
      *[a.astype(jnp.float32) for a in low])
  for g, want in zip(grads, wanted):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(g.astype(jnp.float32), want, rtol=5e-2, atol=5e-2)


def test_tiles_pad_each_group_to_whole_tiles_and_the_automatic_tile_bounds_the_buffers():
  plan_tiles = jax.jit(grouped.plan, static_argnums=(1, 2, 3))  # Eager, each primitive compiles alone.
  buffers = plan_tiles(jnp.zeros(100, jnp.int32), 5, 'tiles', 8).source_P
  assert buffers.shape == ((13 + 4) * 8,)  # ceil(100 / 8) tiles, and one partial per group.
  for rows, groups in ((1024, 8), (2048, 64), (16384, 16), (64, 4)):
    tile = grouped.tile_rows(rows, groups, 0)
    assert 8 <= tile <= 256 and tile & (tile - 1) == 0
    assert (groups - 1) * tile <= max(rows / 2, (groups - 1) * 8)  # At most half, or tiles of 8 rows.
  # The tile layout holds every row once, in its group's tiles.
  group_R = jnp.array([2, 0, 2, 2, 1, 3, 0, 2, 2], jnp.int32)  # 3: no group.
  plan = plan_tiles(group_R, 3, 'tiles', 2)
  source = np.asarray(plan.source_P).reshape(-1, 2)
  assert sorted(source[source < 9].tolist()) == [0, 1, 2, 3, 4, 6, 7, 8]  # The grouped rows, each once.
  assert np.asarray(group_R)[source[0, 0]] == 0 and np.asarray(plan.padded_R)[source[0, 0]] == 0
  assert np.asarray(plan.tile_end_G).tolist() == [1, 2, 5]  # 2, 1 and 5 rows: 1, 1 and 3 tiles.
  padded = np.asarray(plan.padded_R)
  grouped_rows = np.flatnonzero(np.asarray(group_R) < 3)
  assert (np.asarray(plan.source_P)[padded[grouped_rows]] == grouped_rows).all()  # Where padded_R says.


def test_the_slot_path_runs_in_bfloat16_and_gives_its_float32_values():
  # XLA:CPU could not run the experts' bfloat16 products with the experts between two free dimensions
  # (a bfloat16 run with a capacity, or grouped_matmul=off, died in its first step at the default model's
  # sizes; smaller ones ran).
  keys = jax.random.split(jax.random.PRNGKey(5), 6)
  b, length, d, f, e, k = 8, 16, 128, 64, 4, 2
  experts_BLA = jax.lax.top_k(jax.random.normal(keys[0], (b, length, e)), k)[1]
  slot_BLA, kept_BLA = moe.slots(experts_BLA, e, length, None)  # Dropless: every expert L slots.
  weights_BLA = jax.nn.softmax(jax.random.normal(keys[1], (b, length, k)), axis=-1)
  inputs = (jax.random.normal(keys[2], (b, length, d)), jax.random.normal(keys[3], (e, d, f)) / 8,
            jax.random.normal(keys[4], (e, d, f)) / 8, jax.random.normal(keys[5], (e, f, d)) / 8)
  cotangent_BLD = jax.random.normal(keys[1], (b, length, d))

  def layer(dtype, x_BLD, *w):
    y_BLD = moe._experts_local(x_BLD.astype(dtype), slot_BLA, kept_BLA, weights_BLA.astype(dtype),
                               *(a.astype(dtype) for a in w), num_experts=e, cap=length, expert_axes=(),
                               mlp_axes=(), activation=jax.nn.silu)
    return jnp.sum(y_BLD.astype(jnp.float32) * cotangent_BLD), y_BLD

  def values_and_grads(dtype):
    step = jax.jit(jax.value_and_grad(functools.partial(layer, dtype), argnums=(0, 1, 2, 3), has_aux=True))
    (_, y_BLD), grads = step(*inputs)
    return [y_BLD, *grads]
  got, want = values_and_grads(jnp.bfloat16), values_and_grads(jnp.float32)
  assert got[0].dtype == jnp.bfloat16
  for g, w in zip(got, want):  # Within a bfloat16's precision, as a whole.
    w = np.asarray(w)
    assert np.linalg.norm(np.asarray(g, np.float32) - w) < 2e-2 * np.linalg.norm(w) and w.any()


def test_a_gpu_runs_tiles_of_up_to_an_experts_even_share_and_only_a_tpu_runs_ragged_dot():
  # XLA makes ragged_dot a dense product masked per expert on CUDA; larger tiles won there (BENCHMARKS.md).
  assert grouped.tile_rows(32768, 8, 0, 'gpu') == 1024 and grouped.tile_rows(32768, 8, 0, 'cpu') == 256
  assert grouped.tile_rows(65536, 64, 0, 'gpu') == 1024 and grouped.tile_rows(65536, 64, 0, 'cpu') == 256
  assert grouped.tile_rows(100, 5, 0, 'gpu') == 16 and grouped.tile_rows(100, 5, 0, 'cpu') == 8
  assert grouped.tile_rows(100, 5, 24, 'gpu') == 24  # A tile the config names is kept.
  model = load_config('moe_ep4_dp2').model
  assert model.grouped_matmul == 'auto'
  chosen = {platform: model.for_platform(platform).grouped_matmul for platform in ('cpu', 'gpu', 'tpu')}
  assert chosen == {'cpu': 'tiles', 'gpu': 'tiles', 'tpu': 'ragged_dot'}


def test_mosaic_gpu_runs_on_gpus_in_bfloat16_only_and_is_never_chosen_by_auto():
  model = load_config('moe_ep4_dp2', 'model.grouped_matmul=mosaic_gpu').model
  with pytest.raises(ConfigError, match='Hopper GPUs.*this run is on cpu'):
    model.for_platform('cpu')
  with pytest.raises(ConfigError, match='bfloat16 only, not model.compute_dtype=float32'):
    model.for_platform('gpu')
  bf16 = load_config('moe_ep4_dp2', 'model.grouped_matmul=mosaic_gpu', 'model.compute_dtype=bfloat16').model
  assert bf16.for_platform('gpu').grouped_matmul == 'mosaic_gpu'
  auto = load_config('moe_ep4_dp2').model
  assert 'mosaic_gpu' not in {auto.for_platform(p).grouped_matmul for p in ('cpu', 'gpu', 'tpu')}


def test_mosaic_gpu_lowers_for_cuda_to_its_kernels_and_checks_the_widths_they_take():
  """Lowered for CUDA here (no GPU): the forward is two Mosaic GPU kernels, as is each product of the
  backward pass with the weights transposed. (The weight gradients' transposed kernel asks the GPU for its
  core count while it is traced, so it is lowered on a GPU only: benchmarks/gpu.py.)"""
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  rows, groups, d, f = 300, 4, 128, 256
  x_RD = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
  group_R = jax.random.randint(keys[1], (rows,), 0, groups + 1)
  shapes = [(groups, d, f)] * 2 + [(groups, f, d)]
  w = [jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(keys[2:], shapes)]

  def kernels(fn, *args) -> int:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).as_text().count('@mosaic_gpu')

  def forward(x_RD, *w):
    return grouped.gated_mlp(x_RD, group_R, *w, jax.nn.silu, kernel='mosaic_gpu')
  assert kernels(forward, x_RD, *w) == 2
  sizes_G = jnp.array([100, 100, 50, 25], jnp.int32)
  assert kernels(lambda dy, w: grouped.MOSAIC_GPU.dot(dy, w, sizes_G, True), x_RD, w[2]) == 1
  with pytest.raises(ConfigError, match='multiples of 128; got \\[64\\]'):
    kernels(forward, x_RD, w[0][..., :64], w[1][..., :64], w[2][:, :64])


SIGNALS_KEPT = """
import os, signal, sys, time
from mintrain.models.transformer import grouped
[getattr(m, '__file__', None) for m in list(sys.modules.values())]  # As inspect.getmodule, in torch's import.
assert 'jax._src.test_util' not in sys.modules, 'a scan of the modules loaded the Mosaic kernels'
stopped = []
signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
grouped.mosaic_kernels()  # JAX's test utilities come with them, and absl's failure signal handler.
assert 'jax._src.test_util' in sys.modules
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print('stopped' if stopped else 'not stopped')
"""


def test_the_mosaic_kernels_load_only_when_traced_and_leave_the_run_s_sigterm_handler_in_place():
  """A preempted run saves and exits 0 (tests/test_faults.py); the Mosaic kernels' import once put
  absl's failure signal handler in front of the run's, and runs that imported torch (Hugging Face data)
  loaded them without using them and died with SIGABRT after saving."""
  out = subprocess.run([sys.executable, '-c', SIGNALS_KEPT], cwd=REPO, env=script_env(), capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == 'stopped', out.stdout + out.stderr
  assert 'SIGTERM received' not in out.stderr, out.stderr


def dropless(kernel):
  return ('model.capacity_factor=0', f'model.grouped_matmul={kernel}')


# ragged_dot's and mosaic_gpu's model steps in the slow set (the default suite's time); their kernels are
# tested above.
@pytest.mark.parametrize('kernel', ['tiles', pytest.param('ragged_dot', marks=pytest.mark.slow),
                                    pytest.param('mosaic_gpu', marks=pytest.mark.slow)])
def test_dropless_grouped_experts_give_the_slot_paths_loss_statistics_and_gradients(kernel, request):
  """The same model and batch (with padding) through L slots per expert on one device, and through the
  grouped matmul on one device and with the experts split 4 ways (their choices sent by all-to-all)."""
  if kernel == 'mosaic_gpu':
    request.getfixturevalue('mosaic_stand_in')
  batch = padded_batch(noise=3)
  count, metrics, grads = loss_statistics_and_grads('single', batch, *dropless('off'))
  assert metrics['moe_dropped_fraction'] == 0
  for mesh, rtol in (('single', 1e-6), ('expert4_data2', 1e-5)):  # Split, sums add in another order.
    got_count, got_metrics, got_grads = loss_statistics_and_grads(mesh, batch, *dropless(kernel))
    assert got_count == count and got_metrics.keys() == metrics.keys()
    for key, want in metrics.items():
      np.testing.assert_allclose(got_metrics[key], want, rtol=rtol, err_msg=f'{mesh} {key}')
    for path, want in grads.items():
      np.testing.assert_allclose(got_grads[path], want, rtol=10 * rtol, atol=1e-7, err_msg=f'{mesh} {path}')


@pytest.mark.slow  # the default suite's time; test_moe_exchange checks the lowered step's all-to-alls
def test_dropless_experts_split_send_their_choices_by_all_to_all():
  exact, text = step_metrics('expert4_data2', *dropless('tiles'))
  _, single = step_metrics('single', *dropless('tiles'))
  # Rows, their experts and the outputs; the gradients of the outputs and of the rows.
  assert text.count('all-to-all(') >= 5 and 'all-to-all(' not in single
  assert exact['moe_dropped_fraction'] == 0
  assert 'all-gather' not in text  # Not the router's scores either (`moe.top_k`).


@pytest.mark.slow  # Two more compiles of the step: the default suite's time.
def test_a_bound_on_the_exchange_drops_and_reports_the_choices_past_it():
  exact, _ = step_metrics('expert4_data2', *dropless('tiles'))
  # Half the even share per peer: about half of the choices find no room and are reported.
  bounded, _ = step_metrics('expert4_data2', *dropless('tiles'), 'model.expert_exchange_factor=0.5')
  assert 0.3 < bounded['moe_dropped_fraction'] < 0.7 and bounded['loss'] != exact['loss']
  # A generous bound drops nothing and changes nothing.
  ample, _ = step_metrics('expert4_data2', *dropless('tiles'), 'model.expert_exchange_factor=4')
  assert ample['moe_dropped_fraction'] == 0
  np.testing.assert_allclose(ample['loss'], exact['loss'], rtol=1e-6)


def test_dropless_analytic_flops_count_routed_choices_as_a_capacity_of_one_computes_them():
  """The analytic count of a dropless step is that of capacity factor 1, whose E x C = L x k slots compute
  exactly the routed choices, within 10% of XLA's count (test_analytic_flops_...). XLA's cost analysis
  counts a loop's body once, so it cannot count `tiles`' tiles; step time shows their work
  (BENCHMARKS.md, benchmarks/moe.py)."""
  heavy = ('model.num_experts=8', 'model.expert_mlp_dim=512', 'train.seq_len=128')
  dropless_flops = report.train_flops_per_step(load_config('moe_ep4_dp2', *TINY, *heavy, *dropless('tiles')))
  slots = load_config('moe_ep4_dp2', *TINY, *heavy, 'model.capacity_factor=1.0', 'model.grouped_matmul=off')
  assert moe.capacity(128, 8, 2, 1.0) * 8 == 128 * 2
  assert dropless_flops == report.train_flops_per_step(slots)
