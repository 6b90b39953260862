"""Hugging Face checkpoints: tiny random `transformers` models of each family, loaded by `mintrain.hf`,
give transformers' logits on several meshes; saved back, transformers loads them with the same logits."""

import ctypes
import json
import os
import re
import subprocess
import sys

import hf_reference
import jax
import numpy as np
import pytest
import torch  # The reference, from the test extra; mintrain itself never imports it.
import transformers
from flax import nnx
from helpers import (
  REPO,
  SCRIPT_DEFAULTS,
  TOKENIZER_VOCAB,
  build,
  load_config,
  mesh_devices,
  run_script,
  script_env,
  stdlib_texts,
)
from hf_reference import mintrain_logits, torch_logits
from safetensors.numpy import load_file, save_file

from mintrain import config as config_lib
from mintrain import configs, hf
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.data import tokenizer
from mintrain.errors import ConfigError
from mintrain.hf import safetensors as safetensors_reader
from mintrain.mesh import make_mesh
from mintrain.models import hf_model_options
from mintrain.models.transformer import hf as hf_llama
from mintrain.models.transformer import hf_config, sampling
from mintrain.runtime import host_allocator

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
    # QK-norm, and head_dim * heads (96) unlike hidden_size (64), as Qwen3's.
    'qwen3': ('Qwen3Config', {'num_key_value_heads': 2, 'head_dim': 12, 'tie_word_embeddings': False}),
    # Mixtures of experts: 4 experts, 2 per token, in every block; Qwen2-MoE's every second block, with a
    # dense MLP between, a shared expert and top-k weights not renormalised.
    'mixtral': ('MixtralConfig', {'num_key_value_heads': 2, 'num_local_experts': 4,
                                  'num_experts_per_tok': 2}),
    'qwen2_moe': ('Qwen2MoeConfig', {'num_key_value_heads': 2, 'num_experts': 4, 'num_experts_per_tok': 2,
                                     'moe_intermediate_size': 48, 'shared_expert_intermediate_size': 80,
                                     'decoder_sparse_step': 2, 'norm_topk_prob': False}),
    # QK-norm with experts in blocks 1 and 2 (block 0 in mlp_only_layers), top-k renormalised.
    'qwen3_moe': ('Qwen3MoeConfig', {'num_hidden_layers': 3, 'num_key_value_heads': 2, 'head_dim': 12,
                                     'num_experts': 4, 'num_experts_per_tok': 2, 'moe_intermediate_size': 48,
                                     'decoder_sparse_step': 1, 'mlp_only_layers': [0],
                                     'norm_topk_prob': True}),
    # Latent attention (low-rank queries, YaRN with mscale_all_dim) and, after one dense block, 8 experts
    # in 4 groups behind a sigmoid router with its bias, 2 of the best 2 groups' experts per token, and 2
    # shared experts; the plain variant has a plain query projection and no YaRN.
    'deepseek_v3': ('DeepseekV3Config', {'num_hidden_layers': 3, 'q_lora_rank': 32, 'kv_lora_rank': 16,
                                         'qk_rope_head_dim': 8, 'qk_nope_head_dim': 12, 'v_head_dim': 10,
                                         'n_routed_experts': 8, 'num_experts_per_tok': 2, 'n_group': 4,
                                         'topk_group': 2, 'first_k_dense_replace': 1, 'n_shared_experts': 2,
                                         'moe_intermediate_size': 48, 'routed_scaling_factor': 2.5,
                                         'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 10000.0,
                                                             'factor': 8.0, 'mscale': 1.0,
                                                             'mscale_all_dim': 0.8,
                                                             'original_max_position_embeddings': 16}}),
    'deepseek_v3_plain_q': ('DeepseekV3Config', {'num_hidden_layers': 2, 'q_lora_rank': None,
                                                 'kv_lora_rank': 16, 'qk_rope_head_dim': 8,
                                                 'qk_nope_head_dim': 8, 'v_head_dim': 16,
                                                 'n_routed_experts': 4, 'num_experts_per_tok': 2,
                                                 'n_group': 1, 'topk_group': 1, 'first_k_dense_replace': 0,
                                                 'n_shared_experts': 1,
                                                 'moe_intermediate_size': 48, 'norm_topk_prob': False}),
}
MOE = ('mixtral', 'qwen2_moe', 'qwen3_moe', 'deepseek_v3')
# The default suite (its time) checks Llama 3's logits on every mesh and the other families' on one device and
# dp4_tp2; tp8 and fsdp8 are in the slow set. The plain-query DeepSeek-V3 is tested on one device alone
# outside the slow set.
SLOW_MESHES = {**{family: ('tp8', 'fsdp8') for family in FAMILIES if family != 'llama3'},
               'deepseek_v3_plain_q': ('dp4_tp2', 'tp8', 'fsdp8')}
SLOW_FAMILIES = ('deepseek_v3_plain_q',)
SLOW_EXPERT_SPLITS = ('qwen3_moe', 'deepseek_v3')  # Mixtral's and Qwen2-MoE's in the default suite.
# Their generation (a compile of every decode shape) is in the slow set; Qwen2-MoE's covers a mixture's.
SLOW_GENERATION = ('mixtral', 'qwen3_moe', 'deepseek_v3', *SLOW_FAMILIES)


def random_model(family, directory, **changes):
  """A tiny random `transformers` model of `family` (FAMILIES), saved in `directory`."""
  return hf_reference.random_model(FAMILIES, COMMON, family, directory, **changes)


TOKENS = np.random.RandomState(1).randint(0, 256, (8, 24)).astype(np.int32)


@pytest.fixture(scope='module', params=[
    pytest.param(family, marks=[pytest.mark.slow] if family in SLOW_FAMILIES else []) for family in FAMILIES])
def reference(request, tmp_path_factory):
  """(directory, tokens, transformers' float32 logits) of one tiny random model."""
  directory = tmp_path_factory.mktemp(request.param)
  return directory, TOKENS, torch_logits(random_model(request.param, directory), TOKENS)


@pytest.fixture(scope='module', params=[  # The newer mixtures' expert splits in the slow set.
    pytest.param(family, marks=[pytest.mark.slow] if family in SLOW_EXPERT_SPLITS else []) for family in MOE])
def moe_reference(request, tmp_path_factory):
  """As `reference`, of the mixtures of experts alone."""
  directory = tmp_path_factory.mktemp(request.param)
  return directory, TOKENS, torch_logits(random_model(request.param, directory), TOKENS)


def base(*overrides):
  """mintrain/configs/base.py with `key=value` overrides, as `hf.from_pretrained(base=...)` takes it."""
  return config_lib.load(configs.DIR / 'base.py', overrides)


def on_mesh(name):
  config = load_config(name)
  return jax.set_mesh(make_mesh(config.mesh.sizes, mesh_devices(config)))


@pytest.mark.parametrize(('reference', 'mesh_name'), [
    pytest.param(family, mesh, marks=[pytest.mark.slow] if mesh in SLOW_MESHES.get(family, ()) else [])
    for family in FAMILIES for mesh in ('single', 'dp4_tp2', 'tp8', 'fsdp8')], indirect=['reference'])
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


def test_a_scanned_mixture_with_its_experts_split_gives_the_logits_and_saves_back_the_same_tensors(tmp_path):
  """Scanned layers and stacked experts together: a parameter (layers, experts, ...) of one tensor each."""
  reference = random_model('mixtral', tmp_path / 'in')
  config = load_config('dp4_tp2', 'mesh.data=1', 'mesh.fsdp=2', 'mesh.expert=2', 'mesh.model=2')
  with jax.set_mesh(make_mesh(config.mesh.sizes, mesh_devices(config))):
    model = hf.from_pretrained(tmp_path / 'in', base=base('model.scan_layers=True'))
    assert model.blocks.mlp.wi_gate_EDF.shape == (2, 4, 64, 96)  # (layers, experts, D, F).
    logits = mintrain_logits(model, TOKENS)
    hf.save_pretrained(model, tmp_path / 'out', max_shard_size=100_000)
  assert np.abs(logits - torch_logits(reference, TOKENS)).max() <= 1e-4
  saved = {}
  for file in (tmp_path / 'out').glob('*.safetensors'):
    saved |= load_file(file)
  original = load_file(tmp_path / 'in' / hf.SINGLE)
  assert saved.keys() == original.keys()
  for name, tensor in original.items():
    np.testing.assert_array_equal(saved[name], tensor, err_msg=name)


@pytest.mark.parametrize('reference', [
    pytest.param(family, marks=[pytest.mark.slow] if family in SLOW_GENERATION else [])
    for family in FAMILIES], indirect=True)
def test_greedy_generation_with_the_kv_cache_equals_transformers_generate(reference):
  directory, tokens, _ = reference
  reference_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  reference_model.generation_config.eos_token_id = None  # 32 tokens, whatever they are.
  prompt = tokens[:2, :6]
  with torch.no_grad():
    expected = reference_model.generate(torch.from_numpy(prompt.astype(np.int64)), max_new_tokens=32,
                                        do_sample=False).numpy()[:, 6:]
  # The prompt's 6 queries in blocks of 4 and 2 (`model.attention_block`), each over the slots it may see.
  blocks = config_lib.load(configs.DIR / 'base.py', ['model.attention_block=4'])
  with jax.set_mesh(make_mesh(load_config('single').mesh.sizes, mesh_devices(load_config('single')))):
    generated = np.asarray(sampling.generate(hf.from_pretrained(directory, base=blocks), prompt, 32))
  np.testing.assert_array_equal(generated, expected)


def test_a_model_loaded_outside_a_mesh_is_callable_and_samples_as_it_is(llama3):
  directory, reference_model = llama3
  model = hf.from_pretrained(directory)  # No mesh: one device.
  assert np.abs(np.asarray(model(TOKENS)) - torch_logits(reference_model, TOKENS)).max() <= 1e-4
  with jax.set_mesh(make_mesh(load_config('single').mesh.sizes, mesh_devices(load_config('single')))):
    expected = np.asarray(sampling.generate(model, TOKENS[:2, :6], 4))
  np.testing.assert_array_equal(np.asarray(sampling.generate(model, TOKENS[:2, :6], 4)), expected)


def test_a_saved_checkpoint_loads_in_transformers_with_the_same_logits(reference, tmp_path):
  directory, tokens, expected = reference
  with jax.set_mesh(make_mesh(load_config('dp4_tp2').mesh.sizes, mesh_devices(load_config('dp4_tp2')))):
    model = hf.from_pretrained(directory)
    hf.save_pretrained(model, tmp_path / 'out', max_shard_size=100_000)  # Several shards and an index.
    again = hf.from_pretrained(tmp_path / 'out')
  assert (tmp_path / 'out' / hf.INDEX).exists()
  assert hf_model_options(tmp_path / 'out') == hf_model_options(directory)  # Mistral's window too.
  for (_, x), (_, y) in zip(nnx.to_flat_state(nnx.split(model, nnx.Param)[1]),
                            nnx.to_flat_state(nnx.split(again, nnx.Param)[1])):
    np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]))  # Import-export-import: bitwise.
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'out', dtype=torch.float32)
  with torch.no_grad():
    logits = loaded(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  assert np.abs(logits - expected).max() <= 1e-4


@pytest.fixture(scope='module')
def llama3(tmp_path_factory):
  """(directory, the transformers model) of the tiny Llama 3 (grouped heads, RoPE scaling, untied)."""
  directory = tmp_path_factory.mktemp('llama3')
  return directory, random_model('llama3', directory)


TARGETS = np.random.RandomState(2).randint(0, 256, TOKENS.shape).astype(np.int32)


@pytest.fixture(scope='module')
def llama3_gradients(llama3, tmp_path_factory):
  """(loss, {tensor name: gradient}) of transformers' mean cross-entropy of TOKENS against TARGETS."""
  _, model = llama3
  model.zero_grad()
  logits = model(torch.from_numpy(TOKENS.astype(np.int64))).logits
  loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           torch.from_numpy(TARGETS.astype(np.int64)).reshape(-1))
  loss.backward()
  return float(loss.detach()), {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


OPTIONS = {  # Model options that compute the same function as the defaults.
    'scan_layers_remat': ('model.scan_layers=True', 'model.remat=full'),
    'fused_loss': ('model.loss_chunks=4',),  # Over 4 chunks of the sequence.
    'scan_layers': ('model.scan_layers=True',),
    'remat': ('model.remat=save_matmuls',),
    'dot_product': ('model.attention=dot_product',),
    'logits_then_loss': ('model.loss_chunks=0',),
    'attention_blocks': ('model.attention_block=5',),  # 24 queries in blocks of 5 (the last of 4).
}
SLOW_OPTIONS = ('scan_layers', 'remat', 'dot_product', 'logits_then_loss')  # About 12 s each.


@pytest.mark.parametrize('option', [pytest.param(o, marks=[pytest.mark.slow] if o in SLOW_OPTIONS else [])
                                    for o in OPTIONS])
def test_with_each_model_option_the_logits_loss_and_gradients_are_those_of_transformers(
    llama3, llama3_gradients, option, tmp_path):
  directory, reference = llama3
  expected_loss, expected_grads = llama3_gradients
  with on_mesh('fsdp4_tp2'):
    model = hf.from_pretrained(directory, base=base(*OPTIONS[option]))
    graphdef, state = nnx.split(model)
    logits = mintrain_logits(model, TOKENS)
    batch = {'inputs': TOKENS, 'targets': TARGETS}  # Split over the batch axes, as the loop gives it.
    batch = {k: jax.device_put(v, jax.P(('data', 'fsdp', 'expert'))) for k, v in batch.items()}
    loss, grads = jax.jit(jax.value_and_grad(lambda state: nnx.merge(graphdef, state).loss(batch)[0]))(state)
    hf.save_pretrained(nnx.merge(graphdef, grads), tmp_path)  # The gradients in transformers' names.
  assert np.abs(logits - torch_logits(reference, TOKENS)).max() <= 1e-4
  assert abs(float(loss) - expected_loss) <= 1e-5
  written = load_file(tmp_path / hf.SINGLE)
  assert written.keys() == expected_grads.keys()
  for name, grad in expected_grads.items():
    np.testing.assert_allclose(written[name], grad, atol=1e-6, err_msg=name)


def test_bfloat16_compute_gives_logits_close_to_transformers_float32(llama3):
  directory, reference = llama3
  expected = torch_logits(reference, TOKENS)
  with on_mesh('dp4_tp2'):
    logits = mintrain_logits(hf.from_pretrained(directory, base=base('model.compute_dtype=bfloat16')), TOKENS)
  assert np.abs(logits - expected).max() <= 0.02 * np.abs(expected).max()
  assert (logits.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


def test_scanned_layers_load_on_tp8_and_save_back_the_same_tensors(llama3, tmp_path):
  directory, _ = llama3
  with on_mesh('tp8'):
    model = hf.from_pretrained(directory, base=base('model.scan_layers=True'))
    assert model.blocks.attn.wq_DHK.shape == (COMMON['num_hidden_layers'], 64, 8, 8)  # Stacked on `layers`.
    hf.save_pretrained(model, tmp_path, max_shard_size=100_000)
  saved = {}
  for file in tmp_path.glob('*.safetensors'):
    saved |= load_file(file)
  original = load_file(directory / hf.SINGLE)
  assert saved.keys() == original.keys()
  for name, tensor in original.items():
    np.testing.assert_array_equal(saved[name], tensor, err_msg=name)


def test_a_mistral_fine_tune_may_train_on_sequences_longer_than_its_window(tmp_path):
  """The window is applied (tests/test_sliding_window.py), so a longer train.seq_len is no error."""
  random_model('mistral', tmp_path, sliding_window=16)
  fine_tune = load_config('dp4_tp2', f'init.hf_checkpoint={tmp_path}', 'data.tokenizer=byte',
                          'train.seq_len=32')
  assert fine_tune.model.sliding_window == 16 and fine_tune.model.global_every == 0


def test_qwen3_with_tied_output_gives_the_logits_of_transformers_and_saves_back_tied(tmp_path):
  reference = random_model('qwen3', tmp_path / 'in', tie_word_embeddings=True)
  with on_mesh('dp4_tp2'):
    model = hf.from_pretrained(tmp_path / 'in')
    logits = mintrain_logits(model, TOKENS)
    hf.save_pretrained(model, tmp_path / 'out')
  assert np.abs(logits - torch_logits(reference, TOKENS)).max() <= 1e-4
  assert 'lm_head.weight' not in load_file(tmp_path / 'out' / hf.SINGLE)
  options = hf_model_options(tmp_path / 'out')
  assert options == hf_model_options(tmp_path / 'in') and options['tie_embeddings'] and options['qk_norm']


def test_scanned_qwen3_layers_stack_their_qk_norm_scales_and_give_the_logits_of_transformers(tmp_path):
  reference = random_model('qwen3', tmp_path)
  with on_mesh('fsdp8'):
    model = hf.from_pretrained(tmp_path, base=base('model.scan_layers=True'))
    assert model.blocks.attn.q_norm_K.shape == (2, 12)  # (layers, head_dim).
    logits = mintrain_logits(model, TOKENS)
  assert np.abs(logits - torch_logits(reference, TOKENS)).max() <= 1e-4


def test_qk_norm_exports_as_qwen3_or_qwen3_moe_only():
  with pytest.raises(ConfigError, match=r'^model.qk_norm has a Hugging Face architecture as Qwen3 or Qwen3-'):
    hf_llama.config_json(load_config('single', 'model.qk_norm=True', 'model.qkv_bias=True').model, 'float32')
  moe = load_config('single', 'model.qk_norm=True', 'model.num_experts=4', 'model.dense_layers=(1,)').model
  assert hf_llama.config_json(moe, 'float32')['mlp_only_layers'] == [1]


def test_qwen2_moe_mlp_only_layers_become_dense_layers():
  qwen2_moe = {'model_type': 'qwen2_moe', **COMMON, 'num_experts': 4, 'moe_intermediate_size': 48,
               'shared_expert_intermediate_size': 80, 'mlp_only_layers': [1]}
  assert hf_llama.model_options(qwen2_moe)['dense_layers'] == (1,)


def test_qwen2_sliding_window_applies_to_the_layers_from_max_window_layers_on():
  qwen2 = {'model_type': 'qwen2', **COMMON, 'sliding_window': 8}
  assert hf_config.windows({**qwen2, 'use_sliding_window': False}) == (0, 0)
  assert hf_config.windows({**qwen2, 'use_sliding_window': True, 'max_window_layers': 0}) == (8, 0)
  assert hf_config.windows({**qwen2, 'use_sliding_window': True, 'max_window_layers': 2}) == (0, 0)
  # Local layers after global ones are not a pattern mintrain has (all but every N-th local).
  with pytest.raises(ConfigError, match=r'^config.json layer_types \[.*\] is not supported'):
    hf_config.windows({**qwen2, 'use_sliding_window': True, 'max_window_layers': 1})
  assert hf_config.windows({'model_type': 'mistral', **COMMON, 'sliding_window': None}) == (0, 0)


def test_unsupported_checkpoints_are_one_line_errors(tmp_path):
  (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'gpt2'}))
  with pytest.raises(ConfigError, match=r"^config.json model_type='gpt2' is not supported; mintrain reads "
                                        r'deepseek_v3, gemma, gemma2, gemma3, gemma3_text, llama, mistral, '
                                        r'mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe; convert'):
    hf.from_pretrained(tmp_path)
  config = {'model_type': 'llama', **COMMON, 'rope_parameters': {'rope_type': 'longrope', 'factor': 2.0}}
  (tmp_path / 'config.json').write_text(json.dumps(config))
  with pytest.raises(ConfigError, match=r"^config.json rope_type 'longrope' is not supported; mintrain "
                                        r"reads 'default', 'llama3', 'linear', 'dynamic', 'yarn', .*: load a "
                                        r'checkpoint'):
    hf.from_pretrained(tmp_path)


def broken_copy(directory, out, *, drop=None, config_changes=None):
  """`directory`'s checkpoint copied to `out`, without tensor `drop` or with config.json changed."""
  out.mkdir()
  tensors = load_file(directory / hf.SINGLE)
  save_file({k: v for k, v in tensors.items() if k != drop}, out / hf.SINGLE, metadata={'format': 'pt'})
  config = json.loads((directory / 'config.json').read_text())
  (out / 'config.json').write_text(json.dumps({**config, **(config_changes or {})}))
  return out


def test_a_missing_tensor_and_a_shape_that_disagrees_with_config_json_are_one_line_errors(llama3, tmp_path):
  directory, _ = llama3
  with pytest.raises(ConfigError, match=r"has no tensor 'lm_head.weight' \(mintrain parameter unembed_DV\); "
                                        r'its weights and config.json disagree .*: use the config.json'):
    hf.from_pretrained(broken_copy(directory, tmp_path / 'missing', drop='lm_head.weight'))
  with pytest.raises(ConfigError, match=r'tensor model.layers.0.mlp.gate_proj.weight has shape \(96, 64\), '
                                        r'but config.json makes it \(128, 64\): use the config.json saved'):
    hf.from_pretrained(broken_copy(directory, tmp_path / 'shape', config_changes={'intermediate_size': 128}))


def damaged_config(directory, out, damage):
  """`directory`'s checkpoint copied to `out`, its config.json changed by `damage` (dict -> JSON value)."""
  broken_copy(directory, out)
  (out / 'config.json').write_text(json.dumps(damage(json.loads((out / 'config.json').read_text()))))
  return out


@pytest.mark.parametrize('damage, says', [
    (lambda c: {k: v for k, v in c.items() if k != 'hidden_size'},
     r"^config.json has no 'hidden_size', which a llama checkpoint needs: use the config.json saved with"),
    (lambda c: {**c, 'rope_parameters': {'rope_type': 'llama3', 'rope_theta': 500000.0, 'factor': 8.0}},
     r"^config.json: rope type 'llama3' needs low_freq_factor, high_freq_factor, "
     r'original_max_position_embeddings beside it \(in rope_parameters or rope_scaling\)'),
    (lambda c: [c], r'config.json holds a JSON list, not an object of model settings: use the config.json'),
], ids=['no_hidden_size', 'rope_keys', 'list'])
def test_a_damaged_config_json_is_a_one_line_error(llama3, tmp_path, damage, says):
  directory, _ = llama3
  with pytest.raises(ConfigError, match=says) as raised:
    hf.from_pretrained(damaged_config(directory, tmp_path / 'damaged', damage))
  assert '\n' not in str(raised.value)


def test_weights_of_more_layers_than_config_json_are_refused_unless_not_strict(llama3, tmp_path, caplog):
  directory, _ = llama3
  fewer = damaged_config(directory, tmp_path / 'fewer', lambda c: {**c, 'num_hidden_layers': 1})
  with pytest.raises(ConfigError, match=r"the model config.json describes does not use 9 of the checkpoint's "
                                        r'tensors \(model.layers.1.\*\); config.json and the weights '
                                        r'disagree \(e.g. num_hidden_layers\): use the config.json saved '
                                        r'with these weights, or init.hf_strict=False to drop them.$'):
    hf.from_pretrained(fewer)
  with caplog.at_level('WARNING', logger='mintrain'), on_mesh('single'):
    logits = mintrain_logits(hf.from_pretrained(fewer, base=base('init.hf_strict=False')), TOKENS)
  assert "does not use 9 of the checkpoint's tensors (model.layers.1.*)" in caplog.text
  # transformers also drops them: the one-layer models agree.
  theirs = transformers.AutoModelForCausalLM.from_pretrained(fewer, dtype=torch.float32)
  assert np.abs(logits - torch_logits(theirs, TOKENS)).max() <= 1e-4


@pytest.mark.parametrize('problem', ['shape', 'layers', pytest.param('model_type', marks=pytest.mark.slow)])
def test_train_script_with_a_bad_hf_checkpoint_exits_2_with_one_line(tmp_path, problem):
  random_model('llama3', tmp_path / 'good', vocab_size=384)  # Holds the byte tokenizer's 257 ids.
  changes = {'model_type': {'model_type': 'gpt2'}, 'shape': {'intermediate_size': 128},
             'layers': {'num_hidden_layers': 1}}[problem]
  bad = broken_copy(tmp_path / 'good', tmp_path / 'bad', config_changes=changes)
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir',
                    str(tmp_path / 'run'),
                    f'--config.init.hf_checkpoint={bad}', '--config.train.seq_len=16',
                    '--config.data.tokenizer=byte', *SCRIPT_DEFAULTS)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr and proc.stderr.count('\n') == 1, proc.stderr
  expected = {'model_type': "model_type='gpt2' is not supported", 'shape': 'config.json makes it',
              'layers': 'init.hf_strict=False'}[problem]
  assert proc.stderr.startswith('error: ') and expected in proc.stderr, proc.stderr
  assert not (tmp_path / 'run').exists() or not any((tmp_path / 'run').iterdir())  # Nothing written.


def test_train_script_with_a_hf_checkpoint_without_tokenizer_exits_2_unless_told_bytes(tmp_path):
  random_model('llama3', tmp_path / 'hf', vocab_size=384)  # config.json and weights, no tokenizer files.
  workdir = tmp_path / 'run'
  workdir.mkdir()
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir', str(workdir),
                    f'--config.init.hf_checkpoint={tmp_path / "hf"}', '--config.train.seq_len=16',
                    *SCRIPT_DEFAULTS)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr == (f"error: init.hf_checkpoint='{tmp_path / 'hf'}' holds neither tokenizer.json nor "
                         'tokenizer.model: pass data.tokenizer=byte to train on bytes, or add the tokenizer '
                         'files to the directory.\n'), proc.stderr
  assert not any(workdir.iterdir())


@pytest.mark.slow  # ~25 s; the fine-tune end to end of tests/test_fine_tune_chat.py is slow too.
def test_fine_tune_with_the_checkpoint_tokenizer_and_scanned_layers_then_export_gives_transformers_the_model(
    tmp_path, bpe_tokenizer):
  """The directory brings its tokenizer (a transformers tokenizer of the BPE trained in conftest.py): the run
  tokenizes text files with it, sample.py decodes with it, and the export carries it to AutoTokenizer.
  The layers are scanned and rematerialised, in training, export and sampling."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(**{**COMMON, 'vocab_size': TOKENIZER_VOCAB}, num_key_value_heads=2)
  transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / 'hf')
  transformers.AutoTokenizer.from_pretrained(bpe_tokenizer).save_pretrained(tmp_path / 'hf')
  (tmp_path / 'text').mkdir()
  for i, text in enumerate(stdlib_texts(2 << 20)[-12:]):
    (tmp_path / 'text' / f'{i:02d}.py.txt').write_text(text)
  workdir = tmp_path / 'run'
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', '--workdir', str(workdir),
                    f'--config.init.hf_checkpoint={tmp_path / "hf"}', '--config.train.steps=12',
                    '--config.train.log_every=1', '--config.train.seq_len=32', '--config.data.source=text',
                    f'--config.data.path={tmp_path / "text" / "*.txt"}', '--config.data.eval_fraction=0.2',
                    '--config.model.scan_layers=True', '--config.model.remat=full', *SCRIPT_DEFAULTS,
                    '--config.eval.steps=1')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f'Initialising the parameters from the Hugging Face checkpoint {tmp_path / "hf"}' in proc.stdout
  source = f'init.hf_checkpoint={tmp_path / "hf"}'
  assert re.search(rf'^tokenizer: Hugging Face tokenizer.json, \d+ ids, from {source}$', proc.stdout, re.M)
  records = list(map(json.loads, (workdir / 'metrics.jsonl').read_text().splitlines()))
  losses = [r['loss'] for r in records if 'loss' in r]
  assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3])
  [final] = [r for r in records if 'eval_loss' in r]
  assert 1.5 < final['eval_bits_per_token'] / final['eval_bits_per_byte'] < 4  # Bytes per token, measured.
  proc = run_script('scripts/export_hf.py', '--workdir', str(workdir), '--out', str(tmp_path / 'out'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Wrote step 12' in proc.stdout and 'tokenizer.json' in proc.stdout

  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / 'out')
  ours = tokenizer.load(str(tmp_path / 'hf'))
  text = 'def parse(path):\n    """Read a file."""\n    return open(path).read()\n'
  ids = ours.document(text)[:-1].astype(np.int32)  # <s> and the text, without </s>.
  assert theirs(text).input_ids == ids.tolist()  # Their conventions: <s> before the text.
  reader = ckpt_lib.Checkpoints(workdir / 'checkpoints', read_only=True)
  run = build(load_config('single', *(f'model.{k}={v}' for k, v in hf_model_options(tmp_path / 'hf').items()
                                      if k != 'name')))
  params = reader.restore(12, run.abstract_state, params_only=True).state['params']
  with jax.set_mesh(run.mesh):
    trained = mintrain_logits(run.model(params), ids[None])
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'out', dtype=torch.float32)
  with torch.no_grad():
    logits = exported(torch.from_numpy(ids[None].astype(np.int64))).logits.numpy()
  assert np.abs(logits - trained).max() <= 1e-4

  exported.generation_config.eos_token_id = None
  with torch.no_grad():
    greedy = exported.generate(torch.tensor([theirs('def ').input_ids]), max_new_tokens=8, do_sample=False)
  proc = run_script('scripts/sample.py', '--workdir', str(workdir), '--prompt', 'def ',
                    '--max_new_tokens', '8', '--temperature', '0')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout == theirs.decode(greedy[0], skip_special_tokens=True) + '\n'


@pytest.mark.parametrize('kind', list(hf_llama.Kind))
def test_reading_any_slices_of_a_written_tensor_gives_back_those_slices(kind, tmp_path, monkeypatch):
  monkeypatch.setattr(safetensors_reader, 'BLOCK_BYTES', 64)  # Blocks of a few rows.
  shapes = {hf_llama.Kind.SAME: (12, 10), hf_llama.Kind.T: (10, 12), hf_llama.Kind.IN_HEADS: (10, 6, 4),
            hf_llama.Kind.HEADS_OUT: (6, 4, 10), hf_llama.Kind.HEADS: (6, 4)}
  rng = np.random.default_rng(0)
  ours = rng.standard_normal(shapes[kind]).astype(np.float32)
  save_file({'w': hf_llama.write(kind, ours)}, tmp_path / 'w.safetensors')
  with safetensors_reader.File(tmp_path / 'w.safetensors') as file:
    for _ in range(10):  # Several overlapping or disjoint slices at once, as a process's devices ask.
      indices = [tuple(slice(*sorted(rng.choice(n + 1, 2, replace=False))) for n in ours.shape)
                 for _ in range(rng.integers(1, 4))]
      targets = [(index, np.full([s.stop - s.start for s in index], np.nan, np.float32)) for index in indices]
      hf_llama.read(kind, file.tensors['w'], targets, ours.shape)
      for index, out in targets:
        np.testing.assert_array_equal(out, ours[index])


@pytest.mark.parametrize('kind', list(hf_llama.Kind))
def test_slices_of_whole_rows_or_heads_read_straight_or_tile_by_tile_give_back_those_slices(kind, tmp_path,
                                                                                              monkeypatch):
  # The paths that skip the row buffer (whole rows) or transpose in bands (whole heads); bands of 3 rows
  # divide none of the sizes, and blocks of one row or of the whole tensor.
  monkeypatch.setattr(host_allocator, 'TILE_ROWS', 3)
  shapes = {hf_llama.Kind.SAME: (12, 10), hf_llama.Kind.T: (10, 14), hf_llama.Kind.IN_HEADS: (10, 6, 4),
            hf_llama.Kind.HEADS_OUT: (6, 4, 10), hf_llama.Kind.HEADS: (6, 4)}
  ours = np.random.default_rng(0).standard_normal(shapes[kind]).astype(np.float32)
  save_file({'w': hf_llama.write(kind, ours)}, tmp_path / 'w.safetensors')
  for block_bytes in (1, 4 << 20):
    monkeypatch.setattr(safetensors_reader, 'BLOCK_BYTES', block_bytes)
    with safetensors_reader.File(tmp_path / 'w.safetensors') as file:
      for axis, n in enumerate(ours.shape):  # Halves along each axis, the rest whole, as devices ask.
        indices = [tuple(slice(0, m) if a != axis else part for a, m in enumerate(ours.shape))
                   for part in (slice(0, n // 2), slice(n // 2, n))]
        targets = [(index, host_allocator.adoptable_empty(ours[index].shape, np.float32))
                   for index in indices]
        hf_llama.read(kind, file.tensors['w'], targets, ours.shape)
        for index, out in targets:
          np.testing.assert_array_equal(out, ours[index])


def test_row_blocks_of_two_tensors_read_at_once_or_in_turn_give_their_own_rows(tmp_path, monkeypatch):
  # A file's tensors pass one block buffer on; two reads under way at once must not share it.
  monkeypatch.setattr(safetensors_reader, 'BLOCK_BYTES', 64)
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((12, 4)).astype(np.float32), rng.standard_normal((5, 30)).astype(np.float32)
  save_file({'a': a, 'b': b}, tmp_path / 'w.safetensors')
  with safetensors_reader.File(tmp_path / 'w.safetensors') as file:
    for _ in range(2):  # The second time, from the buffer the first left.
      blocks = [file.tensors[name].row_blocks(slice(None)) for name in 'ab']
      for (at, rows_a), (bt, rows_b) in zip(*blocks):
        np.testing.assert_array_equal(rows_a, a[at:at + len(rows_a)])
        np.testing.assert_array_equal(rows_b, b[bt:bt + len(rows_b)])
      np.testing.assert_array_equal(file.tensors['a'][2:9, 1:3], a[2:9, 1:3])
      np.testing.assert_array_equal(file.tensors['b'][1:4], b[1:4])


LOAD_AND_MEASURE = """
import json, sys
import jax
from mintrain import hf, mesh
from mintrain.runtime import distributed
from mintrain.build import build

mesh.simulate_cpu_devices(4)
distributed.initialize(distributed.settings(), say=lambda _: None)
def status(key):
  return next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith(key))
run = build(hf.make_config(sys.argv[1], mesh_sizes={'data': 1, 'fsdp': 8, 'model': 1}), jax.devices())
with open('/proc/self/clear_refs', 'w') as f:
  f.write('5')  # The peak (VmHWM) starts again from here.
before = status('VmRSS:')
params = jax.block_until_ready(hf.load_params(sys.argv[1], run))
print('RESULT', json.dumps({'growth': status('VmHWM:') - before}))
hf.save_pretrained(run.model(params), sys.argv[2])  # Gathered from both processes; process 0 writes.
"""


@pytest.mark.slow  # Writes a 234 MB checkpoint, loads and saves it in two processes (about 20 s).
def test_two_processes_each_grow_by_under_0_6x_the_checkpoint_while_loading_it_on_fsdp8_and_save_it_back(
    tmp_path):
  from hf_load import MODEL, write_checkpoint  # The benchmark's checkpoint: 234 MB, float32.
  size = write_checkpoint(tmp_path, MODEL)
  assert size >= 200e6
  proc = subprocess.run([sys.executable, 'scripts/launch_local.py', '--num_processes', '2', '--',
                         sys.executable, '-c', LOAD_AND_MEASURE, str(tmp_path), str(tmp_path / 'saved')],
                        cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-3000:]
  results = [json.loads(line.split('RESULT ')[1]) for line in proc.stdout.splitlines() if 'RESULT ' in line]
  assert len(results) == 2, proc.stdout[-3000:]
  for result in results:
    # Each process holds half of every parameter (0.5x), and less than a tenth of the file more.
    assert 0.45 * size < result['growth'] < 0.6 * size, (result['growth'] / size, proc.stdout[-2000:])
  original, saved = load_file(tmp_path / hf.SINGLE), load_file(tmp_path / 'saved' / hf.SINGLE)
  assert saved.keys() == original.keys()
  for name, tensor in original.items():  # Every weight arrived where it belongs.
    np.testing.assert_array_equal(saved[name], tensor, err_msg=name)


ONE_DEVICE = {'data': 1, 'fsdp': 1, 'model': 1}
DP4_TP2 = {'data': 4, 'fsdp': 1, 'model': 2}


@pytest.mark.skipif(not hasattr(os, 'memfd_create'), reason='memory files are Linux-only')
def test_on_dp4_tp2_replicas_share_one_memory_file_and_a_write_to_one_leaves_the_others_and_the_file(
    llama3, monkeypatch):
  from test_host_memory import memfd_mapped
  directory, _ = llama3
  file_bytes = (directory / hf.SINGLE).read_bytes()
  expected = hf.load_params(directory, build(hf.make_config(directory, mesh_sizes=ONE_DEVICE)))
  monkeypatch.setattr(host_allocator, 'HUGE_ARRAY_BYTES', 1)  # Every slice of this tiny model.
  params = hf.load_params(directory, build(hf.make_config(directory, mesh_sizes=DP4_TP2)))
  loaded = dict(nnx.to_flat_state(params))
  for path, want in nnx.to_flat_state(expected):  # Bit for bit those of one device.
    np.testing.assert_array_equal(np.asarray(loaded[path][...]), np.asarray(want[...]), err_msg=str(path))
  shards = next(v for path, v in loaded.items() if 'embed' in str(path))[...].addressable_shards
  replicas = [s for s in shards if s.index == shards[0].index]
  assert len(replicas) == 4 and all(memfd_mapped(s.data.unsafe_buffer_pointer()) for s in replicas)
  before = np.asarray(replicas[1].data).copy()
  ctypes.memset(replicas[0].data.unsafe_buffer_pointer(), 0, before.nbytes)  # As an in-place update would.
  assert not np.asarray(replicas[0].data).any()
  for replica in replicas[1:]:
    np.testing.assert_array_equal(np.asarray(replica.data), before)
  assert (directory / hf.SINGLE).read_bytes() == file_bytes


def test_a_donating_step_over_memory_file_replicas_on_dp4_tp2_gives_the_values_of_one_device(llama3,
                                                                                             monkeypatch):
  directory, _ = llama3
  expected = hf.load_params(directory, build(hf.make_config(directory, mesh_sizes=ONE_DEVICE)))
  monkeypatch.setattr(host_allocator, 'HUGE_ARRAY_BYTES', 1)
  params = hf.load_params(directory, build(hf.make_config(directory, mesh_sizes=DP4_TP2)))
  step = jax.jit(lambda p: jax.tree.map(lambda x: x * 2 + 1, p), donate_argnums=0)
  stepped = dict(nnx.to_flat_state(step(params)))
  for path, want in nnx.to_flat_state(expected):
    np.testing.assert_array_equal(np.asarray(stepped[path][...]), np.asarray(want[...]) * 2 + 1,
                                  err_msg=str(path))
