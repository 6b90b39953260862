"""LoRA and QLoRA: adapters on a frozen (optionally quantized) base train alone, the same on every mesh, and
resume bit-exactly; the quantizers match the QLoRA paper's NF4 table and stay within their error bounds."""

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MESH_CONFIGS, TINY, build, load_config, mesh_devices, quiet

from mintrain import loop as train_loop
from mintrain.errors import ConfigError
from mintrain.lora import quantize

# bitsandbytes' NF4 table (functional.py, `get_4bit_type('nf4')`), as the QLoRA paper's appendix prints it.
BITSANDBYTES_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
LORA = ('lora.rank=4', 'lora.alpha=8.0', 'train.steps=6', 'checkpoint.keep=0', 'optimizer.warmup_steps=0')


def lora_config(mesh, *overrides):
  return load_config(mesh, *TINY, *LORA, *overrides)


def run(config, workdir=None):
  return train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=quiet)


def test_an_unknown_target_is_a_one_line_config_error():
  with pytest.raises(ConfigError, match=r"lora.targets='q,qkv': 'qkv' is not a target of model family "
                                        r"'transformer'; choose from q,k,v,o,gate,up,down"):
    lora_config('single', 'lora.targets=q,qkv')


def test_lora_dropout_on_experts_is_refused():
  with pytest.raises(ConfigError, match=r"lora.dropout=0.1 with the adapters of a mixture's experts is not"):
    build(lora_config('single', 'lora.dropout=0.1', 'model.num_experts=4'))


def test_only_the_adapters_are_parameters_and_only_they_have_optimizer_state():
  r = build(lora_config('single', 'lora.targets=q,down'))
  trainable = {p.path for p in r.layout if p.trainable}
  assert trainable == {'blocks.0.attn.wq_DHK.a', 'blocks.0.attn.wq_DHK.b', 'blocks.0.mlp.wo_FD.a',
                       'blocks.0.mlp.wo_FD.b'}
  shapes = {p.path: p.shape for p in r.layout}
  assert shapes['blocks.0.attn.wq_DHK.a'] == (32, 4) and shapes['blocks.0.attn.wq_DHK.b'] == (4, 4, 8)
  assert shapes['blocks.0.mlp.wo_FD.a'] == (64, 4) and shapes['blocks.0.mlp.wo_FD.b'] == (4, 32)
  adam_leaves = jax.tree.leaves(r.abstract_state.opt_state)
  moments = sum(x.size for x in adam_leaves if x.ndim)  # Adam's mu and nu; its counts are scalars.
  assert moments == 2 * sum(np.prod(shapes[p]) for p in trainable)


@pytest.mark.slow
def test_adapters_start_as_the_base_and_only_they_train():
  plain = run(load_config('single', *TINY, *LORA[2:]))
  lora = run(lora_config('single'))
  assert lora.losses[0] == pytest.approx(plain.losses[0], rel=1e-6)  # B starts at zero.
  assert lora.losses[1:] != plain.losses[1:]
  assert all(np.any(np.asarray(b) != 0) for b in jax.tree.leaves(lora.state.params))
  r = build(lora_config('single'))
  with jax.set_mesh(r.mesh):
    base = r.frozen_from_seed()
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(lora.state.frozen), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # 33 s: the default suite's time; LoRA's restores onto other meshes stay in it.
@pytest.mark.parametrize('base_dtype', ['nf4', 'float32'])
def test_lora_losses_are_the_same_on_dp4_tp2_as_on_one_device(base_dtype):
  options = (f'lora.base_dtype={base_dtype}', 'lora.nf4_block_size=8')
  single = run(lora_config('single', *options))
  np.testing.assert_allclose(run(lora_config('dp4_tp2', *options)).losses, single.losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('mesh', [m for m in MESH_CONFIGS if m not in ('single', 'dp4_tp2')])
def test_lora_losses_are_the_same_on_every_mesh(mesh):
  # 8 heads of 4 split 8 ways on tp8; 2 key/value heads (replicated where too few).
  options = ('lora.base_dtype=nf4', 'lora.nf4_block_size=4', 'model.num_heads=8', 'model.head_dim=4',
             'model.num_kv_heads=2')
  single = run(lora_config('single', *options))
  np.testing.assert_allclose(run(lora_config(mesh, *options)).losses, single.losses, rtol=1e-5, err_msg=mesh)


@pytest.mark.slow
def test_a_lora_run_resumes_bit_exactly_and_saves_only_the_adapters(tmp_path):
  config = lora_config('dp4_tp2', 'checkpoint.keep=2', 'checkpoint.every_steps=3', 'lora.base_dtype=int8')
  straight = run(config, tmp_path)
  trainable = next(r for r in straight.records if 'trainable_fraction' in r)
  assert 0 < trainable['trainable_fraction'] < 0.2 and trainable['trainable_parameters'] > 0
  from mintrain.checkpoint import checkpoints as ckpt_lib
  saved = ckpt_lib.Checkpoints(tmp_path / 'checkpoints', read_only=True)
  arrays = saved.array_metadata(3)
  saved.close()
  params = [p for p in arrays if p.startswith('params.')]
  assert len(params) == 14 and all(re.search(r'\.(a|b)(\.value)?$', p) for p in params), params
  assert not any(word in p for p in arrays for word in ('frozen', 'base', 'absmax', 'embedding', 'norm'))
  shutil.rmtree(tmp_path / 'checkpoints' / '6')
  resumed = run(config, tmp_path)
  assert resumed.first_step == 3
  np.testing.assert_array_equal(resumed.losses, straight.losses[3:])
  for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_nf4_table_is_bitsandbytes():
  assert quantize.NF4 == tuple(BITSANDBYTES_NF4)


def test_nf4_maps_each_value_to_the_nearest_table_entry_of_its_block():
  w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
  codes, absmax = quantize.quantize_nf4(jnp.asarray(w), 16)
  blocks = w.reshape(4, 4, 16)
  np.testing.assert_array_equal(np.asarray(absmax), np.abs(blocks).max(-1))
  normed = blocks / np.abs(blocks).max(-1, keepdims=True)
  expected = np.abs(normed[..., None] - np.array(BITSANDBYTES_NF4)).argmin(-1)
  np.testing.assert_array_equal(np.asarray(quantize.unpack_nf4(codes)).reshape(4, 4, 16), expected)
  back = np.asarray(quantize.dequantize_nf4(codes, absmax, 16, jnp.float32)).reshape(4, 4, 16)
  # Each block's absmax is exact; no value is further from its own than half the widest gap (0.304 / 2).
  np.testing.assert_array_equal(np.abs(back).max(-1), np.abs(blocks).max(-1))
  assert np.all(np.abs(back - blocks) <= 0.5 * np.diff(BITSANDBYTES_NF4).max() * np.abs(blocks).max(-1,
                                                                                                     keepdims=True))


def test_nf4_codes_packed_two_a_byte_dequantize_as_one_a_byte_did():
  w = np.random.default_rng(1).standard_normal((3, 8, 32)).astype(np.float32)
  packed, absmax = quantize.quantize_nf4(jnp.asarray(w), 8)
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 8, 16)
  codes = np.asarray(quantize.unpack_nf4(packed))
  np.testing.assert_array_equal(np.asarray(packed), codes[..., 0::2] | (codes[..., 1::2] << 4))
  one_a_byte = np.array(BITSANDBYTES_NF4, np.float32)[codes] * np.repeat(np.asarray(absmax), 8, axis=-1)
  back = quantize.dequantize_nf4(packed, absmax, 8, jnp.float32)
  np.testing.assert_array_equal(np.asarray(back), one_a_byte)


def test_int8_keeps_each_output_channel_within_half_a_step():
  w = np.random.default_rng(1).standard_normal((32, 4, 8)).astype(np.float32)
  codes, scale = quantize.quantize_int8(jnp.asarray(w), (0,))
  assert codes.dtype == jnp.int8 and scale.shape == (4, 8)
  np.testing.assert_allclose(np.asarray(scale), np.abs(w).max(0) / 127, rtol=1e-7)
  assert np.abs(np.asarray(codes)).max() == 127
  back = np.asarray(quantize.dequantize_int8(codes, scale, (0,), jnp.float32))
  assert np.all(np.abs(back - w) <= np.asarray(scale)[None] / 2 * (1 + 1e-6))


def tiny_llama(directory):
  """A tiny random Llama saved by transformers, and the model."""
  import torch
  import transformers
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                    tie_word_embeddings=False)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  model.save_pretrained(directory)
  return model


TOKENS = np.random.RandomState(1).randint(0, 256, (2, 12)).astype(np.int32)
PROJECTIONS = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']


def torch_logits(model):
  import torch
  with torch.no_grad():
    return model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.mark.slow
def test_peft_adapters_import_and_export_with_peft_s_logits_and_merge_for_transformers(tmp_path):
  import peft
  import torch
  import transformers

  from mintrain import hf
  from mintrain.lora import peft as lora_peft
  tiny_llama(tmp_path / 'base')
  model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'base'),
                              peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS))
  with torch.no_grad():  # B starts at zero; random B makes the adapters matter.
    for name, p in model.named_parameters():
      if 'lora_B' in name:
        p.normal_(0, 0.1)
  model.save_pretrained(tmp_path / 'adapter')
  expected = torch_logits(model)
  config = load_config('single', f'init.hf_checkpoint={tmp_path / "base"}', 'data.tokenizer=byte',
                       'lora.rank=4', 'lora.alpha=8.0', f'init.lora_adapter={tmp_path / "adapter"}',
                       'train.global_batch_size=8', 'train.seq_len=12')
  r = build(config)
  with jax.set_mesh(r.mesh):
    state, _ = train_loop.initial_state(r, None, restore_from=None, params_only=False, print_fn=quiet)
    ours = r.model(state.params, state.frozen)
    np.testing.assert_allclose(np.asarray(ours(TOKENS)), expected, atol=1e-4)
    (tmp_path / 'ours').mkdir()
    lora_peft.save_adapter(state.params, r.config, r.layout, tmp_path / 'ours')
    hf.save_pretrained(lora_peft.merged(ours, r.rules), tmp_path / 'merged')
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'base')
  reloaded = peft.PeftModel.from_pretrained(base, tmp_path / 'ours')
  np.testing.assert_allclose(torch_logits(reloaded), expected, atol=1e-5)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'merged')
  np.testing.assert_allclose(torch_logits(merged), expected, atol=1e-4)


def test_the_report_and_memory_plan_count_the_frozen_base_quantized_and_without_gradients():
  from mintrain import report
  r = build(lora_config('dp4_tp2', 'lora.base_dtype=nf4', 'lora.nf4_block_size=8'))
  text = report.format_report(r.layout, r.abstract_state, r.mesh, r.plan, r.rules)
  trainable, total = report.trainable_counts(r.layout)
  assert f'trainable: {trainable:,} of {total:,} parameters' in text and 'uint8' in text
  assert r.plan.grads == sum(p.bytes_per_device for p in r.layout if p.trainable)
  codes = {p.path: p for p in r.layout}['blocks.0.mlp.wi_gate_DF.base']
  # (embed 32, mlp 64 over model) packed two codes a byte: half a byte per weight in the plan.
  assert codes.dtype == np.uint8 and codes.shard_shape == (32, 16) and not codes.trainable
  assert codes.bytes_per_device == 32 * 64 // 2 // 2 and total - trainable == report.param_count(r.config)


@pytest.mark.slow
def test_lora_dropout_trains_the_same_on_dp4_tp2_and_drops_only_in_training():
  options = ('lora.dropout=0.5', 'lora.targets=q,v,o,down', 'model.num_kv_heads=2', 'eval.steps=1')
  single = run(lora_config('single', *options))
  np.testing.assert_allclose(run(lora_config('dp4_tp2', *options)).losses, single.losses, rtol=1e-5)
  undropped = run(lora_config('single', *options[1:]))
  assert single.losses[0] == pytest.approx(undropped.losses[0], rel=1e-6)  # B = 0: no adapter term yet.
  assert not np.allclose(single.losses[1:], undropped.losses[1:], rtol=1e-6)
  r = build(lora_config('single', *options))
  with jax.set_mesh(r.mesh):  # Without a dropout key (evaluation), the split form equals the merged one.
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (2, 16)), jnp.int32)
    split = r.model(single.state.params, single.state.frozen)(tokens)
    merged_run = build(lora_config('single', *options[1:]))
    merged = merged_run.model(single.state.params, single.state.frozen)(tokens)
    np.testing.assert_allclose(np.asarray(split), np.asarray(merged), atol=1e-5)


@pytest.mark.slow
def test_stacked_layers_draw_the_same_adapters_and_train_the_same():
  unrolled = run(lora_config('single', 'model.num_layers=2'))
  scanned = run(lora_config('single', 'model.num_layers=2', 'model.scan_layers=True'))
  np.testing.assert_allclose(scanned.losses, unrolled.losses, rtol=1e-5)


@pytest.mark.slow
def test_experts_adapters_train_the_same_split_over_experts():
  options = ('lora.targets=q,gate,up,down', 'lora.base_dtype=int8')
  single = run(lora_config('moe_ep4_dp2', 'mesh.data=1', 'mesh.expert=1', *options))
  split = run(lora_config('moe_ep4_dp2', *options))
  np.testing.assert_allclose(split.losses, single.losses, rtol=1e-5)
  assert {p.shape for p in build(lora_config('moe_ep4_dp2', *options)).layout
          if p.path.endswith('wi_gate_EDF.a')} == {(8, 32, 4)}


@pytest.mark.slow
def test_export_script_writes_a_peft_adapter_and_a_merged_model_and_a_changed_base_stops_the_resume(tmp_path):
  import peft
  import transformers
  from helpers import run_script, script_flags

  from mintrain import errors
  tiny_llama(tmp_path / 'base')
  options = (f'init.hf_checkpoint={tmp_path / "base"}', 'data.tokenizer=byte', 'lora.rank=4',
             'lora.alpha=8.0', 'lora.targets=q,v,down', 'train.global_batch_size=8', 'train.seq_len=12',
             'train.steps=3', 'checkpoint.keep=1', 'optimizer.warmup_steps=0', 'optimizer.learning_rate=0.03')
  config = load_config('single', *options)
  trained = run(config, tmp_path / 'run')
  r = build(config)
  with jax.set_mesh(r.mesh):
    expected = np.asarray(r.model(trained.state.params, trained.state.frozen)(TOKENS))
  for out, flag in (('adapter', ['--adapter']), ('merged', [])):
    result = run_script('scripts/export_hf.py', '--workdir', str(tmp_path / 'run'), '--out',
                        str(tmp_path / out), *flag)
    assert result.returncode == 0, result.stderr
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'base')
  adapter = peft.PeftModel.from_pretrained(base, tmp_path / 'adapter')
  np.testing.assert_allclose(torch_logits(adapter), expected, atol=1e-4)
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'merged')
  np.testing.assert_allclose(torch_logits(merged), expected, atol=1e-4)
  assert sorted(adapter.peft_config['default'].target_modules) == ['down_proj', 'q_proj', 'v_proj']
  import torch
  torch.manual_seed(1)  # Other weights in the same place: the resume must not take them.
  hf_config = transformers.AutoConfig.from_pretrained(tmp_path / 'base')
  transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / 'base')
  with pytest.raises(errors.CheckpointError, match=r'LoRA base .* changed: init.hf_checkpoint=.* is not the'):
    run(load_config('single', *options, 'train.steps=4'), tmp_path / 'run')
  result = run_script('scripts/train.py', '--config', 'mintrain/configs/single.py', '--workdir',
                      str(tmp_path / 'run'), *script_flags(*options, 'train.steps=4'))
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_an_adapter_of_another_rank_is_a_one_line_config_error(tmp_path):
  import json

  from safetensors.numpy import save_file

  from mintrain.lora import peft as lora_peft
  (tmp_path / 'adapter_config.json').write_text(json.dumps({'peft_type': 'LORA', 'r': 8, 'lora_alpha': 16}))
  save_file({}, str(tmp_path / 'adapter_model.safetensors'))
  config = lora_config('single')
  r = build(config)
  with pytest.raises(ConfigError, match=r'is a LORA adapter of r=8, lora_alpha=16; the run has lora.rank=4, '
                                        r'lora.alpha=8.0: set those to match'):
    lora_peft.load_adapter(tmp_path, config, r.layout, r.abstract_state.params)
  with pytest.raises(ConfigError, match=r'is not a PEFT adapter directory: no adapter_config.json'):
    lora_peft.load_adapter(tmp_path / 'missing', config, r.layout, r.abstract_state.params)


@pytest.mark.slow  # ~12 s: the default suite time.
def test_lora_dropout_drops_the_adapters_input_only_given_a_key():
  from mintrain.train_state import key
  options = ('lora.targets=q,o,down', 'model.num_kv_heads=2')
  r = build(lora_config('single', 'lora.dropout=0.5', *options))
  tokens = np.random.RandomState(0).randint(0, 256, (2, 16)).astype(np.int32)
  batch = {'inputs': jnp.asarray(tokens), 'targets': jnp.asarray(np.roll(tokens, -1, axis=1))}
  with jax.set_mesh(r.mesh):
    state = r.init()
    params = jax.tree.map(lambda x: x + 0.1, state.params)  # B != 0: the adapters matter.
    model = r.model(params, state.frozen)
    plain = float(model.loss(batch)[0])
    dropped = [float(model.loss(batch, dropout_key=key(k))[0]) for k in (0, 0, 1)]
    merged = float(build(lora_config('single', *options)).model(params, state.frozen).loss(batch)[0])
  assert plain == pytest.approx(merged, rel=1e-6)
  assert dropped[0] == dropped[1] != dropped[2] and plain not in dropped


def test_a_bfloat16_base_is_stored_in_bfloat16_and_the_adapters_in_the_parameter_dtype():
  layout = {p.path: p for p in build(lora_config('single', 'lora.base_dtype=bfloat16')).layout}
  base = layout['blocks.0.attn.wq_DHK.base']
  assert base.dtype == jnp.bfloat16 and not base.trainable
  assert layout['blocks.0.attn.wq_DHK.a'].dtype == np.float32 and layout['embedding_VD'].dtype == np.float32
