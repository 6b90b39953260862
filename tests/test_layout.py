"""Every parameter of every config lands in the layout the default rules promise."""

import pathlib

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, build, load_config, mesh_devices, spec_entries
from jax.sharding import PartitionSpec as P

from mintrain import configs, train_state
from mintrain.errors import PartitioningError
from mintrain.mesh import devices_needed, make_mesh
from mintrain.report import format_report

# Storage layout under the default rules, written out by hand per logical-axes tuple.
EXPECTED = {
    ('vocab', 'embed'): P('model', 'fsdp'),
    ('embed', 'vocab'): P('fsdp', 'model'),  # An untied output projection (bench_tiny).
    ('embed',): P('fsdp'),
    ('embed', 'heads', 'kv'): P('fsdp', 'model', None),
    ('heads', 'kv', 'embed'): P('model', None, 'fsdp'),
    ('embed', 'mlp'): P('fsdp', 'model'),
    ('mlp', 'embed'): P('model', 'fsdp'),
    ('mlp', 'classes'): P('model', None),
    ('mlp',): P('model'),
    ('classes',): P(None),
    ('embed', None): P('fsdp'),  # An MoE router (its experts' dimension whole on every device).
    ('expert', 'embed', 'mlp'): P('expert', 'fsdp', 'model'),  # MoE experts.
    ('expert', 'mlp', 'embed'): P('expert', 'model', 'fsdp'),
    ('embed', 'kv_heads', 'kv'): P('fsdp', 'model', None),  # Grouped keys and values (qwen3_dp4_tp2).
    ('kv',): P(None),  # QK-norm scales over head_dim.
    ('embed', None, 'kv'): P('fsdp', None, None),  # One key/value head, replicated (gemma3_dp4_tp2).
    # Latent attention (deepseek_v3_ep4_dp2): low-rank widths stored over `fsdp` where `embed` is not.
    ('embed', 'latent'): P('fsdp', None),
    ('latent',): P('fsdp'),
    ('latent', 'heads', 'kv'): P('fsdp', 'model', None),
    (None,): P(None),  # A sigmoid router's balancing bias.
}


def expected_spec(logical_axes: tuple) -> P:
  """Stacked layers (pp2_dp2_tp2) put their leading `layers` dimension on `stage`, the rest as one layer."""
  if logical_axes[:1] == ('layers',):
    return P('stage', *EXPECTED[logical_axes[1:]])
  return EXPECTED[logical_axes]
# The shipped configs that fit the tests' 8 devices and host; a plan for more (mixtral_8x7b_256: 256 devices)
# is laid out by show_sharding.py under several processes in tests/test_scripts.py, and a model sized for an
# accelerator (llama3_1b: 1.2B parameters, 20 GB with its optimizer state) by benchmarks/gpu.py's smoke test.
CONFIGS = sorted(p.stem for p in (configs.DIR).glob('*.py') if p.stem not in ('base', '__init__')
                 and devices_needed(load_config(p.stem).mesh.sizes) <= 8
                 and load_config(p.stem).model.param_count() < 10**8)


def test_every_shipped_config_is_covered():
  shipped = {'single', 'dp8', 'dp4_tp2', 'tp8', 'fsdp8', 'fsdp4_tp2', 'mlp_dp4_tp2', 'moe_ep4_dp2',
             'qwen3_moe_ep4_dp2', 'deepseek_v3_ep4_dp2', 'pp2_dp2_tp2'}
  assert shipped <= set(CONFIGS)


# The new families' small configs draw more parameters: their layouts are checked in the slow set.
SLOW_LAYOUTS = ('gemma3_dp4_tp2', 'deepseek_v3_ep4_dp2', 'qwen3_moe_ep4_dp2', 'pp2_dp2_tp2', 'bench_tiny',
                'qwen3_dp4_tp2')


@pytest.mark.parametrize('name', [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_LAYOUTS else [])
                                  for n in CONFIGS])
def test_initialised_params_have_the_expected_sharding(name):
  config = load_config(name)
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  setup = build(config)
  with jax.set_mesh(mesh):
    state = setup.init()
  infos = {info.path: info for info in setup.layout}
  flat = {train_state.path_str(path): var for path, var in nnx.to_flat_state(state.params)}
  assert set(flat) == set(infos)
  for path, var in flat.items():
    info = infos[path]
    sharding = jax.typeof(var[...]).sharding
    assert spec_entries(sharding.spec) == spec_entries(expected_spec(info.logical_axes)), path
    assert sharding.mesh.shape == mesh.shape
    assert var[...].addressable_shards[0].data.shape == info.shard_shape, path


def test_optimizer_state_is_sharded_like_the_params():
  config = load_config('fsdp4_tp2')
  setup = build(config)
  params = jax.tree.leaves(setup.abstract_state.params)
  param_specs = [spec_entries(jax.typeof(x).sharding.spec) for x in params]
  adam = setup.abstract_state.opt_state[1][0]
  for moment in (adam.mu, adam.nu):
    assert [spec_entries(x.sharding.spec) for x in jax.tree.leaves(moment)] == param_specs


def test_layout_and_report_allocate_nothing():
  config = load_config('dp4_tp2')
  mesh = make_mesh(config.mesh.sizes)
  before = len(jax.live_arrays())
  setup = build(config)
  report = format_report(setup.layout, setup.abstract_state, mesh)
  assert len(jax.live_arrays()) == before
  assert 'blocks.0.mlp.wi_gate_DF' in report and '(fsdp, model)' in report
  assert 'optimizer state' in report


def test_report_totals_match_per_parameter_bytes():
  config = load_config('fsdp8')
  setup = build(config)
  for info in setup.layout:  # Every parameter has an `embed` dimension, split 8 ways at rest.
    assert 'embed' in info.logical_axes
    assert info.bytes_per_device * 8 == np.prod(info.shape) * 4, info.path
  assert train_state.state_bytes_per_device(setup.abstract_state.params) == sum(
      i.bytes_per_device for i in setup.layout)


def test_indivisible_dimension_fails_before_compiling_and_names_the_parameter():
  config = load_config('tp8', 'model.mlp_dim=500')
  with pytest.raises(PartitioningError, match=r'`mlp` \(dim 1 of `blocks.0.mlp.wi_gate_DF`, size 500\)'):
    build(config)


def test_batch_that_does_not_split_over_the_batch_axes_is_an_error():
  from mintrain.errors import ConfigError
  config = load_config('dp8', 'train.global_batch_size=12')
  with pytest.raises(ConfigError, match=r'micro-batch of 12.*`data` x `fsdp` x `expert` = 8 devices'):
    build(config)


def test_configs_do_not_name_parameters_and_models_do_not_name_mesh_axes():
  models = pathlib.Path(REPO / 'mintrain' / 'models')
  for source in models.glob('*.py'):
    text = source.read_text()
    for axis in ("'data'", "'fsdp'", "'model'"):
      assert axis not in text, f'{source.name} names mesh axis {axis}'
