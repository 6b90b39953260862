"""GRPO (train.objective='grpo'): the loss and gradient are TRL's formula on transformers' own
log-probabilities, completions depend on the step and row but not the mesh, a tiny model learns a toy
task, a run resumes bit-exactly, and bad input stops the run before it writes."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from helpers import TINY, build, load_config, mesh_devices, quiet, run_script, train_in_process
from hf_reference import chatml_tokenizer

from mintrain import hf
from mintrain import loop as train_loop
from mintrain.data import prompts, tokenizer
from mintrain.errors import ConfigError, DataError, RewardError
from mintrain.objectives.grpo import loss as grpo_loss
from mintrain.objectives.grpo import rewards, rollout

ASCII = 128  # The toy task: completion tokens below this id earn the reward.


def ascii_fraction(prompts, completions, completion_ids, **fields):
  """The toy reward: the fraction of a completion's tokens that are ASCII bytes."""
  return [sum(i < ASCII for i in ids) / max(len(ids), 1) for ids in completion_ids]


def one_value(prompts, completions, completion_ids, **fields):
  return [0.0]


def fails_on_seven(prompts, completions, completion_ids, n, **fields):
  return [1 / (n_i - 7) for n_i in n]


def write_prompts(path, count=32):
  path.write_text(''.join(json.dumps({'prompt': f'p{i}:', 'n': i}) + '\n' for i in range(count)))
  return path


@pytest.fixture(scope='module')
def prompts_file(tmp_path_factory):
  return write_prompts(tmp_path_factory.mktemp('prompts') / 'prompts.jsonl')


def grpo_overrides(path, *extra, reward='test_grpo:ascii_fraction'):
  return ('train.objective=grpo', 'data.format=prompt', 'data.source=jsonl', f'data.path={path}',
          'data.tokenizer=byte', f'grpo.reward={reward}', 'grpo.group_size=4', 'grpo.max_new_tokens=8',
          'train.global_batch_size=16', 'train.log_every=1', *extra)


def test_advantages_are_rewards_normalised_within_each_group_as_trl():
  rewards_B = np.array([1., 0., 0., 1., 2., 2., 2., 2.], np.float32)
  advantages_B, flat_G = rollout.advantages(rewards_B, 4)
  group = torch.tensor(rewards_B).view(-1, 4)
  want = (group - group.mean(1, keepdim=True)) / (group.std(1, keepdim=True) + 1e-4)
  np.testing.assert_allclose(advantages_B, want.view(-1).numpy(), rtol=1e-6)
  assert list(flat_G) == [False, True]


def test_prompt_records_are_bos_plus_ids_and_keep_their_fields(prompts_file):
  config = load_config('single', *TINY, *grpo_overrides(prompts_file))
  read = prompts.read(config.data, tokenizer.load('byte'), 9)
  assert len(read) == 32 and read[3].record == {'prompt': 'p3:', 'n': 3}
  assert list(read[3].ids_P) == [tokenizer.BOS, *b'p3:'] and read[3].where == f'{prompts_file}:4'
  batches = prompts.PromptBatches(read, 4, seed=0, source='jsonl')
  first, second = next(batches), next(batches)
  batches.set_state({'source': 'jsonl', 'iterator': {'next_prompt': 4}})
  assert [p.where for p in next(batches)] == [p.where for p in second]
  assert len({p.where for p in first + second}) == 8


def test_a_conversational_prompt_is_transformers_render_with_the_assistants_turn_opened(tmp_path):
  theirs = chatml_tokenizer(tmp_path / 'tok', 'what is 2+3? say it')
  messages = [{'role': 'system', 'content': 'say it'}, {'role': 'user', 'content': 'what is 2+3?'}]
  path = tmp_path / 'prompts.jsonl'
  path.write_text(json.dumps({'prompt': messages, 'answer': '5'}) + '\n')
  config = load_config('single', *TINY, *grpo_overrides(path, f'data.tokenizer={tmp_path / "tok"}'))
  [read] = prompts.read(config.data, tokenizer.load(str(tmp_path / 'tok')), 64)
  text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  assert list(read.ids_P) == theirs(text, add_special_tokens=False)['input_ids']
  assert read.record['answer'] == '5'


def test_a_prompt_too_long_for_the_completion_is_a_data_error_naming_its_line(tmp_path):
  path = tmp_path / 'prompts.jsonl'
  path.write_text(json.dumps({'prompt': 'short'}) + '\n' + json.dumps({'prompt': 'x' * 12}) + '\n')
  config = load_config('single', *TINY, *grpo_overrides(path))
  with pytest.raises(DataError) as e:
    prompts.read(config.data, tokenizer.load('byte'), 9)
  assert f'{path}:2: the prompt has 13 tokens' in str(e.value) and '\n' not in str(e.value)


def test_each_token_term_is_trls_formula():
  rng = np.random.RandomState(1)
  logp, old, ref = (rng.normal(-2, 0.4, (3, 5)).astype(np.float32) for _ in range(3))
  advantages = np.array([1.0, -0.5, 0.0], np.float32)
  loss_BL, kl_BL, clipped_BL = grpo_loss.token_terms(logp, old, ref, advantages, clip_eps=0.2,
                                                     clip_eps_high=0.3, kl_coef=0.1)
  ratio, a = np.exp(logp - old), advantages[:, None]
  kl = np.exp(ref - logp) - (ref - logp) - 1
  np.testing.assert_allclose(loss_BL, -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.3) * a) + 0.1 * kl,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(kl_BL, kl, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(clipped_BL, ((ratio < 0.8) & (a < 0)) | ((ratio > 1.3) & (a > 0)))
  assert 0 < np.asarray(clipped_BL).sum() < clipped_BL.size


def tiny_llama(directory, seed):
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  model.save_pretrained(directory)
  return model


def torch_log_probs(model, tokens):
  rows = torch.from_numpy(tokens.astype(np.int64))
  logits = model(rows).logits[:, :-1].float()
  return torch.gather(logits.log_softmax(-1), 2, rows[:, 1:, None])[..., 0]


def torch_grpo(policy, tokens, mask, advantages, old, ref, *, eps, eps_high, beta, norm):
  """TRL's GRPO loss on transformers' per-token log-probabilities (written from grpo_trainer.py)."""
  logp = torch_log_probs(policy, tokens)
  mask, old, ref = (torch.from_numpy(x) for x in (mask, old, ref))
  coef_1 = torch.exp(logp - old)
  coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
  a = torch.from_numpy(advantages)[:, None]
  per_token = -torch.min(coef_1 * a, coef_2 * a) + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
  if norm == 'token':
    loss = (per_token * mask).sum() / mask.sum()
  else:
    loss = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
  loss.backward()
  return float(loss.detach())


@pytest.mark.slow  # 14 s measured under load (a model's value_and_grad); the token terms' test is fast.
@pytest.mark.parametrize('norm', ['token', 'sequence'])
def test_loss_and_gradient_equal_trls_formula_on_transformers_log_probabilities(tmp_path, norm):
  policy, reference = tiny_llama(tmp_path / 'policy', 0), tiny_llama(tmp_path / 'reference', 1)
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, 256, (4, 17)).astype(np.int32)
  mask = np.zeros((4, 16), np.float32)
  for b, (start, end) in enumerate([(5, 16), (3, 9), (7, 12), (2, 16)]):
    mask[b, start:end] = 1.0
  advantages = np.array([1.2, -0.7, 0.3, -1.1], np.float32)
  with torch.no_grad():
    old = (torch_log_probs(policy, tokens).numpy() + rng.normal(0, 0.3, (4, 16))).astype(np.float32)
    ref = torch_log_probs(reference, tokens).numpy()
  config = load_config('single', *TINY, 'train.objective=grpo', 'data.format=prompt', 'data.source=jsonl',
                       'grpo.max_new_tokens=8', 'grpo.num_iterations=2', 'grpo.clip_eps=0.2',
                       'grpo.clip_eps_high=0.28', 'grpo.kl_coef=0.04', f'grpo.loss_norm={norm}',
                       f'init.hf_checkpoint={tmp_path / "policy"}', 'data.tokenizer=byte',
                       'model.param_dtype=float32', 'model.compute_dtype=float32', 'model.loss_chunks=0')
  run = build(config)
  expected = torch_grpo(policy, tokens, mask, advantages, old, ref, eps=0.2, eps_high=0.28, beta=0.04,
                        norm=norm)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'target_weights': mask,
           'advantages': advantages, 'old_logp': old, 'ref_logp': ref}
  with jax.set_mesh(run.mesh):
    params = hf.load_params(tmp_path / 'policy', run)
    loss_fn = config.objective.make_loss(config)
    (loss, (count, metrics)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=1)(
        params, run.graphdef, jax.tree.map(np.asarray, batch), None, None, None)
  np.testing.assert_allclose(float(loss), expected, rtol=1e-4)
  assert float(count) == (mask.sum() if norm == 'token' else 4)
  assert 0 < float(metrics['grpo_clip_fraction']) < 1 and float(metrics['grpo_kl']) > 0
  got = {'model.embed_tokens.weight': np.asarray(grads['embedding_VD'][...]),
         'lm_head.weight': np.asarray(grads['unembed_DV'][...]).T}
  for name, grad in got.items():
    want = dict(policy.named_parameters())[name].grad.numpy()
    np.testing.assert_allclose(grad, want, atol=1e-4 * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize('overrides, error, message', [
    (('grpo.reward=no_such_module:f',), ConfigError,
     "grpo.reward: module 'no_such_module' cannot be imported"),
    (('grpo.reward=test_grpo:one_value',), RewardError,
     'grpo.reward test_grpo:one_value returned 1 values for 16 completions'),
])
def test_a_bad_reward_is_a_one_line_error_before_anything_is_written(prompts_file, tmp_path, overrides, error,
                                                                      message):
  config = load_config('single', *TINY, *grpo_overrides(prompts_file, *overrides))
  with pytest.raises(error) as e:
    train_loop.run(config, tmp_path / 'run', devices=mesh_devices(config), print_fn=quiet)
  assert message in str(e.value) and '\n' not in str(e.value)
  assert sorted(p.name for p in (tmp_path / 'run').iterdir()) == []


def test_a_reward_that_raises_names_the_function_and_the_record(prompts_file):
  config = load_config('single', *TINY, *grpo_overrides(prompts_file))
  read = prompts.read(config.data, tokenizer.load('byte'), 9)
  [reward] = rewards.load('test_grpo:fails_on_seven', ())
  with pytest.raises(RewardError) as e:
    rewards.score([reward], [p.record['prompt'] for p in read], ['x'] * 32, [[120]] * 32,
                  {'n': [p.record['n'] for p in read]}, [p.where for p in read])
  assert str(e.value) == (f'grpo.reward test_grpo:fails_on_seven failed on the record at {prompts_file}:8 '
                          "with completion 'x': ZeroDivisionError: division by zero")


def test_a_group_size_that_does_not_divide_the_batch_is_a_one_line_error_before_anything_is_written(
    prompts_file, tmp_path):
  config = load_config('single', *TINY, *grpo_overrides(prompts_file, 'grpo.group_size=3'))
  with pytest.raises(ConfigError) as e:
    train_loop.run(config, tmp_path / 'run', devices=mesh_devices(config), print_fn=quiet)
  assert 'grpo.group_size=3 does not divide train.global_batch_size=16' in str(e.value)
  assert '\n' not in str(e.value) and not list((tmp_path / 'run').iterdir())


@pytest.mark.parametrize('overrides, message', [
    (('train.objective=grpo',), "train.objective='grpo' samples completions of prompt records"),
    (('data.format=prompt', 'data.source=jsonl'),
     "data.format='prompt' holds prompts to sample completions of, which train.objective='lm' cannot learn"),
    (('train.objective=grpo', 'data.format=prompt', 'data.source=jsonl', 'grpo.max_new_tokens=16'),
     'grpo.max_new_tokens=16 leaves no room for a prompt'),
])
def test_grpo_without_prompts_or_prompts_without_grpo_is_a_one_line_config_error(overrides, message):
  with pytest.raises(ConfigError) as e:
    load_config('single', *TINY, *overrides)
  assert message in str(e.value) and '\n' not in str(e.value)


@pytest.mark.slow  # ~15 s: 12 steps of sampling and updates.
def test_a_tiny_model_learns_to_write_ascii_in_a_dozen_steps(prompts_file):
  config = load_config('single', *TINY, *grpo_overrides(
      prompts_file, 'train.steps=12', 'optimizer.warmup_steps=0', 'optimizer.learning_rate=3e-2',
      'optimizer.schedule=constant'))
  result = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet)
  rewards = [r['grpo_reward'] for r in result.records if 'grpo_reward' in r]
  assert len(rewards) == 12 and rewards[0] < 0.5 and np.mean(rewards[-3:]) > 0.8, rewards


@pytest.mark.slow
def test_sampling_on_dp4_tp2_gives_the_same_completions_as_on_one_device(prompts_file):
  def completions(name):
    config = load_config(name, *TINY, *grpo_overrides(prompts_file))
    run = build(config)
    with jax.set_mesh(run.mesh):
      state = run.init()
      model = run.model(state.params, state.frozen)
      prompt_BP = np.tile(np.arange(1, 10, dtype=np.int32), (16, 1))
      lengths_B = np.arange(16) % 9 + 1
      return np.asarray(config.family.complete(model, prompt_BP, lengths_B, 8, temperature=1.0, top_p=0.9,
                                               keys_B=rollout.row_keys(config.seed, 3, 16)))

  single = completions('single')
  np.testing.assert_array_equal(completions('dp4_tp2'), single)
  assert len(np.unique(single)) > 8  # Drawn, not constant.


@pytest.mark.slow
@pytest.mark.parametrize('name', ['dp4_tp2', 'fsdp8', 'tp8', 'cp2_dp2_tp2'])
def test_the_same_rewards_and_losses_on_one_device_and_on_other_meshes(prompts_file, name):
  eight_heads = ('model.num_heads=8', 'model.head_dim=4')  # Heads that split 8 ways on tp8.

  def run(mesh):
    config = load_config(mesh, *TINY, *eight_heads, *grpo_overrides(
        prompts_file, 'train.steps=2', 'grpo.kl_coef=0.1', 'grpo.num_iterations=2'))
    result = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet)
    return result.losses, [r['grpo_reward'] for r in result.records if 'grpo_reward' in r]

  (losses, rewards), (want_losses, want_rewards) = run(name), run('single')
  assert rewards == want_rewards
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=1e-6)


@pytest.mark.slow
def test_lora_from_a_hugging_face_checkpoint_trains_on_dp4_tp2_and_exports(prompts_file, tmp_path):
  torch.manual_seed(0)
  llama = transformers.LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
  transformers.AutoModelForCausalLM.from_config(llama, dtype=torch.float32).save_pretrained(tmp_path / 'hf')
  config = load_config('dp4_tp2', *TINY, *grpo_overrides(
      prompts_file, 'train.steps=2', f'init.hf_checkpoint={tmp_path / "hf"}', 'lora.rank=4',
      'grpo.kl_coef=0.05', 'checkpoint.every_steps=2'))
  result = train_in_process(config, tmp_path / 'run')
  assert len(result.losses) == 2 and all(np.isfinite(result.losses))
  proc = run_script('scripts/export_hf.py', '--workdir', str(tmp_path / 'run'), '--out',
                    str(tmp_path / 'out'))
  assert proc.returncode == 0, proc.stderr
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'out')
  assert exported.config.vocab_size == 384


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_with_identical_rewards_and_losses(prompts_file, tmp_path):
  config = load_config('single', *TINY, *grpo_overrides(prompts_file, 'train.steps=4',
                                                        'checkpoint.every_steps=2', 'grpo.kl_coef=0.1'))

  def rewards(result):
    return [r['grpo_reward'] for r in result.records if 'grpo_reward' in r]

  straight = train_in_process(config, tmp_path / 'straight')
  first = train_in_process(config, tmp_path / 'stopped', stop_at=2)
  assert first.stopped_by == 'SIGTERM' and int(first.state.step) == 2
  resumed = train_in_process(config, tmp_path / 'stopped')
  assert first.losses + resumed.losses == straight.losses and all(np.isfinite(straight.losses))
  assert rewards(first) + rewards(resumed) == rewards(straight)
  for a, b in zip(jax.tree.leaves((resumed.state.params, resumed.state.reference)),
                  jax.tree.leaves((straight.state.params, straight.state.reference))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_prompts_of_several_lengths_complete_as_each_prompt_alone_greedily(prompts_file):
  from mintrain.models.transformer import sampling

  config = load_config('single', *TINY, *grpo_overrides(prompts_file))
  run = build(config)
  rng = np.random.RandomState(0)
  prompt_BP = rng.randint(1, 250, (4, 7)).astype(np.int32)
  lengths_B = np.array([7, 2, 5, 3])
  with jax.set_mesh(run.mesh):
    state = run.init()
    model = run.model(state.params, state.frozen)
    keys_B = rollout.row_keys(0, 0, 4)
    together = np.asarray(sampling.complete(model, prompt_BP, lengths_B, 6, temperature=0.0, top_p=1.0,
                                            keys_B=keys_B))
    for b in range(4):
      alone = sampling.generate_without_cache(model, prompt_BP[b:b + 1, :lengths_B[b]], 6)
      np.testing.assert_array_equal(together[b], np.asarray(alone)[0])
