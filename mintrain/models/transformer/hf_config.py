"""Hugging Face config.json <-> the transformer family's `model` options, for these model types:
  llama    Llama 2 and 3.x (Llama 3.1's RoPE scaling: `rope_type` 'llama3')
  mistral  as Llama, with a sliding window on every layer (`model.sliding_window`)
  qwen2    biases on the query, key and value projections
  qwen3    (dense) RMSNorm of each query and key head before RoPE (`qk_norm`), head_dim of its own
  gemma    (first generation) norms scaling by (1 + w), embeddings times sqrt(hidden), GeGLU, tied output
  gemma2   Gemma with local (sliding window) and global layers alternating (`layer_types`), soft-capped
           attention scores and logits, `query_pre_attn_scalar`, and norms after attention and MLP too
  gemma3_text  Gemma 2 with QK-norm, no soft-caps by default, and its own RoPE for each layer type (local
           layers' base `rope_local_base_freq`, global ones' scaled): `rope_parameters` by layer type
  gemma3   the multimodal Gemma 3 (Gemma3ForConditionalGeneration): its text model alone, from `text_config`
           and the tensors under `language_model.model.` (or transformers 5's `model.language_model.`);
           the vision tower's and projector's tensors are left out (`text_tensors`)
  mixtral    Mistral with a mixture of experts in every block (dropless, top-k renormalised)
  qwen2_moe  Qwen2 with mixtures of experts every `decoder_sparse_step` blocks but those in
             `mlp_only_layers`, each with a shared expert behind a sigmoid gate; `norm_topk_prob` says
             whether the top-k weights are renormalised
  qwen3_moe  Qwen3 (QK-norm) with Qwen2-MoE's placement and routing of experts, without a shared expert
  deepseek_v3  multi-head latent attention (`mla`); the first `first_k_dense_replace` blocks dense, then
             experts behind a sigmoid router with its balancing bias (`e_score_correction_bias`), grouped
             top-k and scaled weights, and ungated shared experts. Its multi-token prediction layers
             (`num_nextn_predict_layers`), which transformers drops on load, are neither read nor written
transformers 5.x keeps RoPE settings under `rope_parameters`; older files under `rope_scaling` and
`rope_theta`. Both are read, with the rope types 'default', 'llama3', 'linear', 'dynamic' and 'yarn'.
Which layers are local (`layer_types`, or each type's own default) must be every layer, none, or all but
every N-th (`model.global_every`); any other pattern is a ConfigError naming `layer_types`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mintrain.errors import ConfigError

MODEL_TYPES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
               'gemma': 'GemmaForCausalLM', 'mixtral': 'MixtralForCausalLM',
               'qwen2_moe': 'Qwen2MoeForCausalLM', 'qwen3': 'Qwen3ForCausalLM', 'gemma2': 'Gemma2ForCausalLM',
               'gemma3_text': 'Gemma3ForCausalLM', 'qwen3_moe': 'Qwen3MoeForCausalLM',
               'deepseek_v3': 'DeepseekV3ForCausalLM', 'gemma3': 'Gemma3ForConditionalGeneration'}
GEMMAS = ('gemma', 'gemma2', 'gemma3_text')
# transformers' defaults of the Gemma 2 and 3 keys a config.json may leave out.
GEMMA_DEFAULTS = {
    'gemma2': {'query_pre_attn_scalar': 256, 'sliding_window': 4096, 'attn_logit_softcapping': 50.0,
               'final_logit_softcapping': 30.0, 'global_every': 2},
    'gemma3_text': {'query_pre_attn_scalar': 256, 'sliding_window': 4096, 'attn_logit_softcapping': None,
                    'final_logit_softcapping': None, 'global_every': 6},
}
# transformers' Gemma3TextConfig defaults of the keys a multimodal Gemma 3's text_config leaves out (the
# released config.json files write only those that differ).
GEMMA3_TEXT_DEFAULTS = {'model_type': 'gemma3_text', 'vocab_size': 262208, 'hidden_size': 2304,
                        'intermediate_size': 9216, 'num_hidden_layers': 26, 'num_attention_heads': 8,
                        'num_key_value_heads': 4, 'head_dim': 256, 'tie_word_embeddings': True}
LAYER_TYPES = ('sliding_attention', 'full_attention')
QKV_BIAS = ('qwen2', 'qwen2_moe')
ROPE_TYPES = ('default', 'llama3', 'linear', 'dynamic', 'yarn')
ACTIVATIONS = {'silu': 'silu', 'swish': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh', 'gelu': 'gelu_tanh'}


ROPE_KEYS = {'llama3': ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'),
             'linear': ('factor',), 'dynamic': ('factor',), 'yarn': ('factor',)}


def model_options(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The `model` section's options for a `config.json` whose model_type is one of MODEL_TYPES
  (`models.family_for_hf` picked this family by it); a one-line ConfigError for what is not read."""
  try:
    return _model_options(hf)
  except ConfigError:
    raise
  except KeyError as e:
    raise ConfigError(f"config.json has no {e.args[0]!r}, which a {hf['model_type']} checkpoint needs: use "
                      'the config.json saved with these weights.') from None
  except (TypeError, ValueError) as e:
    raise ConfigError(f'config.json holds a value of the wrong type ({e}): use the config.json saved with '
                      'these weights.') from None


def _model_options(hf: Mapping[str, Any]) -> dict[str, Any]:
  if hf['model_type'] == 'gemma3':
    text = hf.get('text_config') or {}
    if not isinstance(text, Mapping):
      raise ConfigError('config.json text_config is not an object: use the config.json saved with these '
                        'weights.')
    hf = {**GEMMA3_TEXT_DEFAULTS, 'tie_word_embeddings': hf.get('tie_word_embeddings', True), **text}
    if hf['model_type'] != 'gemma3_text':
      raise ConfigError(f"config.json: a gemma3 text_config of model_type {hf['model_type']!r}; mintrain "
                        "reads 'gemma3_text'.")
  model_type = hf['model_type']
  if hf.get('mlp_bias') or (model_type not in QKV_BIAS and hf.get('attention_bias')):
    raise ConfigError(f'config.json: {model_type} with mlp_bias or attention_bias is not supported (mintrain '
                      'has biases on the query, key and value projections only, as Qwen2).')
  if hf.get('use_bidirectional_attention'):
    raise ConfigError(f'config.json: {model_type} with use_bidirectional_attention is not supported '
                      '(mintrain attends causally).')
  rope, local_rope = _rope_parameters(hf)
  rope_type = rope.get('rope_type', rope.get('type', 'default'))
  if rope_type not in ROPE_TYPES:
    raise ConfigError(f"config.json rope_type {rope_type!r} is not supported; mintrain reads "
                      f"{', '.join(map(repr, ROPE_TYPES))}, and a model trained with another would give "
                      'other logits: load a checkpoint of a model that uses one of these.')
  if rope.get('partial_rotary_factor', hf.get('partial_rotary_factor', 1.0)) != 1.0:
    raise ConfigError('config.json partial_rotary_factor is not supported; mintrain rotates all of head_dim.')
  missing = [key for key in ROPE_KEYS.get(rope_type, ()) if key not in rope]
  if missing:
    raise ConfigError(f"config.json: rope type {rope_type!r} needs {', '.join(missing)} beside it (in "
                      'rope_parameters or rope_scaling): use the config.json saved with these weights.')
  activation = hf.get('hidden_activation') or hf.get('hidden_act', 'silu')
  if activation not in ACTIVATIONS:
    raise ConfigError(f'config.json hidden_act={activation!r} is not supported; mintrain reads '
                      f'{", ".join(ACTIVATIONS)}.')
  heads, embed = hf['num_attention_heads'], hf['hidden_size']
  gemma, defaults = model_type in GEMMAS, GEMMA_DEFAULTS.get(model_type, {})
  window, global_every = windows(hf)
  options = {
      'name': 'transformer', 'vocab_size': hf['vocab_size'], 'embed_dim': embed,
      'num_layers': hf['num_hidden_layers'], 'num_heads': heads,
      'num_kv_heads': hf.get('num_key_value_heads') or heads,
      'head_dim': hf.get('head_dim') or embed // heads,
      'mlp_dim': hf['intermediate_size'], 'tie_embeddings': bool(hf.get('tie_word_embeddings', gemma)),
      'rope_base': float(rope.get('rope_theta', hf.get('rope_theta', 10000.0))),
      'norm_eps': float(hf.get('rms_norm_eps', 1e-6)), 'norm_plus_one': gemma, 'embed_scale': gemma,
      'qkv_bias': model_type in QKV_BIAS, 'qk_norm': model_type in ('qwen3', 'qwen3_moe', 'gemma3_text'),
      'mlp_activation': ACTIVATIONS[activation], 'rope_scaling': 'none',
      'sliding_window': window, 'global_every': global_every, 'post_norms': bool(defaults),
      'rope_local_base': float(local_rope['rope_theta']) if local_rope else 0.0,
      'query_scale': float(hf.get('query_pre_attn_scalar', defaults.get('query_pre_attn_scalar', 0))),
      'attn_softcap': float(hf.get('attn_logit_softcapping', defaults.get('attn_logit_softcapping')) or 0),
      'final_softcap': float(hf.get('final_logit_softcapping', defaults.get('final_logit_softcapping')) or 0),
  }
  options |= _moe_options(hf) | _mla_options(hf, rope_type, rope)
  return options | _rope_options(hf, rope_type, rope)


def _mla_options(hf: Mapping[str, Any], rope_type: str, rope: Mapping[str, Any]) -> dict[str, Any]:
  """DeepSeek-V3's latent attention: head_dim is the rotary part (as transformers' own config says); the
  softmax scale grows by YaRN's mscale(factor, mscale_all_dim) squared (`yarn_apply_mscale`)."""
  if hf['model_type'] != 'deepseek_v3':
    return {}
  mscale_all_dim = float(rope.get('mscale_all_dim') or 0) if rope_type != 'default' else 0.0
  return {'kv_lora_rank': hf['kv_lora_rank'], 'q_lora_rank': hf.get('q_lora_rank') or 0,
          'qk_nope_head_dim': hf['qk_nope_head_dim'], 'head_dim': hf['qk_rope_head_dim'],
          'v_head_dim': hf['v_head_dim'], 'num_kv_heads': hf['num_attention_heads'],
          'rope_interleave': bool(hf.get('rope_interleave', True)), 'mla_mscale_all_dim': mscale_all_dim}


def _rope_options(hf: Mapping[str, Any], rope_type: str, rope: Mapping[str, Any]) -> dict[str, Any]:
  """The RoPE scaling options, with transformers' defaults (`modeling_rope_utils`): dynamic stretches past
  max_position_embeddings; YaRN's factor defaults to max / original context, its attention factor to
  one from `mscale` and `mscale_all_dim` or from the factor."""
  if rope_type == 'default':
    return {}
  max_len = hf.get('max_position_embeddings', 2048)
  if rope_type == 'linear':
    return {'rope_scaling': 'linear', 'rope_scaling_factor': float(rope['factor'])}
  if rope_type == 'dynamic':
    return {'rope_scaling': 'dynamic', 'rope_scaling_factor': float(rope['factor']),
            'rope_original_max_len': int(max_len)}
  original = int(hf.get('original_max_position_embeddings') or rope.get('original_max_position_embeddings')
                 or max_len)
  if rope_type == 'llama3':
    return {'rope_scaling': 'llama3', 'rope_scaling_factor': float(rope['factor']),
            'rope_low_freq_factor': float(rope['low_freq_factor']),
            'rope_high_freq_factor': float(rope['high_freq_factor']), 'rope_original_max_len': original}
  factor = float(rope.get('factor') or max_len / original)

  def mscale(scale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

  attention_factor = rope.get('attention_factor')
  if attention_factor is None:
    both = rope.get('mscale') and rope.get('mscale_all_dim')
    attention_factor = mscale(rope['mscale']) / mscale(rope['mscale_all_dim']) if both else mscale(1)
  return {'rope_scaling': 'yarn', 'rope_scaling_factor': factor, 'rope_original_max_len': original,
          'rope_beta_fast': float(rope.get('beta_fast') or 32),
          'rope_beta_slow': float(rope.get('beta_slow') or 1),
          'rope_attention_factor': float(attention_factor), 'rope_truncate': bool(rope.get('truncate', True))}


def _moe_options(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The mixture-of-experts options of a mixtral, qwen2_moe or qwen3_moe config.json (none for the
  others). All are dropless; transformers' balancing loss (`router_aux_loss_coef`) sums over the k choices,
  so it is k times ours; none has a z-loss."""
  model_type, k = hf['model_type'], hf.get('num_experts_per_tok', 2)
  common = {'experts_per_token': k, 'capacity_factor': 0.0, 'router_z_loss_weight': 0.0,
            'load_balance_loss_weight': float(hf.get('router_aux_loss_coef', 0.001)) * k}
  if model_type == 'mixtral':
    return {**common, 'num_experts': hf['num_local_experts'], 'moe_every': 1,
            'expert_mlp_dim': hf['intermediate_size'], 'router_norm_topk': True, 'shared_expert_dim': 0}
  if model_type == 'deepseek_v3':
    shared = (hf.get('n_shared_experts') or 0) * hf['moe_intermediate_size']
    return {**common, 'num_experts': hf['n_routed_experts'], 'moe_every': 1,
            'dense_layers': tuple(range(hf.get('first_k_dense_replace') or 0)),
            'expert_mlp_dim': hf['moe_intermediate_size'], 'router_norm_topk': bool(hf.get('norm_topk_prob')),
            'shared_expert_dim': shared, 'shared_expert_gate': False, 'router_score': 'sigmoid',
            'router_groups': hf.get('n_group') or 1, 'router_group_topk': hf.get('topk_group') or 1,
            'routed_scaling_factor': float(hf.get('routed_scaling_factor', 1.0)),
            'load_balance_loss_weight': 0.0}
  if model_type in ('qwen2_moe', 'qwen3_moe'):
    shared = hf.get('shared_expert_intermediate_size', 0) if model_type == 'qwen2_moe' else 0
    if model_type == 'qwen2_moe' and not shared:
      raise ConfigError('config.json: qwen2_moe without a shared expert (shared_expert_intermediate_size) is '
                        'not supported.')
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts (an alias of num_experts).
    experts = hf.get('num_experts') or hf.get('num_local_experts', 0)
    options = {'num_experts': experts, 'moe_every': hf.get('decoder_sparse_step', 1),
               'dense_layers': tuple(hf.get('mlp_only_layers') or ())}
    if not experts:  # transformers makes every block dense then.
      return {'num_experts': 0}
    return {**common, **options, 'expert_mlp_dim': hf['moe_intermediate_size'],
            'router_norm_topk': bool(hf.get('norm_topk_prob')), 'shared_expert_dim': shared}
  return {}


def _rope_parameters(hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
  """(the global layers' RoPE parameters, Gemma 3's local layers' or None). transformers 5.x writes Gemma 3's
  by layer type under `rope_parameters`; older files `rope_theta`, `rope_scaling` and
  `rope_local_base_freq`."""
  params = dict(hf.get('rope_parameters') or {})
  if hf['model_type'] != 'gemma3_text':
    return params or dict(hf.get('rope_scaling') or {}), None
  if 'full_attention' in params or 'sliding_attention' in params:
    unknown = set(params) - set(LAYER_TYPES)
    if unknown:
      raise ConfigError(f'config.json rope_parameters has {sorted(unknown)[0]!r}; mintrain reads the layer '
                        f'types {", ".join(LAYER_TYPES)}.')
    rope = {'rope_theta': 1e6, **params.get('full_attention', {})}
    local = {'rope_theta': 1e4, **params.get('sliding_attention', {})}
  else:
    rope = {'rope_theta': hf.get('rope_theta', 1e6), **(hf.get('rope_scaling') or {})}
    local = {'rope_theta': hf.get('rope_local_base_freq', 1e4)}
  local_type = local.get('rope_type', local.get('type', 'default'))
  if local_type != 'default':
    raise ConfigError(f'config.json rope_parameters.sliding_attention rope_type {local_type!r} is not '
                      "supported; mintrain's local layers take RoPE without scaling ('default').")
  return rope, local


def layer_types(hf: Mapping[str, Any]) -> list[str]:
  """Each layer's attention type, as transformers derives it when `layer_types` is not written: Gemma 2
  alternates, Gemma 3 puts a global layer every `sliding_window_pattern`-th, Qwen2 and Qwen3 make the
  layers from `max_window_layers` on local when `use_sliding_window`, Mistral's all are local."""
  n, model_type = hf['num_hidden_layers'], hf['model_type']
  window = hf.get('sliding_window')
  if hf.get('layer_types') is not None:
    if len(hf['layer_types']) != n:
      raise ConfigError(f"config.json layer_types has {len(hf['layer_types'])} entries for num_hidden_layers="
                        f'{n}: use the config.json saved with these weights.')
    return list(hf['layer_types'])
  if model_type in GEMMA_DEFAULTS:
    every = hf.get('sliding_window_pattern', GEMMA_DEFAULTS[model_type]['global_every'])
    return ['full_attention' if (i + 1) % every == 0 else 'sliding_attention' for i in range(n)]
  if 'use_sliding_window' in hf or model_type in (*QKV_BIAS, 'qwen3'):
    local = hf.get('use_sliding_window', False) and window is not None
    return ['sliding_attention' if local and i >= hf.get('max_window_layers', 28) else 'full_attention'
            for i in range(n)]
  return ['sliding_attention' if window else 'full_attention'] * n


def windows(hf: Mapping[str, Any]) -> tuple[int, int]:
  """(model.sliding_window, model.global_every) of a config.json: every layer local, none, or all but
  every N-th; another pattern, or a layer type mintrain does not know, is a ConfigError."""
  types = layer_types(hf)
  unknown = sorted(set(types) - set(LAYER_TYPES))
  if unknown:
    raise ConfigError(f'config.json layer_types has {unknown[0]!r}; mintrain reads '
                      f'{", ".join(LAYER_TYPES)}.')
  if 'sliding_attention' not in types:
    return 0, 0
  window = hf.get('sliding_window') or GEMMA_DEFAULTS.get(hf['model_type'], {}).get('sliding_window')
  if not window:
    raise ConfigError('config.json has sliding_attention layers but no sliding_window: use the config.json '
                      'saved with these weights.')
  n = len(types)
  for every in (0, *range(1, n + 1)):
    if types == [_layer_type(i, every) for i in range(n)]:
      return int(window), every
  raise ConfigError(f'config.json layer_types {types} is not supported; mintrain makes every layer local, '
                    'or all but every N-th (model.global_every).')


def _layer_type(layer: int, global_every: int) -> str:
  return 'full_attention' if global_every and (layer + 1) % global_every == 0 else 'sliding_attention'


def hf_model_type(cfg: Any) -> str:
  """The Hugging Face architecture of a transformer-family model config, or a ConfigError."""
  deepseek = cfg.mla or cfg.router_score == 'sigmoid'
  if deepseek:
    if not (cfg.mla and cfg.num_experts and cfg.router_score == 'sigmoid' and cfg.moe_every == 1
            and cfg.dense_layers == tuple(range(len(cfg.dense_layers))) and not cfg.tie_embeddings
            and not cfg.shared_expert_gate and cfg.mlp_activation == 'silu' and not cfg.norm_plus_one
            and not cfg.embed_scale):
      raise ConfigError('Latent attention (model.kv_lora_rank) and sigmoid routers have a Hugging Face '
                        'architecture together only, as DeepSeek-V3: experts in every block after the first '
                        'dense_layers, shared_expert_gate=False, untied embeddings, silu.')
    return 'deepseek_v3'
  if cfg.post_norms:
    if (not (cfg.norm_plus_one and cfg.embed_scale and cfg.mlp_activation == 'gelu_tanh') or cfg.num_experts
        or cfg.qkv_bias):
      raise ConfigError('model.post_norms has a Hugging Face architecture as Gemma 2 or 3 only '
                        "(norm_plus_one, embed_scale, mlp_activation='gelu_tanh', no experts or qkv_bias).")
    if cfg.rope_local_base and not cfg.qk_norm:
      raise ConfigError('model.rope_local_base has a Hugging Face architecture as Gemma 3 only '
                        '(with qk_norm).')
    return 'gemma3_text' if cfg.qk_norm else 'gemma2'
  if cfg.attn_softcap or cfg.final_softcap or cfg.query_scale or cfg.rope_local_base:
    raise ConfigError('model.attn_softcap, final_softcap, query_scale and rope_local_base have a Hugging '
                      'Face architecture as Gemma 2 or 3 only (with model.post_norms).')
  if cfg.global_every and cfg.sliding_window:
    raise ConfigError(f'model.global_every={cfg.global_every} has a Hugging Face architecture as Gemma 2 '
                      'or 3 only (with model.post_norms).')
  if cfg.qk_norm:
    if (cfg.shared_expert_dim or cfg.qkv_bias or cfg.norm_plus_one or cfg.embed_scale
        or cfg.mlp_activation != 'silu'):
      raise ConfigError('model.qk_norm has a Hugging Face architecture as Qwen3 or Qwen3-MoE only (no '
                        "shared_expert_dim, qkv_bias, norm_plus_one or embed_scale, mlp_activation='silu').")
    return 'qwen3_moe' if cfg.num_experts else 'qwen3'
  if cfg.num_experts:
    if cfg.shared_expert_dim and cfg.qkv_bias:
      return 'qwen2_moe'
    if (cfg.shared_expert_dim or cfg.qkv_bias or cfg.moe_every != 1 or cfg.dense_layers
        or cfg.expert_dim != cfg.mlp_dim or not cfg.router_norm_topk):
      raise ConfigError('A mixture of experts has a Hugging Face architecture as Mixtral (moe_every=1, no '
                        'dense_layers, expert_mlp_dim = mlp_dim, router_norm_topk, no shared expert, no '
                        'qkv_bias), as Qwen2-MoE (a shared expert and qkv_bias) or as Qwen3-MoE (qk_norm).')
    return 'mixtral'
  if cfg.norm_plus_one or cfg.embed_scale or cfg.mlp_activation != 'silu':
    if not (cfg.norm_plus_one and cfg.embed_scale and cfg.mlp_activation == 'gelu_tanh'):
      raise ConfigError('Only the Gemma combination of norm_plus_one, embed_scale and '
                        "mlp_activation='gelu_tanh' has a Hugging Face architecture.")
    if cfg.sliding_window:
      raise ConfigError(f'model.sliding_window={cfg.sliding_window}: Gemma (first generation) has no sliding '
                        'window; set it to 0 to export.')
    return 'gemma'
  return 'qwen2' if cfg.qkv_bias else 'mistral' if cfg.sliding_window else 'llama'


def config_json(cfg: Any, dtype: str) -> dict[str, Any]:
  """A `config.json` for a transformer-family model config (`TransformerConfig`)."""
  hf_type = hf_model_type(cfg)
  rope: dict[str, Any] = {'rope_theta': cfg.rope_base, 'rope_type': 'default'}
  if cfg.rope_scaling != 'none':
    rope.update(rope_type=cfg.rope_scaling, factor=cfg.rope_scaling_factor)
  if cfg.rope_scaling == 'llama3':
    rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
  if cfg.rope_scaling == 'yarn':
    rope.update(original_max_position_embeddings=cfg.rope_original_max_len, beta_fast=cfg.rope_beta_fast,
                beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate,
                attention_factor=cfg.yarn_attention_factor)
    if cfg.mla_mscale_all_dim:  # DeepSeek's softmax scale reads it (cos and sin take attention_factor).
      rope['mscale_all_dim'] = cfg.mla_mscale_all_dim
  if hf_type == 'gemma3_text':
    local = {'rope_type': 'default', 'rope_theta': cfg.rope_local_base or cfg.rope_base}
    rope = {'full_attention': rope, 'sliding_attention': local}
  out = {
      'architectures': [MODEL_TYPES[hf_type]], 'model_type': hf_type, 'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.embed_dim, 'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads, 'num_key_value_heads': cfg.kv_heads, 'head_dim': cfg.head_dim,
      'intermediate_size': cfg.mlp_dim, 'tie_word_embeddings': cfg.tie_embeddings,
      'rms_norm_eps': cfg.norm_eps, 'rope_parameters': rope, 'dtype': dtype,
      'hidden_act': 'gelu_pytorch_tanh' if hf_type in GEMMAS else 'silu',
  }
  if hf_type in GEMMAS:
    out['hidden_activation'] = 'gelu_pytorch_tanh'
  if hf_type in GEMMA_DEFAULTS:
    out |= {'sliding_window': cfg.sliding_window or None,
            'query_pre_attn_scalar': _number(cfg.query_scale or cfg.head_dim),
            'attn_logit_softcapping': cfg.attn_softcap or None,
            'final_logit_softcapping': cfg.final_softcap or None,
            'layer_types': [_layer_type(i, cfg.global_every) if cfg.sliding_window else 'full_attention'
                            for i in range(cfg.num_layers)]}
  if cfg.rope_scaling == 'dynamic':  # The length past which it stretches; transformers reads it here.
    out['max_position_embeddings'] = cfg.rope_original_max_len
  if hf_type in ('qwen3', 'qwen3_moe'):
    out |= {'attention_bias': False, 'use_sliding_window': False}
  k = cfg.experts_per_token
  if hf_type == 'deepseek_v3':
    out |= _deepseek_config(cfg)
  if hf_type == 'mixtral':
    out |= {'num_local_experts': cfg.num_experts, 'num_experts_per_tok': k, 'sliding_window': None,
            'router_aux_loss_coef': cfg.load_balance_loss_weight / k}
  if hf_type == 'qwen2_moe':
    out |= {'num_experts': cfg.num_experts, 'num_experts_per_tok': k, 'moe_intermediate_size': cfg.expert_dim,
            'shared_expert_intermediate_size': cfg.shared_expert_dim, 'decoder_sparse_step': cfg.moe_every,
            'norm_topk_prob': cfg.router_norm_topk, 'mlp_only_layers': list(cfg.dense_layers),
            'qkv_bias': True, 'use_sliding_window': False,
            'router_aux_loss_coef': cfg.load_balance_loss_weight / k}
  if hf_type == 'qwen3_moe':
    out |= {'num_experts': cfg.num_experts, 'num_experts_per_tok': k,
            'moe_intermediate_size': cfg.expert_dim, 'decoder_sparse_step': cfg.moe_every,
            'norm_topk_prob': cfg.router_norm_topk, 'mlp_only_layers': list(cfg.dense_layers),
            'router_aux_loss_coef': cfg.load_balance_loss_weight / k}
  if cfg.sliding_window and hf_type not in GEMMA_DEFAULTS:  # On every layer (global_every=0).
    out['sliding_window'] = cfg.sliding_window
    if hf_type in (*QKV_BIAS, 'qwen3', 'qwen3_moe'):  # Qwen2 and Qwen3 (MoE too): on every layer.
      out |= {'use_sliding_window': True, 'max_window_layers': 0}
  return out


def _number(value: float) -> int | float:
  """A whole number as an int (transformers' config classes check the type), others as they are."""
  return int(value) if float(value).is_integer() else value


def _deepseek_config(cfg: Any) -> dict[str, Any]:
  """DeepSeek-V3's own keys; num_nextn_predict_layers 0: no multi-token prediction layers are written."""
  width = cfg.expert_dim
  if cfg.shared_expert_dim % width:
    raise ConfigError(f'model.shared_expert_dim={cfg.shared_expert_dim} must be a multiple of '
                      f'model.expert_mlp_dim={width} (DeepSeek-V3 counts shared experts).')
  return {'head_dim': cfg.head_dim, 'qk_rope_head_dim': cfg.head_dim,
          'qk_nope_head_dim': cfg.qk_nope_head_dim, 'v_head_dim': cfg.value_dim,
          'kv_lora_rank': cfg.kv_lora_rank, 'q_lora_rank': cfg.q_lora_rank or None,
          'rope_interleave': cfg.rope_interleave, 'n_routed_experts': cfg.num_experts,
          'num_experts_per_tok': cfg.experts_per_token, 'moe_intermediate_size': width,
          'n_shared_experts': cfg.shared_expert_dim // width, 'first_k_dense_replace': len(cfg.dense_layers),
          'n_group': cfg.router_groups, 'topk_group': cfg.router_group_topk,
          'routed_scaling_factor': cfg.routed_scaling_factor, 'norm_topk_prob': cfg.router_norm_topk,
          'num_nextn_predict_layers': 0, 'attention_bias': False}
