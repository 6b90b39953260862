"""Sliding-window attention, applied: Mistral's window and Gemma 2's and Gemma 3's local and global layers
give transformers' logits on sequences longer than every window, save back bit for bit and generate
transformers' greedy tokens past the window (a local layer's KV cache a rolling buffer); the ring, the
gathered path and dot_product attention with a window equal the plain path; losses with windows are the
same on every mesh; config.json values the family cannot honour are one-line errors."""

import copy
import json
import re

import hf_reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # The reference, from the test extra; mintrain itself never imports it.
import transformers
from helpers import build, load_config, mesh_devices, quiet
from hf_reference import mintrain_logits, torch_logits
from safetensors.numpy import load_file, save_file

from mintrain import config as config_lib
from mintrain import configs, hf
from mintrain import loop as train_loop
from mintrain.errors import ConfigError
from mintrain.mesh import make_mesh
from mintrain.models import hf_model_options
from mintrain.models.transformer import hf as hf_llama
from mintrain.models.transformer import sampling

COMMON = {'vocab_size': 256, 'hidden_size': 64, 'intermediate_size': 96, 'num_hidden_layers': 2,
          'num_attention_heads': 8, 'num_key_value_heads': 2, 'head_dim': 16, 'max_position_embeddings': 128,
          'sliding_window': 5}
FAMILIES = {
    'mistral': ('MistralConfig', {}),
    # Local, global; soft-capped scores and logits (caps low enough to bite), its own query scalar.
    'gemma2': ('Gemma2Config', {'query_pre_attn_scalar': 24, 'attn_logit_softcapping': 2.0,
                                'final_logit_softcapping': 3.0}),
    # Local, local, global: QK-norm, local layers' own RoPE base, linear scaling on the global one.
    # Weights drawn wider than transformers' default, so greedy choices are not near-ties.
    'gemma3': ('Gemma3TextConfig', {'num_hidden_layers': 3, 'sliding_window_pattern': 3,
                                    'num_key_value_heads': 1, 'initializer_range': 0.1,
                                    'rope_parameters': {
                                        'full_attention': {'rope_type': 'linear', 'factor': 4.0,
                                                           'rope_theta': 1e6},
                                        'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}}),
}
TOKENS = np.random.RandomState(1).randint(0, 256, (8, 24)).astype(np.int32)  # Longer than the windows (5).


def random_model(family, directory, **changes):
  """A tiny random `transformers` model of `family` (FAMILIES), saved in `directory`."""
  return hf_reference.random_model(FAMILIES, COMMON, family, directory, **changes)


def base(*overrides):
  """mintrain/configs/base.py with `key=value` overrides, as `hf.from_pretrained(base=...)` takes it."""
  return config_lib.load(configs.DIR / 'base.py', overrides)


def on_mesh(name, *overrides):
  config = load_config(name, *overrides)
  return jax.set_mesh(make_mesh(config.mesh.sizes, mesh_devices(config)))


@pytest.fixture(scope='module', params=list(FAMILIES))
def reference(request, tmp_path_factory):
  """(family, directory, the transformers model, its float32 logits of TOKENS)."""
  directory = tmp_path_factory.mktemp(request.param)
  model = random_model(request.param, directory)
  return request.param, directory, model, torch_logits(model, TOKENS)


def test_the_windows_are_read_as_local_and_global_layers(reference):
  family, directory, _, _ = reference
  options = hf_model_options(directory)
  assert options['sliding_window'] == 5
  assert options['global_every'] == {'mistral': 0, 'gemma2': 2, 'gemma3': 3}[family]
  if family == 'gemma3':
    assert options['rope_local_base'] == 1e4 and options['rope_base'] == 1e6
    assert options['rope_scaling'] == 'linear' and options['qk_norm'] and options['post_norms']


@pytest.mark.parametrize('mesh_name,block', [('single', 0), ('dp4_tp2', 4),
                                             pytest.param('tp8', 0, marks=pytest.mark.slow),
                                             pytest.param('fsdp8', 7, marks=pytest.mark.slow)])
def test_a_windowed_checkpoint_gives_the_logits_of_transformers_past_its_window(reference, mesh_name, block):
  """Also with the queries in blocks (`model.attention_block`) shorter and longer than the window."""
  _, directory, _, expected = reference
  with on_mesh(mesh_name):
    model = hf.from_pretrained(directory, base=base(f'model.attention_block={block}'))
    logits = mintrain_logits(model, TOKENS)
  assert np.abs(logits - expected).max() <= 1e-4


@pytest.mark.slow
def test_scanned_layers_all_local_give_the_logits_of_transformers(tmp_path):
  reference = random_model('mistral', tmp_path)
  with on_mesh('fsdp8'):
    model = hf.from_pretrained(tmp_path, base=base('model.scan_layers=True'))
    logits = mintrain_logits(model, TOKENS)
  assert np.abs(logits - torch_logits(reference, TOKENS)).max() <= 1e-4


def test_the_window_matters():
  """Without the window (or with the global layers local), transformers' own logits differ: the parity
  above could not hold by chance."""
  name, options = FAMILIES['gemma3']
  config = getattr(transformers, name)(**{**COMMON, **options})
  torch.manual_seed(0)
  windowed = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  config = copy.deepcopy(config)  # The models read it at each call.
  config.sliding_window = 64
  wide = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  wide.load_state_dict(windowed.state_dict())
  assert np.abs(torch_logits(windowed, TOKENS)[:, 5:] - torch_logits(wide, TOKENS)[:, 5:]).max() > 1e-3


def test_import_export_import_is_bitwise(reference, tmp_path):
  _, directory, _, _ = reference
  with on_mesh('dp4_tp2'):
    hf.save_pretrained(hf.from_pretrained(directory), tmp_path)
  saved, original = load_file(tmp_path / hf.SINGLE), load_file(directory / hf.SINGLE)
  assert saved.keys() == original.keys()
  for name, tensor in original.items():
    np.testing.assert_array_equal(saved[name], tensor, err_msg=name)
  assert hf_model_options(tmp_path) == hf_model_options(directory)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
  np.testing.assert_allclose(torch_logits(reloaded, TOKENS), reference[3], atol=1e-6)


@pytest.mark.parametrize('family,mesh_name,prompt_len', [
    ('gemma3', 'single', 8),
    pytest.param('mistral', 'single', 8, marks=pytest.mark.slow),
    pytest.param('gemma2', 'single', 8, marks=pytest.mark.slow),
    pytest.param('gemma3', 'dp4_tp2', 3, marks=pytest.mark.slow),
    pytest.param('gemma2', 'dp4_tp2', 3, marks=pytest.mark.slow),
    pytest.param('gemma3', 'cp2_dp2_tp2', 8, marks=pytest.mark.slow),  # The prefill split over `context`.
])
def test_greedy_generation_past_the_window_is_that_of_transformers(tmp_path, family, mesh_name, prompt_len):
  """32 new tokens after a prompt longer (8) or shorter (3) than the window (5): the rolling buffers wrap
  several times, in the prefill and while decoding. The prefill's queries run in blocks of 3, each over
  the keys its window reaches."""
  model, directory = random_model(family, tmp_path), tmp_path
  prompt = TOKENS[:4, :prompt_len]
  with torch.no_grad():
    expected = model.generate(torch.from_numpy(prompt.astype(np.int64)), max_new_tokens=32, do_sample=False,
                              min_new_tokens=32, pad_token_id=0)[:, prompt_len:].numpy()
  with on_mesh(mesh_name):
    ours = hf.from_pretrained(directory, base=base('model.attention_block=3'))
    cached = np.asarray(sampling.generate(ours, prompt, 32))
  np.testing.assert_array_equal(cached, expected)


def test_a_local_layers_cache_holds_its_window_only(tmp_path):
  random_model('gemma3', tmp_path)
  with on_mesh('dp4_tp2'):
    cache = hf.from_pretrained(tmp_path).init_cache(4, 40, np.float32)
  assert [keys.shape[1] for keys, _ in cache] == [5, 5, 40]


# A small windowed model: window 6 against 32 positions, a global layer between two local ones, soft-caps.
WINDOWED = ('model.vocab_size=128', 'data.source=synthetic', 'train.seq_len=32', 'train.global_batch_size=8',
            'model.num_layers=3', 'model.sliding_window=6', 'model.global_every=2', 'model.attn_softcap=3.0',
            'model.final_softcap=20.0', 'model.num_kv_heads=2')
STEPS = ('train.steps=3', 'train.log_every=3')


def losses(name, *overrides):
  config = load_config(name, *WINDOWED, *STEPS, *overrides)
  return np.array(train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet).losses)


@pytest.mark.parametrize('name,overrides', [
    ('dp4_tp2', ()),
    ('cp2_dp2_tp2', ('model.context_attention=all_gather',)),
    ('cp2_dp2_tp2', ('model.context_attention=ring',)),
    ('fsdp8', ()),
    ('single', ('mesh.context=8', 'model.context_attention=ring')),
])
@pytest.mark.slow  # Training runs; test_context_parallel.py has the ring with a window in the default set.
def test_losses_with_windows_are_those_of_one_device(name, overrides):
  np.testing.assert_allclose(losses(name, *overrides), losses('single'), rtol=1e-5)


@pytest.mark.slow  # The default set compares dot_product's logits with transformers' (below).
def test_dot_product_attention_applies_the_window_in_training():
  """jax.nn.dot_product_attention's local_window_size (cuDNN's on GPU) against the einsum's mask."""
  no_softcap = ('model.attn_softcap=0.0',)
  np.testing.assert_allclose(losses('single', *no_softcap, 'model.attention=dot_product'),
                             losses('single', *no_softcap), rtol=1e-5)


@pytest.mark.slow
def test_a_window_changes_the_losses():
  assert np.abs(losses('single', 'model.sliding_window=0') - losses('single')).max() > 1e-4


def test_dot_product_attention_with_a_window_gives_the_logits_of_transformers(tmp_path):
  reference = random_model('gemma3', tmp_path)  # Gemma 3 has no soft-cap, which dot_product lacks.
  with on_mesh('single'):
    model = hf.from_pretrained(tmp_path, base=base('model.attention=dot_product'))
    logits = mintrain_logits(model, TOKENS)
  assert np.abs(logits - torch_logits(reference, TOKENS)).max() <= 1e-4


def test_the_gemma3_config_makes_five_local_layers_to_one_global():
  config = load_config('gemma3_dp4_tp2')
  assert [config.model.window(i) for i in range(6)] == [16] * 5 + [0]
  assert hf_llama.config_json(config.model, 'float32')['layer_types'] == ['sliding_attention'] * 5 + [
      'full_attention']


@pytest.mark.slow
def test_the_gemma3_config_trains():
  config = load_config('gemma3_dp4_tp2', 'model.vocab_size=384', 'data.source=synthetic', 'train.steps=4',
                       'train.log_every=2', 'train.seq_len=32')
  result = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet)
  assert np.all(np.isfinite(result.losses)) and result.losses[-1] < result.losses[0]


def config_json(directory, **changes):
  """The config.json of a saved tiny model, with `changes`, written back."""
  path = directory / 'config.json'
  data = json.loads(path.read_text()) | changes
  path.write_text(json.dumps(data))
  return data


@pytest.mark.parametrize('changes,message', [
    ({'layer_types': ['sliding_attention', 'chunked_attention', 'full_attention']},
     r"^config.json layer_types has 'chunked_attention'; mintrain reads sliding_attention, "
     r'full_attention\.$'),
    ({'layer_types': ['full_attention', 'sliding_attention', 'sliding_attention']},
     r'^config.json layer_types \[.*\] is not supported; mintrain makes every layer local, or all but every '
     r'N-th \(model.global_every\)\.$'),
    ({'rope_parameters': {'full_attention': {'rope_type': 'default', 'rope_theta': 1e6},
                          'sliding_attention': {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 1e4}}},
     r"^config.json rope_parameters.sliding_attention rope_type 'linear' is not supported"),
    ({'rope_parameters': {'full_attention': {'rope_type': 'longrope', 'rope_theta': 1e6},
                          'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}},
     r"^config.json rope_type 'longrope' is not supported"),
    ({'use_bidirectional_attention': True}, r'^config.json: gemma3_text with use_bidirectional_attention'),
])
def test_what_the_family_cannot_honour_is_a_one_line_error_before_anything_is_written(tmp_path, changes,
                                                                                      message):
  random_model('gemma3', tmp_path / 'in')
  config_json(tmp_path / 'in', **changes)
  with pytest.raises(ConfigError, match=message):
    hf_model_options(tmp_path / 'in')


def test_older_gemma3_files_read_rope_theta_rope_local_base_freq_and_rope_scaling(tmp_path):
  random_model('gemma3', tmp_path)
  data = json.loads((tmp_path / 'config.json').read_text())
  new = hf_model_options(tmp_path)
  del data['rope_parameters']
  data |= {'rope_theta': 1e6, 'rope_local_base_freq': 1e4,
           'rope_scaling': {'rope_type': 'linear', 'factor': 4.0}}
  (tmp_path / 'config.json').write_text(json.dumps(data))
  assert hf_model_options(tmp_path) == new


def test_scanned_layers_with_local_and_global_blocks_are_refused():
  with pytest.raises(ConfigError, match=r'^model.scan_layers needs identical blocks; with '
                                        r'model.global_every=6'):
    load_config('gemma3_dp4_tp2', 'model.scan_layers=True')


@pytest.mark.parametrize('overrides,message', [
    (('model.attention=dot_product', 'model.attn_softcap=50.0'),
     r"^model.attn_softcap=50.0 is not in jax.nn.dot_product_attention; use model.attention='einsum'\.$"),
    (('model.final_softcap=30.0', 'model.loss_chunks=2'),
     r'^model.final_softcap=30.0 is not in the fused loss; set model.loss_chunks=0 \(or -1\)\.$'),
])
def test_soft_caps_the_fast_paths_lack_are_one_line_errors(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config('single', *overrides)


def test_auto_loss_chunks_leave_the_fused_loss_off_with_a_final_soft_cap():
  assert load_config('single').model.for_platform('cpu').loss_chunks == 1
  assert load_config('single', 'model.final_softcap=30.0').model.for_platform('cpu').loss_chunks == 0


@pytest.fixture(scope='module')
def multimodal_gemma3(tmp_path_factory):
  """(directory, its float32 logits of TOKENS) of a tiny random Gemma3ForConditionalGeneration whose text
  model is FAMILIES['gemma3'] (its tensors under `language_model.model.`, beside a vision tower's)."""
  name, options = FAMILIES['gemma3']
  text = getattr(transformers, name)(**{**COMMON, **options})
  vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14)
  config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                     mm_tokens_per_image=4)
  torch.manual_seed(0)
  model = transformers.Gemma3ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for param_name, param in model.named_parameters():
      if param_name.endswith('norm.weight'):
        param.add_(0.1 * torch.randn_like(param))
  directory = tmp_path_factory.mktemp('gemma3_multimodal')
  model.save_pretrained(directory)
  return directory, torch_logits(model, TOKENS)


@pytest.mark.slow  # Building the transformers model takes about 10 s.
@pytest.mark.parametrize('prefix', ['language_model.model.', 'model.language_model.'])
def test_a_multimodal_gemma3_checkpoint_gives_its_text_models_logits_without_the_vision_tower(
    multimodal_gemma3, prefix, tmp_path, caplog):
  directory, expected = multimodal_gemma3
  tensors = load_file(directory / hf.SINGLE)
  assert any(name.startswith('vision_tower.') for name in tensors)
  if prefix != 'language_model.model.':  # transformers 5's in-memory names (model.vision_tower. too).
    tensors = {re.sub(r'^language_model\.model\.', prefix, re.sub(r'^(vision_tower|multi_modal_projector)\.',
                                                                   r'model.\1.', name)): t
               for name, t in tensors.items()}
    directory = tmp_path
    save_file(tensors, directory / hf.SINGLE)
    (directory / 'config.json').write_text((multimodal_gemma3[0] / 'config.json').read_text())
  assert hf_model_options(directory) == hf_model_options_of_text(multimodal_gemma3[0])
  with caplog.at_level('INFO', logger='mintrain'), on_mesh('single'):
    logits = mintrain_logits(hf.from_pretrained(directory), TOKENS)
  assert np.abs(logits - expected).max() <= 1e-4
  vision = sum(not name.startswith(prefix) for name in tensors)
  assert caplog.text.count(f'{vision} tensors of the vision tower and projector are left out') == 1


def hf_model_options_of_text(directory):
  """The options of the text model alone: its text_config as a gemma3_text config.json."""
  config = json.loads((directory / 'config.json').read_text())
  return hf_llama.model_options({**config['text_config'], 'model_type': 'gemma3_text'})


def test_a_sparse_gemma3_text_config_takes_transformers_defaults_and_the_text_tensors_lose_their_prefix():
  options = hf_llama.model_options({'model_type': 'gemma3', 'text_config': {'hidden_size': 2560,
                                                                            'num_hidden_layers': 34}})
  assert (options['embed_dim'], options['num_layers'], options['num_heads'], options['num_kv_heads']) == (
      2560, 34, 8, 4)
  assert options['vocab_size'] == 262208 and options['head_dim'] == 256 and options['tie_embeddings']
  assert options['global_every'] == 6 and options['qk_norm'] and options['rope_local_base'] == 1e4
  tensors = {'language_model.model.norm.weight': 1, 'language_model.lm_head.weight': 2,
             'vision_tower.encoder.weight': 3, 'multi_modal_projector.weight': 4}
  assert hf_llama.text_tensors(tensors) == ({'model.norm.weight': 1, 'lm_head.weight': 2},
                                            '2 tensors of the vision tower and projector are left out: '
                                            'mintrain reads the text model of this multimodal checkpoint.')
  assert hf_llama.text_tensors({'model.norm.weight': 1}) == ({'model.norm.weight': 1}, None)


def test_the_sampling_plan_counts_the_kv_cache_with_local_layers_at_their_window():
  from mintrain import report
  config = load_config('dp4_tp2', 'model.num_layers=3', 'model.sliding_window=5', 'model.global_every=3',
                       'model.num_kv_heads=2', 'model.vocab_size=384')
  run = build(config)
  with jax.set_mesh(run.mesh):
    model = run.model(run.abstract_state.params)
    counted = report.kv_cache_bytes(model, 8, 40, jnp.float32)
    cache = model.init_cache(8, 40, jnp.float32)
  held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(cache))
  # Keys and values of 2 rows (batch over data), 1 head (over model) of 16: two 5-slot windows, one 40.
  assert counted == held == 2 * 2 * 16 * 4 * (5 + 5 + 40)
  params = sum(p.bytes_per_device for p in run.layout)
  line = report.format_sampling_plan(params, counted, 8, 40, run.mesh.devices.flat[0])
  assert line.startswith('sampling memory per device: parameters ')
  assert 'KV cache 12.5 KiB (batch 8, 40 positions)' in line
