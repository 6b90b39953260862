"""RoPE scaling as transformers defines each `rope_type`: a tiny random Llama of each, run on sequences
longer than its original context, gives transformers' logits and greedy generations, saves back, and reads
the same from transformers 5.x's `rope_parameters` as from older files' `rope_scaling` and `rope_theta`."""

import json

import jax
import numpy as np
import pytest
import torch  # The reference, from the test extra; mintrain itself never imports it.
import transformers
from helpers import load_config, mesh_devices, quiet
from hf_reference import mintrain_logits, torch_logits

from mintrain import hf
from mintrain import loop as train_loop
from mintrain.errors import ConfigError
from mintrain.mesh import make_mesh
from mintrain.models import hf_model_options
from mintrain.models.transformer import sampling

# Original context 16 against 24 positions (and 38 when generating): each scaling changes the logits.
LLAMA = {'vocab_size': 256, 'hidden_size': 64, 'intermediate_size': 96, 'num_hidden_layers': 2,
         'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings': 16,
         'tie_word_embeddings': False}
ROPES = {
    'linear': {'rope_type': 'linear', 'factor': 2.0},
    # transformers stretches its frequencies only past max_position_embeddings, by each call's length.
    'dynamic': {'rope_type': 'dynamic', 'factor': 2.0},
    'yarn': {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16},
    # DeepSeek-style attention factor from mscale and mscale_all_dim; its own betas, and a base that puts
    # the blend's edge (2.8) between dimensions, where leaving out the truncation matters.
    'yarn_mscale': {'rope_type': 'yarn', 'rope_theta': 100.0, 'factor': 4.0,
                    'original_max_position_embeddings': 16, 'mscale': 0.8, 'mscale_all_dim': 0.5,
                    'beta_fast': 4.0, 'beta_slow': 0.5, 'truncate': False},
}
TOKENS = np.random.RandomState(1).randint(0, 256, (8, 24)).astype(np.int32)


def on_mesh(name):
  config = load_config(name)
  return jax.set_mesh(make_mesh(config.mesh.sizes, mesh_devices(config)))


def random_llama(rope, directory):
  """A tiny random transformers Llama with RoPE parameters `rope`, saved in `directory`."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(**LLAMA, rope_parameters={'rope_theta': 10000.0, **rope})
  if rope['rope_type'] == 'yarn':  # Its context after scaling.
    config.max_position_embeddings = int(rope['factor'] * rope['original_max_position_embeddings'])
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope='module', params=list(ROPES))
def reference(request, tmp_path_factory):
  """(directory, transformers' float32 logits of TOKENS) of a tiny Llama with one rope type."""
  directory = tmp_path_factory.mktemp(request.param)
  return directory, torch_logits(random_llama(ROPES[request.param], directory), TOKENS)


def test_each_rope_type_changes_the_logits_of_the_default_rope(reference, tmp_path):
  directory, expected = reference
  config = json.loads((directory / 'config.json').read_text())
  config['rope_parameters'] = {'rope_type': 'default', 'rope_theta': config['rope_parameters']['rope_theta']}
  (tmp_path / 'config.json').write_text(json.dumps(config))
  default = transformers.AutoModelForCausalLM.from_pretrained(directory, config=transformers.AutoConfig
                                                              .from_pretrained(tmp_path), dtype=torch.float32)
  assert np.abs(torch_logits(default, TOKENS) - expected).max() > 1e-3


@pytest.mark.parametrize('mesh_name', ['single', pytest.param('dp4_tp2', marks=pytest.mark.slow)])
def test_a_scaled_rope_gives_the_logits_of_transformers_past_the_original_context(reference, mesh_name):
  directory, expected = reference
  with on_mesh(mesh_name):
    logits = mintrain_logits(hf.from_pretrained(directory), TOKENS)
  assert np.abs(logits - expected).max() <= 1e-4


@pytest.mark.slow  # A decode step compiled per length: the default suite's budget.
def test_greedy_generation_past_the_original_context_equals_transformers_generate(reference):
  directory, _ = reference
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  model.generation_config.eos_token_id = None
  prompt = TOKENS[:2, :6]
  with torch.no_grad():
    expected = model.generate(torch.from_numpy(prompt.astype(np.int64)), max_new_tokens=32,
                              do_sample=False).numpy()[:, 6:]
  with on_mesh('single'):
    generated = np.asarray(sampling.generate(hf.from_pretrained(directory), prompt, 32))
  np.testing.assert_array_equal(generated, expected)


def test_a_saved_scaled_rope_reads_back_the_same_and_gives_transformers_the_same_logits(reference, tmp_path):
  directory, expected = reference
  with on_mesh('dp4_tp2'):
    hf.save_pretrained(hf.from_pretrained(directory), tmp_path)
  assert hf_model_options(tmp_path) == hf_model_options(directory)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
  assert np.abs(torch_logits(loaded, TOKENS) - expected).max() <= 1e-4


@pytest.mark.parametrize('rope', ['linear', 'dynamic', 'yarn'])
def test_older_files_rope_scaling_and_rope_theta_read_as_rope_parameters(rope, tmp_path):
  new = {'model_type': 'llama', **LLAMA, 'rope_parameters': {'rope_theta': 500000.0, **ROPES[rope]}}
  old = {'model_type': 'llama', **LLAMA, 'rope_theta': 500000.0,
         'rope_scaling': {'type' if k == 'rope_type' else k: v for k, v in ROPES[rope].items()}}
  options = []
  for name, config in (('new', new), ('old', old)):
    (tmp_path / name).mkdir()
    (tmp_path / name / 'config.json').write_text(json.dumps(config))
    options.append(hf_model_options(tmp_path / name))
  assert options[0] == options[1]
  assert options[0]['rope_scaling'] == rope and options[0]['rope_base'] == 500000.0


TRAIN = ('model.vocab_size=384', 'model.embed_dim=32', 'model.mlp_dim=64', 'data.source=synthetic',
         'train.steps=3', 'train.log_every=3', 'train.seq_len=16', 'train.global_batch_size=8',
         'model.rope_original_max_len=8', 'model.rope_scaling_factor=2.0')


@pytest.mark.slow
@pytest.mark.parametrize('rope', ['dynamic', 'yarn'])
def test_a_scaled_rope_trains_with_the_same_losses_on_every_mesh(rope):
  """Past the original context; on cp2_dp2_tp2 the ring's zigzag order holds the last position mid-row."""
  losses = {}
  ring = 'model.context_attention=ring'
  for name, overrides in (('single', ()), ('dp4_tp2', ()), ('cp2_dp2_tp2', (ring,))):
    config = load_config(name, *TRAIN, f'model.rope_scaling={rope}', *overrides)
    losses[name] = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet).losses
  for name, value in losses.items():
    np.testing.assert_allclose(value, losses['single'], rtol=1e-4, err_msg=name)


def test_dynamic_rope_with_a_head_dim_of_2_is_a_one_line_error():
  with pytest.raises(ConfigError, match=r'^model.rope_scaling=dynamic needs model.head_dim > 2'):
    load_config('single', 'model.rope_scaling=dynamic', 'model.head_dim=2')
