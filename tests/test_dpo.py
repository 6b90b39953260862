"""DPO (train.objective='dpo'): preference records become pairs of padded rows, the loss is TRL's on
transformers' own log-probabilities, the same on every mesh, and a run resumes bit-exactly."""

import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from helpers import TINY, build, load_config, mesh_devices, quiet, train_in_process
from hf_reference import chatml_tokenizer

from mintrain import hf, report
from mintrain import loop as train_loop
from mintrain.data import pipeline, streaming, tokenizer
from mintrain.data.batches import make_batches
from mintrain.errors import CheckpointError, ConfigError, DataError
from mintrain.objectives import dpo

PAIRS = [{'prompt': f'{a}+{b}=', 'chosen': str(a + b), 'rejected': str(a + b + 1 + a % 3)}
         for a in range(8) for b in range(6)]


def write_pairs(path, records, bad_lines=()):
  lines = [json.dumps(r) for r in records]
  for index, line in bad_lines:
    lines.insert(index, line)
  path.write_text('\n'.join(lines) + '\n')
  return path


def dpo_overrides(path, *extra):
  return ('train.objective=dpo', 'data.format=preference', 'data.source=jsonl', f'data.path={path}',
          'data.packing=pad', 'data.tokenizer=byte', 'data.eval_fraction=0.0', 'data.prefetch=0',
          'data.block_bytes=256', *extra)


@pytest.fixture(scope='module')
def pairs_file(tmp_path_factory):
  return write_pairs(tmp_path_factory.mktemp('pairs') / 'pairs.jsonl', PAIRS)


def test_pairs_are_prompt_plus_response_rows_weighted_on_the_response_alone(pairs_file):
  config = load_config('single', *TINY, *dpo_overrides(pairs_file))
  tok = tokenizer.load('byte')
  batch = next(pipeline.make_iterator(config.data, tok, split='train', seq_len=16, global_batch_size=4,
                                      micro_batch_size=4, rows=np.arange(4), seed=0))
  assert batch['inputs'].shape == (4, 2, 16)
  for inputs, targets, weights in zip(batch['inputs'], batch['targets'], batch['target_weights']):
    chosen, rejected = (bytes(t[w > 0].astype(np.uint8)).decode() for t, w in zip(targets, weights))
    prompt = bytes(inputs[0, 1:int(np.argmax(weights[0] > 0)) + 1].astype(np.uint8)).decode()
    a, b = map(int, prompt.rstrip('=').split('+'))
    assert (chosen, rejected) == (str(a + b), str(a + b + 1 + a % 3))
    assert inputs[0, 0] == inputs[1, 0] == tokenizer.BOS


def test_the_loss_at_step_0_with_the_reference_equal_to_the_policy_is_ln_2(pairs_file):
  config = load_config('single', *TINY, *dpo_overrides(pairs_file))
  run = build(config)
  with jax.set_mesh(run.mesh):
    state = run.init()
    _, metrics = run.train_step(state, next(run.batches(tokenizer.load('byte'))))
  np.testing.assert_allclose(float(metrics['loss']), np.log(2), rtol=1e-6)
  assert float(metrics['dpo_reward_margin']) == 0 and float(metrics['dpo_chosen_logp']) < 0


def packed_and_padded(pairs_file):
  """The configs and the first packed batch (2 rows of 32) of the pairs, and the same pairs as padded rows,
  each pair's chosen and rejected cut out of the packed row at its segment id."""
  configs = [load_config('single', *TINY, *dpo_overrides(pairs_file, f'data.packing={p}', 'train.seq_len=32'))
             for p in ('pack', 'pad')]
  packed = next(pipeline.make_iterator(configs[0].data, tokenizer.load('byte'), split='train', seq_len=32,
                                       global_batch_size=2, micro_batch_size=2, rows=np.arange(2), seed=0))
  rows = []
  for b in range(2):
    for k in range(1, packed['segment_ids'][b].max() + 1):
      row = {key: np.zeros((1, 2, 32), v.dtype) for key, v in packed.items()}
      for half in (0, 1):
        at = packed['segment_ids'][b, half] == k
        for key in packed:
          row[key][0, half, :at.sum()] = packed[key][b, half][at]
      rows.append(row)
  return configs, packed, {key: np.concatenate([r[key] for r in rows]) for key in packed}


def test_packed_pairs_hold_each_pairs_chosen_and_rejected_as_the_same_document_of_both_halves(pairs_file):
  _, packed, padded = packed_and_padded(pairs_file)
  assert packed['inputs'].shape == (2, 2, 32)
  for b in range(2):
    assert packed['segment_ids'][b, 0].max() == packed['segment_ids'][b, 1].max() > 1
  for inputs, targets, weights in zip(padded['inputs'], padded['targets'], padded['target_weights']):
    prompts = [inputs[h, :int(np.argmax(weights[h] > 0)) + 1] for h in (0, 1)]
    assert np.array_equal(*prompts) and prompts[0][0] == tokenizer.BOS
    a, b = map(int, bytes(prompts[0][1:].astype(np.uint8)).decode().rstrip('=').split('+'))
    chosen, rejected = (bytes(t[w > 0].astype(np.uint8)).decode() for t, w in zip(targets, weights))
    assert (chosen, rejected) == (str(a + b), str(a + b + 1 + a % 3))


@pytest.mark.slow  # A compile per layout.
def test_packed_pairs_give_the_loss_of_the_same_pairs_padded(pairs_file):
  (packed_config, padded_config), packed, padded = packed_and_padded(pairs_file)
  run = build(packed_config)
  with jax.set_mesh(run.mesh):
    params = run.init().params
    reference = jax.tree.map(lambda x: 1.5 * x, params)  # Another model, so that the pairs' losses differ.
    losses = [jax.jit(config.objective.make_loss(config), static_argnums=1)(params, run.graphdef, batch, None,
                                                                             None, reference)
              for config, batch in ((packed_config, packed), (padded_config, padded))]
  (packed_loss, (packed_count, packed_metrics)), (padded_loss, (padded_count, padded_metrics)) = losses
  assert float(packed_count) == float(padded_count) == len(padded['inputs'])
  np.testing.assert_allclose(float(packed_loss), float(padded_loss), rtol=1e-5)
  for key in ('dpo_chosen_logp', 'dpo_rejected_logp', 'dpo_reward_margin'):
    np.testing.assert_allclose(float(packed_metrics[key]), float(padded_metrics[key]), rtol=1e-5)
  assert abs(float(packed_loss) - np.log(2)) > 1e-3


def tiny_llama(directory, seed):
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  model.save_pretrained(directory)
  return model


def torch_dpo(policy, reference, cfg, tokens, weights):
  """TRL's sigmoid DPO loss on transformers' summed response log-probabilities, (P, 2, L) pairs."""
  def logps(model):
    rows = torch.from_numpy(tokens.reshape(-1, tokens.shape[-1]).astype(np.int64))
    logits = model(rows).logits[:, :-1].float()
    per_token = torch.gather(logits.log_softmax(-1), 2, rows[:, 1:, None])[..., 0]
    return (per_token * torch.from_numpy(weights.reshape(-1, weights.shape[-1])[:, 1:])).sum(-1).view(-1, 2)
  pi = logps(policy)
  with torch.no_grad():
    ref = logps(reference)
  logits = (pi[:, 0] - pi[:, 1]) - (ref[:, 0] - ref[:, 1])
  loss = (-torch.nn.functional.logsigmoid(cfg.beta * logits) * (1 - cfg.label_smoothing)
          - torch.nn.functional.logsigmoid(-cfg.beta * logits) * cfg.label_smoothing).mean()
  loss.backward()
  return float(loss.detach())


@pytest.mark.slow  # the default suite's time (7 min); ln 2 at step 0 stays in it
def test_loss_and_gradient_equal_trls_on_transformers_log_probabilities(tmp_path):
  policy, reference = tiny_llama(tmp_path / 'policy', 0), tiny_llama(tmp_path / 'reference', 1)
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, 256, (4, 2, 17)).astype(np.int32)
  tokens[:, 1, :6] = tokens[:, 0, :6]  # A shared prompt of 6 tokens.
  weights = np.zeros(tokens.shape, np.float32)
  weights[:, :, 6:] = 1.0
  weights[1, 1, 12:] = 0.0  # A shorter rejected response (padding).
  config = load_config('single', *TINY, 'train.objective=dpo', 'data.format=preference', 'data.source=jsonl',
                       'data.packing=pad', 'dpo.beta=0.5', 'dpo.label_smoothing=0.1',
                       f'init.hf_checkpoint={tmp_path / "policy"}', 'data.tokenizer=byte',
                       'model.param_dtype=float32', 'model.compute_dtype=float32', 'model.loss_chunks=0')
  run = build(config)
  expected = torch_dpo(policy, reference, config.dpo, tokens, weights)
  batch = {'inputs': tokens[..., :-1], 'targets': tokens[..., 1:], 'target_weights': weights[..., 1:]}
  with jax.set_mesh(run.mesh):
    params = hf.load_params(tmp_path / 'policy', run)
    ref_params = hf.load_params(tmp_path / 'reference', run)
    loss_fn = config.objective.make_loss(config)
    (loss, (count, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, run.graphdef, jax.tree.map(np.asarray, batch), None, None, ref_params)
  np.testing.assert_allclose(float(loss), expected, rtol=1e-4)
  assert float(count) == 4
  got = {'model.embed_tokens.weight': np.asarray(grads['embedding_VD'][...]),
         'lm_head.weight': np.asarray(grads['unembed_DV'][...]).T}
  for name, grad in got.items():
    want = dict(policy.named_parameters())[name].grad.numpy()
    np.testing.assert_allclose(grad, want, atol=1e-4 * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize('loss', dpo.LOSSES)
def test_each_loss_is_trls_formula(loss):
  cfg = dpo.DPOConfig(beta=0.5, loss=loss, label_smoothing=0.0, gamma=0.3, precompute_reference=False)
  c, r, rc, rr = (np.array(x, np.float32) for x in ([-3., -8.], [-5., -6.], [-4., -7.], [-4., -7.]))
  lc, lr = np.array([2., 4.], np.float32), np.array([1., 3.], np.float32)
  losses, _, _ = dpo.pair_losses(cfg, c, r, rc, rr, lc, lr)
  if loss in ('sigmoid', 'hinge'):
    logits = (c - r) - (rc - rr)
  else:
    logits = (c / lc - r / lr) - (0 if loss == 'simpo' else rc / lc - rr / lr)
  want = {'sigmoid': np.log1p(np.exp(-0.5 * logits)), 'hinge': np.maximum(0, 1 - 0.5 * logits),
          'ipo': (logits - 1 / (2 * 0.5)) ** 2, 'simpo': np.log1p(np.exp(-(0.5 * logits - 0.3)))}[loss]
  np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)


def train_losses(name, pairs_file, steps=2, *extra):
  config = load_config(name, *TINY, *dpo_overrides(pairs_file, f'train.steps={steps}', 'train.log_every=1',
                                                   *extra))
  return train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet).losses


@pytest.mark.slow  # ~13 s: the default suite time; the slow set has the other meshes too.
def test_the_same_losses_on_one_device_and_on_dp4_tp2(pairs_file):
  np.testing.assert_allclose(train_losses('dp4_tp2', pairs_file), train_losses('single', pairs_file),
                             rtol=2e-5)


@pytest.mark.slow
def test_packed_pairs_train_to_the_same_losses_on_dp4_tp2_and_cp2_dp2_tp2_as_on_one_device_and_precomputed(
    pairs_file):
  packed = ('data.packing=pack', 'train.seq_len=32')
  single = train_losses('single', pairs_file, 3, *packed)
  for name in ('dp4_tp2', 'cp2_dp2_tp2'):  # Context parallelism: the documents' sums in the ring's order.
    np.testing.assert_allclose(train_losses(name, pairs_file, 3, *packed), single, rtol=2e-5, err_msg=name)
  np.testing.assert_allclose(train_losses('single', pairs_file, 3, *packed, 'dpo.precompute_reference=True'),
                             single, rtol=1e-5)
  assert abs(single[-1] - np.log(2)) > 1e-4  # The policy has moved (the first step's learning rate is 0).


@pytest.mark.slow
@pytest.mark.parametrize('name', ['fsdp8', 'tp8'])
def test_the_same_losses_on_fsdp8_and_tp8(pairs_file, name):
  eight_heads = ('model.num_heads=8', 'model.head_dim=4')  # Heads that split 8 ways on tp8.
  np.testing.assert_allclose(train_losses(name, pairs_file, 2, *eight_heads),
                             train_losses('single', pairs_file, 2, *eight_heads), rtol=2e-5)


@pytest.mark.slow  # the default suite's time, as GRPO's
def test_a_run_stopped_by_sigterm_resumes_bit_exactly(pairs_file, tmp_path):
  config = load_config('single', *TINY, *dpo_overrides(pairs_file, 'train.steps=4', 'train.log_every=1',
                                                       'checkpoint.every_steps=2'))

  straight = train_in_process(config, tmp_path / 'straight')
  first = train_in_process(config, tmp_path / 'stopped', stop_at=2)
  assert first.stopped_by == 'SIGTERM' and int(first.state.step) == 2
  resumed = train_in_process(config, tmp_path / 'stopped')
  assert first.losses + resumed.losses == straight.losses and all(np.isfinite(straight.losses))
  for a, b in zip(jax.tree.leaves((resumed.state.params, resumed.state.reference)),
                  jax.tree.leaves((straight.state.params, straight.state.reference))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # Two runs: the default suite's time.
def test_a_precomputed_reference_gives_the_in_state_references_losses_and_evaluation(pairs_file):
  extra = ('train.grad_accum_steps=2', 'eval.steps=1', 'eval.every_steps=0', 'data.eval_fraction=0.2')
  def run(*more):
    config = load_config('single', *TINY, *dpo_overrides(pairs_file, 'train.steps=3', 'train.log_every=1',
                                                         *extra, *more))
    return train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet)
  in_state, precomputed = run(), run('dpo.precompute_reference=True')
  assert precomputed.state.reference is None and in_state.state.reference is not None
  np.testing.assert_allclose(precomputed.losses, in_state.losses, rtol=1e-5)
  np.testing.assert_allclose(precomputed.summary['final_eval_loss'], in_state.summary['final_eval_loss'],
                             rtol=1e-5)
  assert in_state.losses[-1] < in_state.losses[0]


@pytest.mark.slow  # As the in-state reference's resume test, which covers the same loop in the default suite.
def test_a_run_with_a_precomputed_reference_stopped_by_sigterm_resumes_bit_exactly(pairs_file, tmp_path):
  config = load_config('single', *TINY, *dpo_overrides(pairs_file, 'train.steps=4', 'train.log_every=1',
                                                       'checkpoint.every_steps=2',
                                                       'dpo.precompute_reference=True'))
  straight = train_in_process(config, tmp_path / 'straight')
  first = train_in_process(config, tmp_path / 'stopped', stop_at=2)
  assert first.stopped_by == 'SIGTERM' and (tmp_path / 'stopped' / dpo.REFERENCE_FILE).exists()
  saved = np.load(tmp_path / 'stopped' / dpo.REFERENCE_FILE)
  assert saved['train'].shape == (4, 1, 8, 2) and int(saved['first_step']) == 0
  resumed = train_in_process(config, tmp_path / 'stopped')
  assert first.losses + resumed.losses == straight.losses and all(np.isfinite(straight.losses))
  assert resumed.state.reference is None
  for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  other = tmp_path / 'other'  # The file alone, beside a run of another seed: it is not that run's.
  other.mkdir()
  shutil.copy(tmp_path / 'stopped' / dpo.REFERENCE_FILE, other)
  with pytest.raises(CheckpointError, match='holds reference log-probabilities of other data, model'):
    train_in_process(load_config('single', *TINY, *dpo_overrides(
        pairs_file, 'train.steps=4', 'dpo.precompute_reference=True', 'seed=1')), other)


def test_the_memory_plan_and_flops_count_both_sequences_of_a_pair_and_the_reference(pairs_file):
  lm, with_reference, precomputed = (
      load_config('single', *TINY, *extra) for extra in
      ((), dpo_overrides(pairs_file), dpo_overrides(pairs_file, 'dpo.precompute_reference=True')))
  sequence = lm.model.train_flops_per_row(lm.train.seq_len) * lm.train.global_batch_size
  assert report.train_flops_per_step(lm) == sequence
  np.testing.assert_allclose(report.train_flops_per_step(with_reference), 2 * sequence + 2 * sequence / 3)
  np.testing.assert_allclose(report.train_flops_per_step(precomputed), 2 * sequence)
  assert report.tokens_per_step(with_reference) == 2 * report.tokens_per_step(lm)
  lm_plan, reference_plan, precomputed_plan = (build(c).plan for c in (lm, with_reference, precomputed))
  assert reference_plan.reference == reference_plan.params > 0 and precomputed_plan.reference == 0
  assert reference_plan.total == precomputed_plan.total + reference_plan.params
  assert reference_plan.activations == 2 * lm_plan.activations
  assert 'reference model' in report.format_plan(reference_plan)


def mixture_overrides(*paths, fmt='preference'):
  entries = ', '.join(f"({{'source': 'jsonl', 'path': '{p}', 'format': '{fmt}'}}, 1)" for p in paths)
  return ('train.objective=dpo', 'data.format=preference', 'data.source=mixture', f'data.mixture=[{entries}]',
          'data.packing=pad', 'data.tokenizer=byte', 'data.eval_fraction=0.0', 'data.prefetch=0',
          'data.block_bytes=256')


def test_a_mixture_of_preference_sources_draws_each_rows_pair_from_its_drawn_source(tmp_path):
  times = [{**p, 'prompt': p['prompt'].replace('+', '*')} for p in PAIRS]
  paths = write_pairs(tmp_path / 'plus.jsonl', PAIRS), write_pairs(tmp_path / 'times.jsonl', times)
  config = load_config('single', *TINY, *mixture_overrides(*paths))
  assert config.data.pairs

  def rows(state=None):
    it = pipeline.make_iterator(config.data, tokenizer.load('byte'), split='train', seq_len=16,
                                global_batch_size=8, micro_batch_size=8, rows=np.arange(8), seed=0)
    if state is not None:
      it.set_state(state)
    return it

  it = rows()
  for step in range(3):
    batch = next(it)
    assert batch['inputs'].shape == (8, 2, 16)
    for row, source in enumerate(streaming.mixture_choices([1.0, 1.0], 0, step, 8)):
      prompt = bytes(batch['inputs'][row, 0, 1:int(np.argmax(batch['target_weights'][row, 0] > 0)) + 1]
                     .astype(np.uint8)).decode()
      assert '+*'[source] in prompt and prompt == bytes(batch['inputs'][row, 1, 1:len(prompt) + 1]
                                                        .astype(np.uint8)).decode()
  state = json.loads(json.dumps(it.get_state()))
  np.testing.assert_array_equal(next(rows(state))['inputs'], next(it)['inputs'])
  with pytest.raises(ConfigError, match="mixes data.format='preference' with \\['text'\\]"):
    load_config('single', *TINY, *mixture_overrides(*paths)[:3],
                f"data.mixture=[({{'source': 'jsonl', 'path': '{paths[0]}'}}, 1), "
                f"({{'source': 'jsonl', 'path': '{paths[1]}', 'format': 'text'}}, 1)]")


@pytest.mark.slow  # Two runs.
def test_a_run_on_a_mixture_of_one_preference_source_has_the_sources_losses(pairs_file):
  mixture = load_config('single', *TINY, *mixture_overrides(pairs_file), 'train.steps=2', 'train.log_every=1')
  losses = train_loop.run(mixture, None, devices=mesh_devices(mixture), print_fn=quiet).losses
  np.testing.assert_array_equal(losses, train_losses('single', pairs_file))


@pytest.mark.parametrize('record, problem', [
    ({'prompt': 'a', 'chosen': 'b'}, "no field 'rejected'"),
    ({'prompt': 'a', 'chosen': 'b', 'rejected': 3}, "field 'rejected' is int, not a string"),
    ([1, 2], 'a preference record is a JSON object'),
])
def test_a_bad_preference_record_is_one_line_naming_file_and_line_or_a_counted_skip(tmp_path, record,
                                                                                        problem):
  path = write_pairs(tmp_path / 'pairs.jsonl', PAIRS[:8], bad_lines=[(3, json.dumps(record))])
  config = load_config('single', *TINY, *dpo_overrides(path))
  run = build(config)
  with jax.set_mesh(run.mesh), pytest.raises(DataError) as e:
    next(make_batches(config, run.mesh, run.rules, tokenizer.load('byte')))
  assert f'{path}:4: {problem}' in str(e.value) and '\n' not in str(e.value)
  skipping = load_config('single', *TINY, *dpo_overrides(path, 'data.skip_bad_records=True'))
  with jax.set_mesh(run.mesh):
    batch = next(make_batches(skipping, run.mesh, run.rules, tokenizer.load('byte')))
  assert batch['inputs'].shape == (1, 8, 2, 16)


@pytest.mark.parametrize('overrides, message', [
    (('train.objective=dpo',), "train.objective='dpo' learns from (prompt, chosen, rejected) records; "
                               "data.format='text' has none"),
    (('data.format=preference', 'data.source=jsonl', 'data.packing=pad'),
     "data.format='preference' holds (chosen, rejected) pairs, which train.objective='lm' cannot learn from"),
])
def test_an_objective_without_its_data_is_a_one_line_config_error_before_anything_is_written(
    tmp_path, overrides, message):
  with pytest.raises(ConfigError) as e:
    train_loop.run(load_config('single', *TINY, *overrides), tmp_path / 'run', print_fn=quiet)
  assert message in str(e.value) and '\n' not in str(e.value)
  assert not (tmp_path / 'run').exists()


def test_conversational_pairs_are_trls_render_by_transformers_chat_template(tmp_path):
  """Prompt: apply_chat_template with add_generation_prompt; response: what the template adds after it."""
  theirs = chatml_tokenizer(tmp_path / 'tok', json.dumps(PAIRS))
  records = [{'prompt': [{'role': 'user', 'content': p['prompt']}],
              'chosen': [{'role': 'assistant', 'content': p['chosen']}],
              'rejected': [{'role': 'assistant', 'content': p['rejected']}]} for p in PAIRS[:4]]
  path = write_pairs(tmp_path / 'chats.jsonl', records)
  config = load_config('single', *TINY, *dpo_overrides(path, f'data.tokenizer={tmp_path / "tok"}'))
  batch = next(pipeline.make_iterator(config.data, tokenizer.load(str(tmp_path / 'tok')), split='train',
                                      seq_len=40, global_batch_size=4, micro_batch_size=4, rows=np.arange(4),
                                      seed=0))
  prompts = {r['prompt'][0]['content']: theirs.apply_chat_template(r['prompt'], add_generation_prompt=True,
                                                                    tokenize=False) for r in records}
  for inputs, targets, weights in zip(batch['inputs'], batch['targets'], batch['target_weights']):
    prompt_ids = list(inputs[0, :int(np.argmax(weights[0] > 0)) + 1])
    [(content, prompt)] = [(c, p) for c, p in prompts.items()
                           if theirs(p, add_special_tokens=False)['input_ids'] == prompt_ids]
    record = next(r for r in records if r['prompt'][0]['content'] == content)
    for k, field in enumerate(('chosen', 'rejected')):
      full = theirs.apply_chat_template(record['prompt'] + record[field], tokenize=False)
      response = theirs(full[len(prompt):], add_special_tokens=False)['input_ids']
      assert list(targets[k][weights[k] > 0]) == response and response[-2] == theirs.eos_token_id
