"""Packing with document boundaries: the segment layout of rows, and documents that never see each other.

A packed row's documents are predicted as each would be alone (attention within a document, positions
restarting at its BOS), padding never counts, and a step weighs every counted target the same
however the batch is split into micro-batches.
"""

import signal

import helpers
import jax
import numpy as np
import pytest
from flax import nnx
from helpers import build, convert_layers, fill, load_config, mesh_devices, quiet, short_documents

from mintrain import errors, train_state
from mintrain import loop as train_loop
from mintrain.data import pipeline, segments, sources, tokenizer
from mintrain.errors import ConfigError
from mintrain.mesh import make_mesh
from mintrain.objectives.lm import loss as loss_fn
from mintrain.partitioning import AxisRules

BYTES = segments.Separators.of(tokenizer.BYTES)  # The byte tokenizer's: BOS starts a document.

BOS = tokenizer.BOS
TINY = (*helpers.TINY, 'model.num_layers=2', 'train.seq_len=32', 'train.log_every=1',
        'optimizer.warmup_steps=1')


def text(short_docs: tuple[str, ...], packing: str = 'pack') -> tuple[str, ...]:
  return (*short_docs, f'data.packing={packing}')


# The layout of rows.

def test_packed_rows_number_their_documents_and_restart_positions_at_each_bos():
  windows_BL = np.array([[7, 8, BOS, 1, 2, 3, BOS, 4, 5],
                         [BOS, 1, 2, BOS, BOS, 3, 4, 5, 6]], np.int32)
  batch = segments.split_inputs_targets(windows_BL, separators=BYTES)
  assert batch['inputs'].tolist() == windows_BL[:, :-1].tolist()
  assert batch['targets'].tolist() == windows_BL[:, 1:].tolist()
  # Row 0 starts mid-document: that document is segment 1 and its positions count from the row's start.
  assert batch['segment_ids'].tolist() == [[1, 1, 2, 2, 2, 2, 3, 3], [1, 1, 1, 2, 3, 3, 3, 3]]
  assert batch['positions'].tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 1, 2, 3]]
  assert batch['target_weights'].tolist() == [[1.0] * 8] * 2  # The BOS ending a document is a target too.
  assert {k: v.dtype for k, v in batch.items()} == {
      'inputs': np.int32, 'targets': np.int32, 'segment_ids': np.int32, 'positions': np.int32,
      'target_weights': np.float32}


def test_padded_rows_hold_one_document_up_to_the_next_bos_then_padding_that_does_not_count():
  stream = np.array([BOS, 1, 2, BOS, 3, 4, 5, 6, 7, 8, 9, BOS, 10], np.uint16)
  windows = pipeline.PaddedDocuments([stream, np.array([11, 12, BOS], np.uint16)], 5, BYTES)
  assert [windows[i].tolist() for i in range(len(windows))] == [
      [BOS, 1, 2, BOS, -1, -1],  # The document and the BOS that ends it.
      [BOS, 3, 4, 5, 6, 7],  # Truncated to seq_len + 1 tokens.
      [BOS, 10, -1, -1, -1, -1],  # The stream's last document has no BOS after it.
      [11, 12, BOS, -1, -1, -1]]  # A token file's first document need not start with BOS.
  batch = segments.split_inputs_targets(np.stack([windows[0], windows[2]]), separators=BYTES)
  assert batch['inputs'].tolist() == [[BOS, 1, 2, 0, 0], [BOS, 0, 0, 0, 0]]
  assert batch['targets'].tolist() == [[1, 2, BOS, 0, 0], [10, 0, 0, 0, 0]]
  assert batch['segment_ids'].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
  assert batch['positions'].tolist() == [[0, 1, 2, 0, 0], [0, 0, 0, 0, 0]]
  assert batch['target_weights'].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]


EOS = 9


def test_a_tokenizer_without_bos_starts_each_document_after_the_eos_that_ends_the_last():
  """Qwen2's: documents are `ids + [EOS]`; the EOS is the document's own last target."""
  eos_only = segments.Separators(None, EOS)
  batch = segments.split_inputs_targets(np.array([[5, EOS, 1, 2, EOS, 3, EOS, 4, 6]], np.int32), eos_only)
  assert batch['segment_ids'].tolist() == [[1, 1, 2, 2, 2, 3, 3, 4]]
  assert batch['positions'].tolist() == [[0, 1, 0, 1, 2, 0, 1, 0]]
  windows = pipeline.PaddedDocuments([np.array([1, 2, EOS, 3, 4, 5, EOS, 6], np.uint16)], 4, eos_only)
  assert [windows[i].tolist() for i in range(len(windows))] == [
      [1, 2, EOS, -1, -1], [3, 4, 5, EOS, -1]]  # The lone last token has no target.
  both = segments.Separators(BOS, EOS)  # Llama's: BOS ... EOS; a document starts at its BOS.
  batch = segments.split_inputs_targets(np.array([[BOS, 1, EOS, BOS, 2, 3, EOS, BOS]], np.int32), both)
  assert batch['segment_ids'].tolist() == [[1, 1, 1, 2, 2, 2, 2]]


def test_streamed_rows_carry_the_segment_layout_packed_and_padded(tmp_path):
  import json
  docs = ['ab', 'cde', 'f', 'ghij', 'kl']
  (tmp_path / 'a.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  config = load_config('single', 'data.source=jsonl', f'data.path={tmp_path}/*.jsonl', 'data.eval_fraction=0',
                       'data.shuffle_window=1', 'data.prefetch=0')
  layout = dict(split='train', seq_len=8, global_batch_size=1, micro_batch_size=1, rows=np.arange(1), seed=0)
  packed = next(pipeline.make_iterator(config.data, tokenizer.BYTES, **layout))
  assert set(np.unique(packed['segment_ids'])) >= {1, 2, 3}
  assert (packed['positions'][packed['inputs'] == BOS] == 0).all()
  padded_data = load_config('single', 'data.source=jsonl', f'data.path={tmp_path}/*.jsonl',
                            'data.eval_fraction=0', 'data.shuffle_window=1', 'data.prefetch=0',
                            'data.packing=pad').data
  rows = pipeline.make_iterator(padded_data, tokenizer.BYTES, **layout)
  seen = []
  for _ in range(len(docs)):
    row = next(rows)
    n = int(row['target_weights'].sum())
    seen.append(tokenizer.BYTES.decode(row['inputs'][0, :n]))
    assert row['segment_ids'][0, :n].tolist() == [1] * n and not row['segment_ids'][0, n:].any()
  assert sorted(seen) == sorted(docs)  # One document per row, each once, padding after it.


def test_pad_mode_gives_each_document_of_the_split_its_own_row_in_order(short_docs):
  data = load_config('single', *text(short_docs, 'pad')).data
  stream = sources.load_split(data, tokenizer.BYTES, 'eval')[0]
  starts = np.flatnonzero(stream == BOS)
  assert len(starts) > 4
  batch = next(pipeline.make_iterator(data, tokenizer.BYTES, split='eval', seq_len=32, global_batch_size=4,
                                      micro_batch_size=4, rows=np.arange(4), seed=0, separators=BYTES))
  for row in range(4):
    tokens = stream[starts[row]:starts[row + 1] + 1]  # Short documents: none is truncated.
    n = len(tokens) - 1  # Targets: every token after the BOS, and the next document's BOS.
    assert batch['inputs'][row, :n].tolist() == tokens[:-1].tolist()
    assert batch['targets'][row, :n].tolist() == tokens[1:].tolist()
    assert batch['target_weights'][row].tolist() == [1.0] * n + [0.0] * (32 - n)
    assert batch['segment_ids'][row].tolist() == [1] * n + [0] * (32 - n)
    assert batch['positions'][row, :n].tolist() == list(range(n))


def test_an_unknown_packing_names_the_choices():
  with pytest.raises(ConfigError, match=r"data.packing='bogus'.*'pack'.*'pad'"):
    load_config('single', 'data.packing=bogus')


# Documents in a packed row are predicted as each would be alone.

@pytest.fixture(scope='module')
def host_params():
  """The tiny model's parameters, drawn once; every case moves them to its mesh."""
  config = load_config('single', *TINY)
  setup = build(config)
  with jax.set_mesh(make_mesh(config.mesh.sizes, mesh_devices(config))):
    params = jax.device_get(setup.init().params)
  return {train_state.path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def model_on(host_params, name, *overrides):
  config = load_config(name, *TINY, *overrides)
  setup = build(config)
  params = fill(setup.abstract_state.params, convert_layers(host_params, to_scanned=config.model.scan_layers))
  return setup, params


@pytest.fixture(scope='module')
def packed():
  """Four packed rows of short documents, and each document's (row, segment, alone loss).

  The alone loss is the plain model's (no segments: one sequence per row, einsum attention, logits then
  cross-entropy) on the document's tokens at the start of a row; what follows them cannot matter to a
  causal model.
  """
  stream = np.concatenate(tokenizer.BYTES.documents([d.decode() for d in short_documents(12, seed=1)]))
  windows = pipeline.PackedSequences([stream], seq_len=32)
  batch = segments.split_inputs_targets(np.stack([windows[i] for i in range(4)]), separators=BYTES)
  documents = [(r, s) for r in range(4) for s in np.unique(batch['segment_ids'][r])]
  assert len(documents) >= 10 and all(s > 0 for _, s in documents)
  alone_BL = np.zeros((len(documents), 32), np.int32)
  for i, (r, s) in enumerate(documents):
    tokens = batch['inputs'][r][batch['segment_ids'][r] == s]
    alone_BL[i, :len(tokens)] = tokens
  return batch, documents, alone_BL


@pytest.fixture(scope='module')
def alone_losses(host_params, packed):
  batch, documents, alone_BL = packed
  setup, params = model_on(host_params, 'single', 'model.loss_chunks=0')
  with jax.set_mesh(make_mesh(setup.config.mesh.sizes, mesh_devices(setup.config))):
    logits = np.asarray(jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(params, alone_BL), np.float64)
  losses = []
  for i, (r, s) in enumerate(documents):
    mine = batch['segment_ids'][r] == s
    n = int(mine.sum())
    log_z = np.log(np.exp(logits[i, :n] - logits[i, :n].max(-1, keepdims=True)).sum(-1))
    log_z += logits[i, :n].max(-1)
    losses.append(np.mean(log_z - logits[i, np.arange(n), batch['targets'][r][mine]]))
  return np.array(losses)


def only_document(batch, row, segment):
  """Target weights that count the targets of one document of the batch."""
  rows = np.arange(len(batch['segment_ids']))[:, None]
  return ((rows == row) & (batch['segment_ids'] == segment)).astype(np.float32)


@pytest.mark.parametrize('attention,loss_chunks,context,block', [
    ('einsum', 0, 'ring', 6), pytest.param('dot_product', 2, 'all_gather', 0, marks=pytest.mark.slow),
    pytest.param('einsum', 2, 'all_gather', 0, marks=pytest.mark.slow),
    pytest.param('dot_product', 0, 'ring', 0, marks=pytest.mark.slow)])
def test_each_document_of_a_packed_row_has_the_loss_it_has_alone(host_params, packed, alone_losses, attention,
                                                                 loss_chunks, context, block):
  """Also with the length split over `context` (keys gathered, or passed round the ring in zigzag order)
  and, where it is not, with the einsum's queries in blocks (`model.attention_block`; 0: one block here)."""
  batch, documents, _ = packed
  for name in ('single', 'dp4_tp2', 'cp2_dp2_tp2'):
    setup, params = model_on(host_params, name, f'model.attention={attention}',
                             f'model.loss_chunks={loss_chunks}', f'model.context_attention={context}',
                             f'model.attention_block={block}')
    rules = AxisRules.from_config(setup.config.partitioning)
    with jax.set_mesh(make_mesh(setup.config.mesh.sizes, mesh_devices(setup.config))):
      layout = rules.activation_spec(('batch', 'length'))
      loss = jax.jit(lambda p, b, graphdef=setup.graphdef: loss_fn(p, graphdef, b, None))
      losses = []
      for r, s in documents:  # The packed batch as it is; only that document's targets counted.
        only = dict(batch, target_weights=only_document(batch, r, s))
        value, (count, _) = loss(params, {k: jax.device_put(v, layout) for k, v in only.items()})
        assert count == np.sum(only['target_weights'])
        losses.append(float(value))
    np.testing.assert_allclose(losses, alone_losses, rtol=2e-5, err_msg=name)


def test_without_segments_documents_would_see_each_other(host_params, packed, alone_losses):
  """The check above can fail: the same packed batch without its segment layout gives other losses."""
  batch, documents, _ = packed
  setup, params = model_on(host_params, 'single', 'model.loss_chunks=0')
  plain = {k: batch[k] for k in ('inputs', 'targets')}
  with jax.set_mesh(make_mesh(setup.config.mesh.sizes, mesh_devices(setup.config))):
    loss = jax.jit(lambda p, b: loss_fn(p, setup.graphdef, b, None)[0])
    later = [(r, s) for r, s in documents if s > 1]  # Documents that have a neighbour before them.
    for r, s in later:
      value = float(loss(params, dict(plain, target_weights=only_document(batch, r, s))))
      assert abs(value - alone_losses[documents.index((r, s))]) > 1e-3


# Padding in the loss; resume. (Meshes and micro-batches: tests/test_train_step.py.)

def grads_of(host_params, config_name, batch, *overrides):
  setup, params = model_on(host_params, config_name, *overrides)
  rules = AxisRules.from_config(setup.config.partitioning)
  with jax.set_mesh(make_mesh(setup.config.mesh.sizes, mesh_devices(setup.config))):
    layout = rules.activation_spec(('batch', 'length'))
    step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, setup.graphdef, b, None), has_aux=True))
    (loss, _), grads = step(params, {k: jax.device_put(v, layout) for k, v in batch.items()})
  flat = {train_state.path_str(p): np.asarray(g)
          for p, g in jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0]}
  return float(loss), convert_layers(flat, to_scanned=False)


@pytest.fixture(scope='module')
def padded(host_params, short_docs):
  """A batch of padded rows, and its loss and gradients from the plain model on one device."""
  config = load_config('single', *TINY, *text(short_docs, 'pad'))
  batch = next(pipeline.make_iterator(config.data, tokenizer.BYTES, split='train', seq_len=32,
                                      global_batch_size=8, micro_batch_size=8, rows=np.arange(8), seed=0,
                                      separators=BYTES))
  assert 0 < batch['target_weights'].mean() < 1
  return batch, grads_of(host_params, 'single', batch, 'model.loss_chunks=0')


@pytest.mark.parametrize('name,overrides', [
    ('single', ('model.loss_chunks=0',)),
    ('single', ('model.loss_chunks=2', 'model.attention_block=8')),  # Padding past a block's last query.
    ('dp4_tp2', ('model.loss_chunks=4', 'model.attention=dot_product')),
    ('cp2_dp2_tp2', ('model.loss_chunks=2', 'model.context_attention=ring')),  # Padding in zigzag order.
    pytest.param('single', ('model.scan_layers=True', 'model.remat=full'), marks=pytest.mark.slow)])
def test_padding_changes_neither_loss_nor_gradients(host_params, padded, name, overrides):
  batch, (loss, grads) = padded
  # Whatever the padding holds changes nothing.
  noisy = dict(batch, inputs=np.where(batch['target_weights'] > 0, batch['inputs'], 77),
               targets=np.where(batch['target_weights'] > 0, batch['targets'], 99))
  noisy_loss, noisy_grads = grads_of(host_params, name, noisy, *overrides)
  np.testing.assert_allclose(noisy_loss, loss, rtol=1e-5)
  assert noisy_grads.keys() == grads.keys()
  for path, want in grads.items():
    np.testing.assert_allclose(noisy_grads[path], want, rtol=1e-4, atol=1e-6, err_msg=path)


def run(config, workdir=None, stop_at=None):
  def print_fn(line):
    if stop_at is not None and line.startswith(f'step {stop_at - 1}/'):
      signal.raise_signal(signal.SIGTERM)
  return train_loop.run(config, workdir, devices=mesh_devices(config),
                        print_fn=print_fn if stop_at else quiet)


@pytest.mark.slow  # the default suite's time (7 min); resume is tested unpacked
def test_resume_after_sigterm_with_packed_rows_is_bit_identical(short_docs, tmp_path):
  config = load_config('dp4_tp2', *TINY, *text(short_docs), 'model.num_layers=1', 'train.steps=4',
                       'checkpoint.every_steps=2')
  straight = run(config, tmp_path / 'straight')
  first = run(config, tmp_path / 'stopped', stop_at=2)
  assert first.stopped_by == 'SIGTERM' and int(first.state.step) == 2
  resumed = run(config, tmp_path / 'stopped')
  assert first.losses + resumed.losses == straight.losses
  for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_split_without_a_document_to_learn_from_is_a_one_line_error(tmp_path):
  (tmp_path / 'empty.txt').write_text('')
  data = load_config('single', 'data.source=text', f'data.path={tmp_path}/*.txt', 'data.packing=pad',
                     'data.eval_fraction=0.0').data
  with pytest.raises(errors.DataError, match=r"no document of two or more tokens; add data or use "
                                              r"data.packing='pack'"):
    pipeline.make_iterator(data, tokenizer.BYTES, split='train', seq_len=8, global_batch_size=1,
                           micro_batch_size=1, rows=np.arange(1), seed=0, separators=BYTES)
