"""The dropless experts' exchange: ragged (`jax.lax.ragged_all_to_all`) or padded (`all_to_all`), chosen by
platform. XLA:CPU has no ragged-all-to-all, so the ragged path runs here on an emulation of it, tested
against the collective's documented semantics; the real collective is only lowered, not run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import build, load_config, mesh_devices
from jax.sharding import PartitionSpec as P
from test_moe import MESHES, TINY, loss_statistics_and_grads, padded_batch

from mintrain.errors import ConfigError
from mintrain.mesh import make_mesh
from mintrain.models.transformer import config as transformer_config
from mintrain.models.transformer import moe
from mintrain.objectives.lm import loss as loss_fn
from mintrain.partitioning import AxisRules

DROPLESS = ('model.capacity_factor=0', 'model.grouped_matmul=tiles')
RAGGED, PADDED = 'model.expert_exchange=ragged', 'model.expert_exchange=padded'


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
  """A mock of the accelerators' `jax.lax.ragged_all_to_all` for XLA:CPU, which has none, from all_gather
  and selects, as its docstring's pseudocode: slice i of the K goes to device i // (K / devices), and lands
  in the receiver's `output` at the offset its *sender* gave (`output_offsets` index the receiver's buffer),
  `recv_sizes[i]` rows of it, later slices over earlier ones."""
  operand_S, input_offsets_SK, output_offsets_SK = (jax.lax.all_gather(x, axis_name)
                                                    for x in (operand, input_offsets, output_offsets))
  devices, slices = input_offsets_SK.shape
  per_device = slices // devices
  me, rows_M = jax.lax.axis_index(axis_name), jnp.arange(output.shape[0])
  result = output
  for i in range(slices):  # Slice i of what this device receives: its sender's slice for this device.
    sender, sent = i // per_device, me * per_device + i % per_device
    start, size = output_offsets_SK[sender, sent], recv_sizes[i]
    source_M = jnp.clip(input_offsets_SK[sender, sent] + rows_M - start, 0, operand.shape[0] - 1)
    written_M = (rows_M >= start) & (rows_M < start + size)
    written_M = written_M.reshape(-1, *(1,) * (output.ndim - 1))
    result = jnp.where(written_M, operand_S[sender][source_M], result)
  return result


@pytest.fixture
def emulated(monkeypatch):
  """The CPU taken for a platform with ragged-all-to-all, the collective emulated."""
  monkeypatch.setattr(moe, 'ragged_all_to_all', emulated_ragged_all_to_all)
  monkeypatch.setattr(transformer_config, 'RAGGED_EXCHANGE_PLATFORMS', ('cpu', 'gpu', 'tpu'))


def on_devices(fn, mesh_shape, axes, *args):
  """`fn` inside shard_map over the first devices, each argument split over all `axes` on its rows."""
  mesh = jax.make_mesh(mesh_shape, axes, devices=jax.devices()[:int(np.prod(mesh_shape))],
                       axis_types=(jax.sharding.AxisType.Explicit,) * len(axes))
  with jax.set_mesh(mesh):
    args = [jax.device_put(jnp.asarray(a), P(axes)) for a in args]
    return np.asarray(jax.jit(jax.shard_map(fn, in_specs=P(axes), out_specs=P(axes)))(*args))


def test_emulation_gives_the_docstrings_example():
  """jax.lax.ragged_all_to_all's own example: output_offsets place the sent slices in the receiver."""
  def exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    return emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                      axis_name=('x',))

  got = on_devices(exchange, (2,), ('x',), [1, 2, 2, 3, 4, 0], np.zeros(8, np.int32), [0, 1, 0, 1],
                   [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1])
  assert got.tolist() == [1, 3, 0, 0, 2, 2, 4, 0]


@pytest.mark.parametrize('mesh_shape,axes', [((4,), ('e',)), ((2, 2), ('a', 'b'))])
def test_emulation_of_whole_blocks_equals_the_padded_all_to_all(mesh_shape, axes):
  """Each device sends peer j its j-th block of c rows, to the place of the sender's block there: the
  tiled all_to_all, over one mesh axis and over two (the devices in the same order)."""
  devices, c = int(np.prod(mesh_shape)), 3
  x = jax.random.normal(jax.random.PRNGKey(0), (devices * devices * c, 5))

  def both(x_RD):
    me = jax.lax.axis_index(axes)
    blocks_P = jnp.arange(devices, dtype=jnp.int32) * c
    sizes_P = jnp.full((devices,), c, jnp.int32)
    ragged = emulated_ragged_all_to_all(x_RD, jnp.zeros_like(x_RD), blocks_P, sizes_P,
                                        jnp.full((devices,), me * c, jnp.int32), sizes_P, axis_name=axes)
    return jnp.stack([ragged, jax.lax.all_to_all(x_RD, axes, 0, 0, tiled=True)])

  ragged, padded = on_devices(both, mesh_shape, axes, x).reshape(devices, 2, -1, 5).swapaxes(0, 1)
  np.testing.assert_array_equal(ragged, padded)
  assert not np.array_equal(padded, np.asarray(x).reshape(devices, -1, 5))  # Rows did move.


def test_ragged_exchange_brings_each_choice_its_experts_output_and_zeros_past_the_bound():
  """4 devices of 2 experts each; an MLP that scales a row by its expert (local id + 1) and by its
  receiver (+ 1) shows that each choice went to its expert on its device, and came back to its place."""
  devices, local, n, bound = 4, 2, 24, 5
  expert_SN = jax.random.randint(jax.random.PRNGKey(1), (devices, n), 0, devices * local + 1)  # 8: none.
  expert_SN = jnp.sort(expert_SN, axis=1)
  x_SND = jax.random.normal(jax.random.PRNGKey(2), (devices, n, 3))

  def exchange(x_ND, expert_N):
    def mlp(x_RD, group_R):
      scale_R = jnp.where(group_R < local, (group_R + 1) * 10 + jax.lax.axis_index('e') + 1, 0)
      return x_RD * scale_R[:, None]
    return moe._ragged_exchange(x_ND, expert_N, mlp, local=local, ep=devices, bound=bound, axes=('e',))

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(moe, 'ragged_all_to_all', emulated_ragged_all_to_all)
    y_SND = on_devices(exchange, (devices,), ('e',), x_SND.reshape(-1, 3), expert_SN.reshape(-1))
  y_SND = y_SND.reshape(devices, n, 3)
  expert_SN, x_SND = np.asarray(expert_SN), np.asarray(x_SND)
  peer_SN = expert_SN // local
  place_SN = np.array([[np.sum(row[:i] == row[i]) for i in range(n)] for row in peer_SN])  # In its run.
  kept_SN = (peer_SN < devices) & (place_SN < bound)
  want_SND = x_SND * np.where(kept_SN, (expert_SN % local + 1) * 10 + peer_SN + 1, 0)[..., None]
  np.testing.assert_allclose(y_SND, want_SND, rtol=1e-6)
  assert 0 < np.sum(kept_SN) < np.sum(peer_SN < devices)  # The bound cut some runs, and not all.


def test_a_peer_is_sent_at_most_the_factor_times_the_even_share_and_never_more_than_it_takes():
  assert moe.peer_bound(tokens=64, k=2, local=1, ep=4, exchange=0) == 64  # One expert: a token's one row.
  assert moe.peer_bound(tokens=64, k=2, local=2, ep=4, exchange=0) == 128  # All of its choices.
  assert moe.peer_bound(tokens=64, k=2, local=2, ep=4, exchange=0.5) == 16  # Half of 128 / 4.
  assert moe.peer_bound(tokens=64, k=2, local=1, ep=4, exchange=8) == 64


def check_ragged_equals_one_device(mesh):
  batch = padded_batch(noise=3)
  count, metrics, grads = loss_statistics_and_grads('single', batch, *DROPLESS)
  got_count, got_metrics, got_grads = loss_statistics_and_grads(mesh, batch, *DROPLESS, RAGGED)
  assert got_count == count and got_metrics.keys() == metrics.keys() and metrics['moe_dropped_fraction'] == 0
  for key, want in metrics.items():
    np.testing.assert_allclose(got_metrics[key], want, rtol=1e-5, err_msg=key)
  for path, want in grads.items():
    np.testing.assert_allclose(got_grads[path], want, rtol=1e-4, atol=1e-6, err_msg=path)


@pytest.mark.slow  # the default suite's time; the layer test below compares the exchanges there
@pytest.mark.usefixtures('emulated')
def test_ragged_exchange_on_expert4_data2_gives_one_devices_loss_statistics_and_gradients():
  check_ragged_equals_one_device('expert4_data2')


@pytest.mark.slow  # A second mesh's step, as test_moe's dropless expert2_model2_fsdp2.
@pytest.mark.usefixtures('emulated')
def test_ragged_exchange_on_expert2_model2_fsdp2_gives_one_devices_loss_statistics_and_gradients():
  check_ragged_equals_one_device('expert2_model2_fsdp2')


def layer(ragged: bool, exchange: float):
  """The dropless layer's part inside shard_map over 4 devices of 2 experts each, as a function of the
  tokens and the experts' weights: 8 sequences of 6 tokens, 2 choices each, the last token of every other
  sequence padding. Call it under `FOUR`, with its arguments split over `e`."""
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  experts_BLA = jax.lax.top_k(jax.random.normal(keys[0], (8, 6, 8)), 2)[1]
  routed_BLA = jnp.broadcast_to((jnp.arange(6) < 5)[None, :, None] | (jnp.arange(8) % 2 == 0)[:, None, None],
                                experts_BLA.shape)
  weights_BLA = jax.nn.softmax(jax.random.normal(keys[1], (8, 6, 2)), axis=-1)
  routing = [jax.device_put(a, P('e')) for a in (experts_BLA, routed_BLA, weights_BLA)]
  local = functools.partial(moe._grouped_local, num_experts=8, expert_axes=('e',), mlp_axes=(),
                            kernel='tiles', tile=0, platform='cpu', exchange=exchange, ragged=ragged,
                            activation=jax.nn.silu)
  body = jax.shard_map(local, in_specs=P('e'), out_specs=P('e'))
  return lambda x_BLD, *weights: body(x_BLD, *routing, *weights)


FOUR = jax.make_mesh((4,), ('e',), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Explicit,))


def layer_outputs_and_gradients(ragged: bool, exchange: float, inputs) -> tuple:
  """(y_BLD, kept_BLA, the gradients of sum(sin(y)) for the tokens and the three weights)."""
  with jax.set_mesh(FOUR):
    f = layer(ragged, exchange)
    inputs = [jax.device_put(a, P('e')) for a in inputs]

    def loss(*args):
      y_BLD, kept_BLA = f(*args)
      return jnp.sum(jnp.sin(y_BLD)), (y_BLD, kept_BLA)

    (_, (y_BLD, kept_BLA)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*inputs)
    return y_BLD, kept_BLA, grads


@pytest.mark.parametrize('exchange', [pytest.param(0.0, marks=pytest.mark.slow), 0.5])
def test_ragged_and_padded_exchanges_give_a_layer_the_same_outputs_drops_and_gradients(exchange, monkeypatch):
  """Exact (0) both keep every routed choice; at half the even share per peer both drop the same ones."""
  monkeypatch.setattr(moe, 'ragged_all_to_all', emulated_ragged_all_to_all)
  keys = jax.random.split(jax.random.PRNGKey(4), 4)
  inputs = (jax.random.normal(keys[0], (8, 6, 16)), jax.random.normal(keys[1], (8, 16, 32)) / 4,
            jax.random.normal(keys[2], (8, 16, 32)) / 4, jax.random.normal(keys[3], (8, 32, 16)) / 6)
  y_ragged, kept_ragged, grads_ragged = layer_outputs_and_gradients(True, exchange, inputs)
  y_padded, kept_padded, grads_padded = layer_outputs_and_gradients(False, exchange, inputs)
  routed = 8 * 6 * 2 - 4 * 2  # Four sequences end in a padding token.
  assert np.sum(kept_ragged) == routed if exchange == 0 else 0 < np.sum(kept_ragged) < routed
  np.testing.assert_array_equal(kept_ragged, kept_padded)
  np.testing.assert_allclose(y_ragged, y_padded, rtol=1e-5, atol=1e-6)
  for ragged, padded in zip(grads_ragged, grads_padded):
    np.testing.assert_allclose(ragged, padded, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # Two more steps compiled; the layer's test above checks the same drops in the default set.
@pytest.mark.usefixtures('emulated')
def test_a_bound_drops_and_reports_the_same_choices_on_the_ragged_and_the_padded_exchange():
  batch, bound = padded_batch(noise=3), 'model.expert_exchange_factor=0.5'
  _, padded, padded_grads = loss_statistics_and_grads('expert4_data2', batch, *DROPLESS, bound, PADDED)
  _, ragged, ragged_grads = loss_statistics_and_grads('expert4_data2', batch, *DROPLESS, bound, RAGGED)
  assert 0.2 < ragged['moe_dropped_fraction'] < 0.8  # Half the even share per peer: many find no room.
  for key, want in padded.items():
    np.testing.assert_allclose(ragged[key], want, rtol=1e-5, err_msg=key)
  for path, want in padded_grads.items():
    np.testing.assert_allclose(ragged_grads[path], want, rtol=1e-4, atol=1e-6, err_msg=path)


def lowered_step(*overrides) -> str:
  """The text of the loss and gradient step, lowered (not compiled) for the 8 CPU devices."""
  config = load_config('moe_ep4_dp2', *TINY, *MESHES['expert4_data2'], *DROPLESS, *overrides)
  setup = build(config)
  rules = AxisRules.from_config(config.partitioning)
  batch = padded_batch(noise=3)
  with jax.set_mesh(make_mesh(config.mesh.sizes, mesh_devices(config))):
    layout = rules.activation_spec(('batch', 'length'))
    step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, setup.graphdef, b, None), has_aux=True))
    return step.lower(setup.abstract_state.params, {k: jax.device_put(v, layout) for k, v in batch.items()}
                      ).as_text()


def test_the_ragged_step_lowers_to_ragged_all_to_alls_and_the_padded_one_to_all_to_alls(monkeypatch):
  """The real collective, as the GPU and TPU get it: there and back, and the same twice for the gradients."""
  monkeypatch.setattr(transformer_config, 'RAGGED_EXCHANGE_PLATFORMS', ('cpu', 'gpu', 'tpu'))
  ragged, padded = lowered_step(RAGGED), lowered_step(PADDED)
  assert ragged.count('@ragged_all_to_all') == 4
  assert 'ragged_all_to_all' not in padded and padded.count('all_to_all') >= 5


@pytest.mark.parametrize('overrides,match', [
    ((RAGGED,), r"model.expert_exchange=ragged needs jax.lax.ragged_all_to_all, which XLA does not implement "
                r"on cpu; use 'padded' or 'auto'"),
    (('model.expert_exchange=sparse',), 'model.expert_exchange'),
])
def test_bad_exchange_options_are_one_line_errors(overrides, match):
  with pytest.raises(ConfigError, match=match):
    build(load_config('moe_ep4_dp2', *TINY, *overrides))


def test_auto_exchange_is_ragged_on_gpu_and_tpu_and_padded_on_cpu():
  model = load_config('moe_ep4_dp2', *TINY).model
  assert model.expert_exchange == 'auto'
  assert {p: model.for_platform(p).expert_exchange for p in ('cpu', 'gpu', 'tpu')} == {
      'cpu': 'padded', 'gpu': 'ragged', 'tpu': 'ragged'}
