"""Hugging Face checkpoints: tiny random `transformers` models of each family, loaded by `mintrain.hf`,
give transformers' logits on several meshes; saved back, transformers loads them with the same logits."""

import json

import jax
import numpy as np
import pytest
import torch  # The reference, from the test extra; mintrain itself never imports it.
import transformers
from conftest import SCRIPT_DEFAULTS, build, load_config, mesh_devices, run_script
from flax import nnx

from mintrain import checkpoint as ckpt_lib
from mintrain import hf, sampling
from mintrain.fields import ConfigError
from mintrain.mesh import make_mesh
from mintrain.models import hf_model_options

COMMON = {'vocab_size': 256, 'hidden_size': 64, 'intermediate_size': 96, 'num_hidden_layers': 2,
          'num_attention_heads': 8, 'max_position_embeddings': 128}
FAMILIES = {
    # Grouped-query attention and Llama 3.1's RoPE scaling (a small original context, so it matters).
    'llama3': ('LlamaConfig', {'num_key_value_heads': 2, 'rms_norm_eps': 1e-5, 'tie_word_embeddings': False,
                               'rope_parameters': {'rope_type': 'llama3', 'rope_theta': 500000.0,
                                                   'factor': 8.0, 'low_freq_factor': 1.0,
                                                   'high_freq_factor': 4.0,
                                                   'original_max_position_embeddings': 16}}),
    'mistral': ('MistralConfig', {'num_key_value_heads': 4, 'head_dim': 8, 'sliding_window': 4096}),
    'qwen2': ('Qwen2Config', {'num_key_value_heads': 2, 'tie_word_embeddings': True}),
    'gemma': ('GemmaConfig', {'num_key_value_heads': 1, 'head_dim': 16}),  # Multi-query, as Gemma 2B.
    # Mixtures of experts: 4 experts, 2 per token, in every block; Qwen2-MoE's every second block, with a
    # dense MLP between, a shared expert and top-k weights not renormalised.
    'mixtral': ('MixtralConfig', {'num_key_value_heads': 2, 'num_local_experts': 4,
                                  'num_experts_per_tok': 2}),
    'qwen2_moe': ('Qwen2MoeConfig', {'num_key_value_heads': 2, 'num_experts': 4, 'num_experts_per_tok': 2,
                                     'moe_intermediate_size': 48, 'shared_expert_intermediate_size': 80,
                                     'decoder_sparse_step': 2, 'norm_topk_prob': False}),
}
MOE = ('mixtral', 'qwen2_moe')


@pytest.fixture(scope='module', params=list(FAMILIES))
def reference(request, tmp_path_factory):
  """(directory, tokens, transformers' float32 logits) of one tiny random model."""
  return make_reference(request.param, tmp_path_factory)


@pytest.fixture(scope='module', params=MOE)
def moe_reference(request, tmp_path_factory):
  return make_reference(request.param, tmp_path_factory)


def make_reference(family, tmp_path_factory):
  name, options = FAMILIES[family]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**COMMON, **options),
                                                       dtype=torch.float32)
  with torch.no_grad():  # Norm weights are drawn as ones (zeros for Gemma); make them matter.
    for param_name, param in model.named_parameters():
      if param_name.endswith(('norm.weight', 'bias', '.gate.weight')):  # A router drawn as zeros ties.
        param.add_(0.1 * torch.randn_like(param))
  directory = tmp_path_factory.mktemp(family)
  model.save_pretrained(directory)
  tokens = np.random.RandomState(1).randint(0, 256, (8, 24)).astype(np.int32)
  with torch.no_grad():
    logits = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  return directory, tokens, logits


def mintrain_logits(model, tokens):
  graphdef, params = nnx.split(model)
  return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))


@pytest.mark.parametrize('mesh_name', ['single', 'dp4_tp2', 'tp8', 'fsdp8'])
def test_a_loaded_checkpoint_gives_the_logits_of_transformers(reference, mesh_name):
  directory, tokens, expected = reference
  config = load_config(mesh_name)
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  with jax.set_mesh(mesh):
    model = hf.from_pretrained(directory)
    logits = mintrain_logits(model, tokens)
  assert np.abs(logits - expected).max() <= 1e-4


@pytest.mark.parametrize('mesh', [
    pytest.param(('mesh.data=2', 'mesh.fsdp=1', 'mesh.expert=4', 'mesh.model=1'), id='expert4_data2',
                 marks=pytest.mark.slow),
    pytest.param(('mesh.data=1', 'mesh.fsdp=2', 'mesh.expert=2', 'mesh.model=2'), id='expert2_model2_fsdp2')])
def test_a_mixture_gives_the_logits_of_transformers_with_its_experts_split(moe_reference, mesh):
  directory, tokens, expected = moe_reference
  config = load_config('dp4_tp2', *mesh)
  with jax.set_mesh(make_mesh(config.mesh.sizes, mesh_devices(config))):
    model = hf.from_pretrained(directory)
    assert tuple(jax.typeof(model.blocks[1].mlp.wi_gate_EDF[...]).sharding.spec)[0] == 'expert'
    logits = mintrain_logits(model, tokens)
  assert np.abs(logits - expected).max() <= 1e-4


def test_greedy_generation_with_the_kv_cache_equals_transformers_generate(reference):
  directory, tokens, _ = reference
  reference_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  reference_model.generation_config.eos_token_id = None  # 32 tokens, whatever they are.
  prompt = tokens[:2, :6]
  with torch.no_grad():
    expected = reference_model.generate(torch.from_numpy(prompt.astype(np.int64)), max_new_tokens=32,
                                        do_sample=False).numpy()[:, 6:]
  with jax.set_mesh(make_mesh(load_config('single').mesh.sizes, mesh_devices(load_config('single')))):
    generated = np.asarray(sampling.generate(hf.from_pretrained(directory), prompt, 32))
  np.testing.assert_array_equal(generated, expected)


def test_a_saved_checkpoint_loads_in_transformers_with_the_same_logits(reference, tmp_path):
  directory, tokens, expected = reference
  with jax.set_mesh(make_mesh(load_config('dp4_tp2').mesh.sizes, mesh_devices(load_config('dp4_tp2')))):
    model = hf.from_pretrained(directory)
    hf.save_pretrained(model, tmp_path / 'out', max_shard_size=100_000)  # Several shards and an index.
    again = hf.from_pretrained(tmp_path / 'out')
  assert (tmp_path / 'out' / hf.INDEX).exists()
  for (_, x), (_, y) in zip(nnx.to_flat_state(nnx.split(model, nnx.Param)[1]),
                            nnx.to_flat_state(nnx.split(again, nnx.Param)[1])):
    np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]))  # Import-export-import: bitwise.
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'out', dtype=torch.float32)
  with torch.no_grad():
    logits = loaded(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  assert np.abs(logits - expected).max() <= 1e-4


def test_unsupported_checkpoints_are_one_line_errors(tmp_path):
  (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'gpt2'}))
  with pytest.raises(ConfigError, match=r"model_type='gpt2' is not supported; mintrain reads gemma, llama"):
    hf.from_pretrained(tmp_path)
  config = {'model_type': 'llama', **COMMON, 'rope_parameters': {'rope_type': 'yarn', 'factor': 2.0}}
  (tmp_path / 'config.json').write_text(json.dumps(config))
  with pytest.raises(ConfigError, match=r"rope type 'yarn' is not supported"):
    hf.from_pretrained(tmp_path)


def test_fine_tune_from_a_checkpoint_then_export_gives_transformers_the_trained_logits(tmp_path):
  torch.manual_seed(0)
  config = transformers.LlamaConfig(**{**COMMON, 'vocab_size': 384}, num_key_value_heads=2)
  transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / 'hf')
  workdir = tmp_path / 'run'
  proc = run_script('scripts/train.py', '--config', 'configs/dp4_tp2.py', '--workdir', str(workdir),
                    f'--config.init.hf_checkpoint={tmp_path / "hf"}', '--config.train.steps=12',
                    '--config.train.log_every=1', '--config.train.seq_len=32', *SCRIPT_DEFAULTS)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f'Initialising the parameters from the Hugging Face checkpoint {tmp_path / "hf"}' in proc.stdout
  losses = [r['loss'] for r in map(json.loads, (workdir / 'metrics.jsonl').read_text().splitlines())
            if 'loss' in r]
  assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3])
  proc = run_script('scripts/export_hf.py', '--workdir', str(workdir), '--out', str(tmp_path / 'out'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Wrote step 12' in proc.stdout

  reader = ckpt_lib.Checkpoints(workdir / 'checkpoints', read_only=True)
  run = build(load_config('single', *(f'model.{k}={v}' for k, v in hf_model_options(tmp_path / 'hf').items()
                                      if k != 'name')))
  params = reader.restore(12, run.abstract_state, params_only=True).state['params']
  tokens = np.random.RandomState(2).randint(0, 384, (2, 16)).astype(np.int32)
  with jax.set_mesh(run.mesh):
    trained = mintrain_logits(run.model(params), tokens)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'out', dtype=torch.float32)
  with torch.no_grad():
    logits = exported(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  assert np.abs(logits - trained).max() <= 1e-4
