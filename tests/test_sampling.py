"""Sampling: the KV-cached decode computes what the training forward pass does, on any mesh."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import build, convert_layers, fill, load_config, mesh_devices, quiet, run_script

from mintrain import loop as train_loop
from mintrain import train_state
from mintrain.mesh import make_mesh
from mintrain.models.transformer import sampling
from mintrain.models.transformer.attention import BLHK
from mintrain.partitioning import AxisRules

# vocab_size 384 holds the tokenizer's BOS (256); batch 8 splits over every config's `batch` axes.
SMALL = (*helpers.SMALL, 'model.num_layers=2', 'model.vocab_size=384', 'model.embed_dim=32',
         'model.mlp_dim=64', 'train.global_batch_size=8')
B, P, N = 8, 5, 12


@pytest.fixture(scope='module')
def host_params():
  """Parameters drawn once and moved to each mesh: the init compile is the slow part."""
  config = load_config('single', *SMALL)
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  setup = build(config)
  with jax.set_mesh(mesh):
    return jax.device_get(setup.init().params)


def model_on(name, host_params, *overrides):
  """(mesh, rules, model) with the shared parameters in the storage layout of config `name`.

  With model.scan_layers=True among the overrides, the layers' parameters are stacked first.
  """
  config = load_config(name, *SMALL, *overrides)
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  rules = AxisRules.from_config(config.partitioning)
  setup = build(config)
  flat = {train_state.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(host_params)[0]}
  params = fill(setup.abstract_state.params,
                         convert_layers(flat, to_scanned=config.model.scan_layers))
  return mesh, rules, nnx.merge(setup.graphdef, params)


def random_tokens(shape, seed=0):
  return np.random.RandomState(seed).randint(0, 384, shape).astype(np.int32)


def test_greedy_sampling_is_deterministic(host_params):
  mesh, _, model = model_on('single', host_params)
  with jax.set_mesh(mesh):
    first = np.asarray(sampling.generate(model, random_tokens((B, P)), N))
    second = np.asarray(sampling.generate(model, random_tokens((B, P)), N))
  assert first.shape == (B, N) and first.dtype == np.int32
  assert ((0 <= first) & (first < 384)).all()
  np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize('name,overrides', [
    pytest.param('single', (), id='single'), pytest.param('dp4_tp2', (), id='dp4_tp2'),
    # The prompt's 5 queries in blocks of 2, the continuation's 3 too, each over the slots it may see.
    pytest.param('single', ('model.attention_block=2',), id='single-blocks'),
    pytest.param('tp8', (), id='tp8', marks=pytest.mark.slow),  # The default suite's time (7 min).
    pytest.param('dp4_tp2', ('model.scan_layers=True',), id='dp4_tp2-scanned', marks=pytest.mark.slow)])
def test_decode_in_chunks_gives_the_training_forward_logits(host_params, name, overrides):
  mesh, rules, model = model_on(name, host_params, *overrides)
  chunks = (P, 1, 1, 3, 1)  # A prompt prefill, single-token steps, and a multi-token continuation.
  tokens_BL = random_tokens((B, sum(chunks)), seed=1)
  graphdef, params = nnx.split(model)

  @jax.jit
  def cached_logits(params, tokens_BL):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(B, tokens_BL.shape[1], jnp.float32)
    out, start = [], 0
    for size in chunks:
      logits_BLV, cache = model.decode(tokens_BL[:, start:start + size], cache, start)
      out.append(logits_BLV)
      start += size
    return jnp.concatenate(out, axis=1), cache

  with jax.set_mesh(mesh):
    tokens_BL = jax.sharding.reshard(tokens_BL, jax.P())
    cached, cache = cached_logits(params, tokens_BL)
    full = jax.jit(lambda params, t: nnx.merge(graphdef, params)(t))(params, tokens_BL)
  assert cache[0][0].sharding.spec == rules.activation_spec(BLHK)  # Split like the activations.
  cached, full = np.asarray(cached), np.asarray(full)
  # The prompt's last position is what sampling reads first.
  np.testing.assert_allclose(cached[:, P - 1], full[:, P - 1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('name', ['single', pytest.param('dp4_tp2', marks=pytest.mark.slow)])
def test_generate_with_the_cache_equals_recomputing_the_prefix(host_params, name):
  mesh, _, model = model_on(name, host_params)
  prompt_BP = random_tokens((B, P), seed=2)
  with jax.set_mesh(mesh):
    for kwargs in ({'temperature': 0.0}, {'temperature': 1.0, 'top_k': 20, 'key': jax.random.key(3)}):
      cached = np.asarray(sampling.generate(model, prompt_BP, N, **kwargs))
      recomputed = np.asarray(sampling.generate_without_cache(model, prompt_BP, N, **kwargs))
      np.testing.assert_array_equal(cached, recomputed, err_msg=str(kwargs))
  assert len(np.unique(cached)) > 1  # The sampled run is not one repeated token.


def test_each_device_draws_the_next_tokens_of_its_own_rows():
  # The logits gather over `model` (the vocabulary) for each device's rows, not over `data` for the batch's:
  # only the drawn tokens (int32, one per row) are shared. The same draws on one device: test_grpo.py.
  run = build(load_config('dp4_tp2', *helpers.TINY))
  vocab = run.config.model.vocab_size
  with jax.set_mesh(run.mesh):
    state = run.init()
    graphdef, params = nnx.split(run.model(state.params, state.frozen))
    prompt_BP = sampling._replicated(np.tile(np.arange(1, 10, dtype=np.int32), (8, 1)))
    lengths_B = sampling._replicated(np.full(8, 9, np.int32))
    keys_B = jax.random.split(jax.random.key(0), 8)
    text = sampling._complete.lower(graphdef, params, prompt_BP, lengths_B, keys_B,
                                    max_new_tokens=4, temperature=1.0, top_p=0.9).compile().as_text()
  gathered = [line.split(' all-gather(')[0].split('= ')[-1] for line in text.splitlines()
              if ' all-gather(' in line]
  assert gathered and all(shape.startswith((f'f32[2,{vocab}]', 's32[8]')) for shape in gathered), gathered


def test_top_k_samples_only_the_k_most_likely_tokens():
  logits_V = np.random.RandomState(4).normal(size=50).astype(np.float32)
  logits_BV = np.tile(logits_V, (4000, 1))
  draws = sampling.sample_token(logits_BV, jax.random.key(5), temperature=1.0, top_k=5)
  assert set(np.asarray(draws).tolist()) == set(np.argsort(logits_V)[-5:].tolist())
  greedy = sampling.sample_token(logits_BV[:1], jax.random.key(6), temperature=1.0, top_k=1)
  assert int(greedy[0]) == int(np.argmax(logits_V))


@pytest.fixture(scope='module')
def trained_run(tmp_path_factory):
  """A workdir with the checkpoint of a 2-step run on dp4_tp2."""
  workdir = tmp_path_factory.mktemp('run')
  config = load_config('dp4_tp2', *SMALL, 'data.source=synthetic', 'train.steps=2', 'train.seq_len=32')
  train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=quiet)
  return workdir


def test_sample_script_continues_the_prompt_from_the_newest_checkpoint(trained_run):
  proc = run_script('scripts/sample.py', '--workdir', str(trained_run), '--prompt', 'def ',
                    '--max_new_tokens', '40')
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith('def ') and len(proc.stdout) > len('def \n')
  assert 'Sampling step 2 of' in proc.stderr and 'data=1 x fsdp=1 x model=1' in proc.stderr
  assert 'more than the 32 the model was trained on' in proc.stderr
  assert 'sampling memory per device: parameters ' in proc.stderr and '(batch 1, 45 positions)' in proc.stderr


@pytest.mark.slow  # Two runs of the script; test_scripts.py has the training loop's.
def test_sample_script_loads_its_compiled_programs_from_the_machines_cache(trained_run, tmp_path):
  cache = helpers.fresh_compilation_cache(tmp_path)
  first, again = (run_script('scripts/sample.py', '--workdir', str(trained_run), '--prompt', 'def ',
                             '--max_new_tokens', '8', env_extra=cache) for _ in range(2))
  assert first.returncode == 0 and again.returncode == 0, first.stderr[-2000:] + again.stderr[-2000:]
  assert "cache hit for 'jit__generate'" not in first.stderr
  assert "cache hit for 'jit__generate'" in again.stderr
  assert again.stdout == first.stdout


def test_sample_script_samples_on_the_mesh_of_a_given_config(trained_run):
  proc = run_script('scripts/sample.py', '--workdir', str(trained_run), '--prompt', 'x',
                    '--max_new_tokens', '8', '--temperature', '0', '--num_samples', '2',
                    '--config', 'mintrain/configs/dp4_tp2.py')
  assert proc.returncode == 0, proc.stderr
  assert 'data=4 x fsdp=1 x model=2' in proc.stderr
  assert 'replicating the batch' in proc.stderr  # 2 samples do not split 4 ways.
  samples = proc.stdout.split('--- sample 2 ---\n')
  assert samples[0].removeprefix('--- sample 1 ---\n') == samples[1]  # Greedy: the same twice.


@pytest.mark.slow  # Two script runs; test_context_parallel.py checks the sampler itself on this mesh.
def test_sample_script_on_a_context_mesh_continues_as_on_one_device(trained_run):
  args = ('scripts/sample.py', '--workdir', str(trained_run), '--prompt', 'def ', '--max_new_tokens', '12',
          '--temperature', '0')
  one = run_script(*args)
  context = run_script(*args, '--config', 'mintrain/configs/cp2_dp2_tp2.py')
  assert one.returncode == 0 and context.returncode == 0, one.stderr + context.stderr
  assert 'data=2 x fsdp=1 x context=2 x model=2' in context.stderr
  assert context.stdout == one.stdout  # BOS and 4 bytes: 4 prefilled over `context`, then 1 decode step.


def test_sample_script_without_a_checkpoint_is_a_one_line_error(tmp_path):
  proc = run_script('scripts/sample.py', '--workdir', str(tmp_path))
  assert proc.returncode == 2
  assert proc.stderr.startswith('error: ') and 'no complete checkpoint' in proc.stderr
  assert proc.stderr.count('\n') == 1 and 'Traceback' not in proc.stderr


@pytest.mark.parametrize('name,overrides', [
    pytest.param('single', (), id='single'),
    pytest.param('dp4_tp2', ('model.attention_block=2',), id='dp4_tp2-blocks'),
    # Local layers' buffers of 3 slots: the prefill keeps each row's last real keys, not its padding's.
    pytest.param('single', ('model.sliding_window=3', 'model.global_every=2'), id='windows'),
    pytest.param('cp2_dp2_tp2', ('model.sliding_window=3', 'model.global_every=2'), id='context-windows',
                 marks=pytest.mark.slow),
    pytest.param('deepseek_v3_ep4_dp2', ('mesh.data=1', 'mesh.expert=1', 'model.num_layers=2',
                                         'model.vocab_size=384', 'model.mtp_layers=0'), id='latent',
                 marks=pytest.mark.slow)])
def test_prompts_of_several_lengths_complete_as_each_prompt_alone(name, overrides):
  # One prefill of the padded prompts, then a step per token at each row's own position: a row's slots
  # past its prompt hold padding until its own tokens overwrite them, and no token may see it.
  config = load_config(name, *(SMALL if name != 'deepseek_v3_ep4_dp2' else ()), *overrides)
  run = build(config)
  lengths_B = np.array([9, 1, 4, 7, 2, 9, 5, 3])
  prompt_BP = random_tokens((B, 9), seed=4)
  with jax.set_mesh(run.mesh):
    model = run.model(run.init().params)
    keys_B = jax.random.split(jax.random.key(1), B)
    together = np.asarray(sampling.complete(model, prompt_BP, lengths_B, 6, temperature=0.0, top_p=1.0,
                                            keys_B=keys_B))
    # Each prompt alone, in a batch of its copies (the batch splits over `data`).
    alone = [np.asarray(sampling.generate(model, np.repeat(prompt_BP[b:b + 1, :n], B, axis=0), 6))[0]
             for b, n in enumerate(lengths_B)]
    # Sampled: each row's draws are its own (fold_in of its key), whatever its neighbours' lengths.
    drawn = np.asarray(sampling.complete(model, prompt_BP, lengths_B, 6, temperature=1.0, top_p=0.9,
                                         keys_B=keys_B))
    # Four of the rows alone, in a buffer as wide as their longest prompt (7).
    fewer = np.asarray(sampling.complete(model, prompt_BP[1:5, :7], lengths_B[1:5], 6, temperature=1.0,
                                         top_p=0.9, keys_B=keys_B[1:5]))
  np.testing.assert_array_equal(together, np.stack(alone))
  np.testing.assert_array_equal(drawn[1:5], fewer)
  assert len(np.unique(together)) > 1


def test_a_start_per_row_takes_one_token_and_a_last_per_row_is_a_prefill_at_zero(host_params):
  mesh, _, model = model_on('single', host_params)
  with jax.set_mesh(mesh):
    cache = model.init_cache(B, 8, jnp.float32)
    with pytest.raises(ValueError, match='one new token per row; got 2'):
      model.decode(random_tokens((B, 2)), cache, jnp.arange(B))
    with pytest.raises(ValueError, match='start must be 0'):
      model.decode(random_tokens((B, 2)), cache, 3, last=jnp.ones(B, jnp.int32))
