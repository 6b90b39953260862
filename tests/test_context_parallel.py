"""Context parallelism (`mesh.context`): with the sequence split over devices, the loss, the gradients, the
logits and sampling are those of one device, with keys and values gathered (`all_gather`) or passed round
a ring (`ring`), also on packed rows of several documents; the ring equals the gathered path; a length the
split does not divide is a config error."""

import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import build, convert_layers, fill, load_config

from mintrain import report, train_state
from mintrain.data import segments, tokenizer
from mintrain.data.batches import make_batches
from mintrain.errors import ConfigError
from mintrain.mesh import make_mesh
from mintrain.models.transformer import sampling
from mintrain.models.transformer.context_attention import ring_attention, visible, zigzag_order
from mintrain.objectives.lm import loss as loss_fn

SMALL = (*helpers.SMALL, 'model.vocab_size=128', 'data.source=synthetic', 'train.global_batch_size=8')
MESHES = {  # Meshes with `context`, beside the config file's data 2 x context 2 x model 2.
    'cp2_dp2_tp2': ('cp2_dp2_tp2',),
    'cp8': ('single', 'mesh.context=8'),
    'cp4_tp2': ('single', 'mesh.context=4', 'mesh.model=2'),
    'fsdp2_cp2_tp2': ('fsdp4_tp2', 'mesh.fsdp=2', 'mesh.context=2'),
}


def small(name, *overrides):
  base, *mesh = MESHES.get(name, (name,))
  return load_config(base, *SMALL, *mesh, *overrides)


def host(tree) -> dict:
  """Arrays on the host by path, stacked blocks split into layers."""
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
  return convert_layers({train_state.path_str(p): np.asarray(x) for p, x in flat}, to_scanned=False)


@pytest.fixture(scope='module')
def host_params():
  config = small('single')
  run = build(config)
  with jax.set_mesh(run.mesh):
    return host(run.init().params)


def on_mesh(host_params, name, *overrides):
  """(run, params): the shared parameters in the layout of `name`'s mesh."""
  run = build(small(name, *overrides))
  scanned = run.config.model.scan_layers
  params = fill(run.abstract_state.params, convert_layers(host_params, to_scanned=scanned))
  return run, params


def packed_rows(batch):
  """The rows cut into documents by the data pipeline's own segment layout: a BOS (id 1, taken out of the
  progressions elsewhere) at two places of each row but the first; odd rows end in 5 tokens of padding."""
  windows_BL = np.concatenate([batch['inputs'], batch['targets'][:, -1:]], axis=1)
  windows_BL[windows_BL == 1] = 2
  rows = np.arange(1, len(windows_BL))
  windows_BL[rows, rows + 2] = windows_BL[rows, 2 * rows + 12] = 1
  windows_BL[1::2, -5:] = segments.PAD
  packed = segments.split_inputs_targets(windows_BL, segments.Separators(bos=1, eos=None))
  assert packed['segment_ids'][1:].max(axis=1).min() == 3 and packed['target_weights'].min() == 0
  return packed


def first_batch(run, packed: bool):
  """The first synthetic micro-batch, as packed rows if `packed`, in `run`'s layout."""
  batches = make_batches(run.config, run.mesh, run.rules, tokenizer.BYTES)
  batch = jax.tree.map(lambda x: np.asarray(x)[0], jax.device_get(next(batches)))
  if packed:
    batch = packed_rows(batch)
  layout = run.rules.activation_spec(('batch', 'length'))
  return {k: jax.device_put(v, layout) for k, v in batch.items()}


def loss_and_grads(host_params, name, *overrides, packed=False):
  """(loss, host gradients by unrolled path, logits of the counted targets) of the first synthetic batch
  on `name`'s mesh."""
  run, params = on_mesh(host_params, name, *overrides)

  @jax.jit
  def step(params, batch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, run.graphdef, batch, None)
    logits = nnx.merge(run.graphdef, params)(batch['inputs'], segment_ids_BL=batch.get('segment_ids'),
                                             positions_BL=batch.get('positions'))
    return loss, grads, logits

  with jax.set_mesh(run.mesh):
    batch = first_batch(run, packed)
    loss, grads, logits = step(params, batch)
  counted = np.asarray(batch.get('target_weights', np.ones(batch['inputs'].shape)))[..., None] > 0
  return float(loss), host(grads), np.where(counted, np.asarray(logits), 0)


@pytest.fixture(scope='module')
def reference(host_params):
  return loss_and_grads(host_params, 'single')


@pytest.fixture(scope='module')
def packed_reference(host_params):
  return loss_and_grads(host_params, 'single', packed=True)


def assert_same(got, want, *, rtol, atol):
  loss, grads, logits = got
  np.testing.assert_allclose(loss, want[0], rtol=rtol)
  assert grads.keys() == want[1].keys()
  for path in grads:
    np.testing.assert_allclose(grads[path], want[1][path], rtol=rtol, atol=atol, err_msg=path)
  np.testing.assert_allclose(logits, want[2], rtol=rtol, atol=10 * atol)


@pytest.mark.parametrize('name,attention,overrides', [
    ('cp8', 'all_gather', ('model.attention=dot_product', 'model.loss_chunks=2')),
    ('cp8', 'ring', ()),
])
def test_a_context_mesh_gives_the_loss_gradients_and_logits_of_one_device(host_params, reference, name,
                                                                         attention, overrides):
  got = loss_and_grads(host_params, name, f'model.context_attention={attention}', *overrides)
  assert_same(got, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('attention,overrides', [
    ('all_gather', ()),
    ('ring', ('model.loss_chunks=4',)),  # The fused loss in 4 chunks of 8 tokens.
])
def test_packed_documents_on_data_context_and_model_give_the_one_device_result(host_params, packed_reference,
                                                                              attention, overrides):
  got = loss_and_grads(host_params, 'cp2_dp2_tp2', f'model.context_attention={attention}', *overrides,
                       packed=True)
  assert_same(got, packed_reference, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # The default set has context with data and model; this adds fsdp, scan and remat.
def test_context_with_fsdp_scanned_rematerialised_layers_gives_the_one_device_result(host_params,
                                                                                    packed_reference):
  got = loss_and_grads(host_params, 'fsdp2_cp2_tp2', 'model.context_attention=ring', 'model.scan_layers=True',
                       'model.remat=full', packed=True)
  assert_same(got, packed_reference, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~13 s: the default suite time; the ring against dense attention stays in it.
def test_the_ring_equals_the_gathered_path_in_values_and_gradients_with_grouped_heads_and_documents():
  gqa = ('model.num_kv_heads=2',)  # Two key/value heads, split over `model` with the query heads.
  host_gqa = None
  results, traced = {}, {}
  for attention in ('all_gather', 'ring'):
    run = build(small('cp4_tp2', *gqa, f'model.context_attention={attention}'))
    with jax.set_mesh(run.mesh):
      if host_gqa is None:
        host_gqa = host(run.init().params)
      loss = functools.partial(loss_fn, graphdef=run.graphdef, dropout_key=None)
      traced[attention] = str(jax.make_jaxpr(loss)(run.abstract_state.params, batch=first_batch(run, True)))
    results[attention] = loss_and_grads(host_gqa, 'cp4_tp2', *gqa, f'model.context_attention={attention}',
                                        packed=True)
  assert_same(results['ring'], results['all_gather'], rtol=1e-5, atol=1e-6)
  # The ring passes keys and values with ppermutes inside shard_map (3 hops of k, v, their positions and
  # segment ids in the one layer); the gathered path has neither.
  assert traced['ring'].count('ppermute') == 3 * 4 and 'shard_map' in traced['ring']
  assert 'ppermute' not in traced['all_gather'] and 'shard_map' not in traced['all_gather']


@pytest.mark.parametrize('window,softcap', [(0, 0.0), (5, 2.0)], ids=['full', 'window5_softcap2'])
def test_the_ring_over_packed_documents_is_masked_attention_by_position_and_document(window, softcap):
  """The ring with per-document positions and segment ids (a packed batch), against dense attention; with
  a sliding window (which leaves blocks of keys wholly outside it, skipped) and soft-capped scores too."""
  mesh = make_mesh({'data': 2, 'context': 4}, jax.devices())
  rng = np.random.RandomState(0)
  b, length, h, k = 2, 32, 2, 8
  q, kk, v = (rng.randn(b, length, h, k).astype(np.float32) for _ in range(3))
  starts = [[0, 5, 17], [0, 11, 12, 30]]  # Documents of each row; one of a single token.
  if window:  # Long documents, so that the window cuts them.
    starts = [[0, 17], [0, 30]]
  segments = np.stack([np.cumsum(np.isin(np.arange(length), s)) for s in starts]).astype(np.int32)
  positions = np.stack([np.arange(length) - np.maximum.accumulate(np.where(np.isin(np.arange(length), s),
                                                                           np.arange(length), 0))
                        for s in starts]).astype(np.int32)
  cotangent = rng.randn(b, length, h, k).astype(np.float32)

  def dense(q, kk, v):
    mask = visible(positions, positions, segments, segments, window)[:, None]
    scores = jnp.einsum('BLHK,BMHK->BHLM', q, kk) / np.sqrt(k)
    scores = softcap * jnp.tanh(scores / softcap) if softcap else scores
    scores = jnp.where(mask, scores, -jnp.inf)
    return jnp.einsum('BHLM,BMHK->BLHK', jax.nn.softmax(scores, axis=-1), v)

  order = zigzag_order(length, 4)
  spec = jax.P('data', 'context', None, None)

  def ring(q, kk, v):
    stored = [jax.sharding.reshard(x[:, order], spec) for x in (q, kk, v)]
    out = ring_attention(*stored, jnp.asarray(positions[:, order]), jnp.asarray(segments[:, order]),
                         spec=spec, scale=k ** -0.5, softcap=softcap, window=window)
    return jax.sharding.reshard(out, jax.P())[:, np.argsort(order)]

  with jax.set_mesh(mesh):
    args = [jax.device_put(x, jax.P()) for x in (q, kk, v)]
    want, got = (jax.jit(jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a) * cotangent), (0, 1, 2)))(*args)
                 for f in (dense, ring))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('attention', ['all_gather', 'ring'])
def test_cached_sampling_on_a_context_mesh_equals_recomputation_and_training_logits(host_params, attention):
  run, params = on_mesh(host_params, 'cp2_dp2_tp2', f'model.context_attention={attention}')
  model = nnx.merge(run.graphdef, params)
  tokens_BL = np.random.RandomState(1).randint(0, 128, (8, 16)).astype(np.int32)
  chunks = (4, 1, 1, 2)  # A prefill split over `context`, single tokens (not split), two more.

  @jax.jit
  def cached_logits(params, tokens_BL):
    model = nnx.merge(run.graphdef, params)
    cache = model.init_cache(8, 9, jnp.float32)  # Rounded up to 10 slots, to split over `context`.
    out, start = [], 0
    for size in chunks:
      logits_BLV, cache = model.decode(tokens_BL[:, start:start + size], cache, start)
      out.append(jax.sharding.reshard(logits_BLV, jax.P()))  # A chunk of one token is not split.
      start += size
    return jnp.concatenate(out, axis=1), cache

  with jax.set_mesh(run.mesh):
    replicated = jax.sharding.reshard(tokens_BL, jax.P())
    cached, cache = cached_logits(params, replicated)
    forward = jax.jit(lambda p, t: nnx.merge(run.graphdef, p)(t))(params, replicated[:, :8])
    # A prompt of 5: 4 tokens prefilled over `context`, the fifth as a decode step.
    generated = np.asarray(sampling.generate(model, tokens_BL[:, :5], 11))
    recomputed = np.asarray(sampling.generate_without_cache(model, tokens_BL[:, :5], 11))
  assert cache[0][0].shape[1] == 10 and cache[0][0].sharding.spec[1] == 'context'
  np.testing.assert_allclose(np.asarray(cached), np.asarray(forward), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(generated, recomputed)


def test_the_report_shows_the_length_split_over_context():
  run = build(small('cp2_dp2_tp2'))
  text = report.format_report(run.layout, run.abstract_state, run.mesh, run.plan, run.rules)
  assert 'mesh data=2 x fsdp=1 x context=2 x model=2 (8 devices)' in text
  assert 'length over context (2 ways)' in text
  assert all('length' not in p.logical_axes for p in run.layout)  # Parameters never split on it.


def test_the_memory_plan_keeps_a_share_of_the_tokens_per_context_device():
  # Split over `context`, each query scores every key, as one device's scores them in one block.
  one = build(small('single', 'train.seq_len=256', 'model.attention_block=256')).plan.activations
  four = build(small('cp8', 'mesh.context=4', 'mesh.data=2', 'train.seq_len=256')).plan.activations
  # Data 2 halves the rows and context 4 quarters their tokens; each device also keeps the keys and values
  # it gathered: 2 x float32 x 8 heads x 16 x 4 rows x 256 tokens (one layer).
  assert four == one // 8 + 2 * 4 * 8 * 16 * 4 * 256


def test_a_sequence_the_context_split_does_not_divide_is_a_one_line_error():
  with pytest.raises(ConfigError, match=r'`length` \(train.seq_len=30\) is split over `context` = 8 devices; '
                                        r'30 % 8 != 0\. Use a train.seq_len that is a multiple of 8\.$'):
    build(small('cp8', 'train.seq_len=30'))
  with pytest.raises(ConfigError, match=r'model.context_attention=ring splits train.seq_len=36 into 2 x 4 '):
    build(small('cp4_tp2', 'train.seq_len=36', 'model.context_attention=ring'))
  with pytest.raises(ConfigError, match=r'model.loss_chunks=16 leaves chunks of 2 tokens, which the 8-way'):
    build(small('cp8', 'model.loss_chunks=16'))

