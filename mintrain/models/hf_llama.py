"""Hugging Face Llama-family checkpoints <-> the transformer family: config.json keys and weight names.

One table per direction, read by `mintrain.hf`, which knows nothing of any architecture:
  llama    Llama 2 and 3.x (Llama 3.1's RoPE scaling: `rope_type` 'llama3')
  mistral  as Llama; its sliding window becomes `model.sliding_window`, which mintrain does not apply but
           checks: a sequence longer than the window is an error (within it, attention is the same)
  qwen2    biases on the query, key and value projections
  gemma    (first generation) norms scaling by (1 + w), embeddings times sqrt(hidden), GeGLU, tied output
transformers 5.x keeps RoPE settings under `rope_parameters`; older files under `rope_scaling` and
`rope_theta`. Both are read.

Weights: `transformers` stores a projection as (out, in); mintrain stores (in, heads, head_dim) and
(heads, head_dim, out). Each mintrain parameter maps to one tensor by one `Kind` of reshaping, which also
maps any rectangular slice of it to one rectangular slice of the tensor, read block by block (`read`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mintrain.fields import ConfigError

MODEL_TYPES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
               'gemma': 'GemmaForCausalLM'}
ACTIVATIONS = {'silu': 'silu', 'swish': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh', 'gelu': 'gelu_tanh'}


class Kind(enum.Enum):
  SAME = 'same'  # Same layout (embeddings, norm scales).
  T = 'transpose'  # ours (in, out) = theirs (out, in).T
  IN_HEADS = 'in_heads'  # ours (D, N, K) = theirs (N*K, D).T, reshaped.
  HEADS_OUT = 'heads_out'  # ours (N, K, D) = theirs (D, N*K).T, reshaped.
  HEADS = 'heads'  # ours (N, K) = theirs (N*K,), reshaped.


def model_options(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The `model` section's options for a `config.json` whose model_type is one of MODEL_TYPES
  (`models.family_for_hf` picked this family by it); a one-line ConfigError for what is not read."""
  model_type = hf['model_type']
  if hf.get('mlp_bias') or (model_type != 'qwen2' and hf.get('attention_bias')):
    raise ConfigError(f'config.json: {model_type} with mlp_bias or attention_bias is not supported (mintrain '
                      'has biases on the query, key and value projections only, as Qwen2).')
  rope = dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})
  rope_type = rope.get('rope_type', rope.get('type', 'default'))
  if rope_type not in ('default', 'llama3'):
    raise ConfigError(f"config.json rope type {rope_type!r} is not supported; mintrain reads 'default' and "
                      "'llama3' (Llama 3.1) RoPE, and a model trained with another would give other logits: "
                      'load a checkpoint of a model that uses one of these.')
  activation = hf.get('hidden_activation') or hf.get('hidden_act', 'silu')
  if activation not in ACTIVATIONS:
    raise ConfigError(f'config.json hidden_act={activation!r} is not supported; mintrain reads '
                      f'{", ".join(ACTIVATIONS)}.')
  heads, embed = hf['num_attention_heads'], hf['hidden_size']
  gemma = model_type == 'gemma'
  options = {
      'name': 'transformer', 'vocab_size': hf['vocab_size'], 'embed_dim': embed,
      'num_layers': hf['num_hidden_layers'], 'num_heads': heads,
      'num_kv_heads': hf.get('num_key_value_heads') or heads,
      'head_dim': hf.get('head_dim') or embed // heads,
      'mlp_dim': hf['intermediate_size'], 'tie_embeddings': bool(hf.get('tie_word_embeddings', gemma)),
      'rope_base': float(rope.get('rope_theta', hf.get('rope_theta', 10000.0))),
      'norm_eps': float(hf.get('rms_norm_eps', 1e-6)), 'norm_plus_one': gemma, 'embed_scale': gemma,
      'qkv_bias': model_type == 'qwen2', 'mlp_activation': ACTIVATIONS[activation], 'rope_scaling': 'none',
      'sliding_window': sliding_window(hf),
  }
  if rope_type == 'llama3':
    options.update(rope_scaling='llama3', rope_scaling_factor=float(rope['factor']),
                   rope_low_freq_factor=float(rope['low_freq_factor']),
                   rope_high_freq_factor=float(rope['high_freq_factor']),
                   rope_original_max_len=int(rope['original_max_position_embeddings']))
  return options


def sliding_window(hf: Mapping[str, Any]) -> int:
  """The attention window of a config.json's layers, 0 for none: Mistral's `sliding_window`; Qwen2's when
  `use_sliding_window`, on the layers that `layer_types` (or, in older files, `max_window_layers`) say."""
  window = hf.get('sliding_window') or 0
  if not hf.get('use_sliding_window', True):
    return 0
  layer_types = hf.get('layer_types')
  if layer_types is not None:
    return window if 'sliding_attention' in layer_types else 0
  if hf['num_hidden_layers'] <= hf.get('max_window_layers', 0):
    return 0
  return window


def config_json(cfg: Any, dtype: str) -> dict[str, Any]:
  """A `config.json` for a transformer-family model config (`TransformerConfig`)."""
  if cfg.norm_plus_one or cfg.embed_scale or cfg.mlp_activation != 'silu':
    model_type = 'gemma'
    if not (cfg.norm_plus_one and cfg.embed_scale and cfg.mlp_activation == 'gelu_tanh'):
      raise ConfigError('Only the Gemma combination of norm_plus_one, embed_scale and '
                        "mlp_activation='gelu_tanh' has a Hugging Face architecture.")
  else:
    model_type = 'qwen2' if cfg.qkv_bias else 'mistral' if cfg.sliding_window else 'llama'
  if cfg.sliding_window and model_type == 'gemma':
    raise ConfigError(f'model.sliding_window={cfg.sliding_window}: Gemma (first generation) has no sliding '
                      'window; set it to 0 to export.')
  rope: dict[str, Any] = {'rope_theta': cfg.rope_base, 'rope_type': 'default'}
  if cfg.rope_scaling == 'llama3':
    rope.update(rope_type='llama3', factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
  out = {
      'architectures': [MODEL_TYPES[model_type]], 'model_type': model_type, 'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.embed_dim, 'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads, 'num_key_value_heads': cfg.kv_heads, 'head_dim': cfg.head_dim,
      'intermediate_size': cfg.mlp_dim, 'tie_word_embeddings': cfg.tie_embeddings,
      'rms_norm_eps': cfg.norm_eps, 'rope_parameters': rope, 'dtype': dtype,
      'hidden_act': 'gelu_pytorch_tanh' if model_type == 'gemma' else 'silu',
  }
  if model_type == 'gemma':
    out['hidden_activation'] = 'gelu_pytorch_tanh'
  if cfg.sliding_window:  # On every layer, as mintrain's option means it.
    out['sliding_window'] = cfg.sliding_window
    if model_type == 'qwen2':
      out |= {'use_sliding_window': True, 'max_window_layers': 0}
  return out


def weight_names(cfg: Any) -> dict[str, tuple[str, Kind]]:
  """{mintrain parameter path (unscanned layers): (Hugging Face tensor name, Kind)}."""
  names = {'embedding_VD': ('model.embed_tokens.weight', Kind.SAME),
           'final_norm.scale': ('model.norm.weight', Kind.SAME)}
  if not cfg.tie_embeddings:
    names['unembed_DV'] = ('lm_head.weight', Kind.T)
  for i in range(cfg.num_layers):
    ours, theirs = f'blocks.{i}', f'model.layers.{i}'
    names |= {
        f'{ours}.attn_norm.scale': (f'{theirs}.input_layernorm.weight', Kind.SAME),
        f'{ours}.mlp_norm.scale': (f'{theirs}.post_attention_layernorm.weight', Kind.SAME),
        f'{ours}.attn.wq_DHK': (f'{theirs}.self_attn.q_proj.weight', Kind.IN_HEADS),
        f'{ours}.attn.wk_DHK': (f'{theirs}.self_attn.k_proj.weight', Kind.IN_HEADS),
        f'{ours}.attn.wv_DHK': (f'{theirs}.self_attn.v_proj.weight', Kind.IN_HEADS),
        f'{ours}.attn.wo_HKD': (f'{theirs}.self_attn.o_proj.weight', Kind.HEADS_OUT),
        f'{ours}.mlp.wi_gate_DF': (f'{theirs}.mlp.gate_proj.weight', Kind.T),
        f'{ours}.mlp.wi_up_DF': (f'{theirs}.mlp.up_proj.weight', Kind.T),
        f'{ours}.mlp.wo_FD': (f'{theirs}.mlp.down_proj.weight', Kind.T),
    }
    if cfg.qkv_bias:
      names |= {f'{ours}.attn.bq_HK': (f'{theirs}.self_attn.q_proj.bias', Kind.HEADS),
                f'{ours}.attn.bk_GK': (f'{theirs}.self_attn.k_proj.bias', Kind.HEADS),
                f'{ours}.attn.bv_GK': (f'{theirs}.self_attn.v_proj.bias', Kind.HEADS)}
  return names


def their_shape(kind: Kind, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The Hugging Face tensor's shape for a mintrain parameter of `shape`."""
  if kind is Kind.SAME:
    return shape
  if kind is Kind.T:
    return shape[::-1]
  if kind is Kind.IN_HEADS:
    return (shape[1] * shape[2], shape[0])
  if kind is Kind.HEADS_OUT:
    return (shape[2], shape[0] * shape[1])
  return (shape[0] * shape[1],)


def their_index(kind: Kind, index: tuple[slice, ...], head_dim: int) -> tuple[slice, ...]:
  """The rectangle of the Hugging Face tensor that our parameter's `index` (slices with explicit bounds)
  reads: (rows, columns), or (rows,) of a vector."""
  k = head_dim
  if kind is Kind.SAME:
    return index
  if kind is Kind.T:
    return index[::-1]
  if kind is Kind.IN_HEADS:  # ours (D, N, K)[d, n, kk] = theirs[n*K + kk, d]
    return slice(index[1].start * k, index[1].stop * k), index[0]
  if kind is Kind.HEADS_OUT:  # ours (N, K, D)[n, kk, d] = theirs[d, n*K + kk]
    return index[2], slice(index[0].start * k, index[0].stop * k)
  return (slice(index[0].start * k, index[0].stop * k),)  # HEADS: ours (N, K)[n, kk] = theirs[n*K + kk]


def _place(kind: Kind, rows: np.ndarray, offset: int, index: tuple[slice, ...], head_dim: int,
           out: np.ndarray) -> None:
  """Writes into `out` (our `index`) the part that `rows` of its rectangle (`their_index`) hold, which
  start `offset` rows into it."""
  k, n = head_dim, len(rows)
  if kind is Kind.SAME:
    out[offset:offset + n] = rows
  elif kind is Kind.T:
    out[:, offset:offset + n] = rows.T
  elif kind is Kind.IN_HEADS:  # Rows of whole heads: (heads, K, D), our head dims picked, to (D, heads, K).
    out[:, offset // k:(offset + n) // k] = rows.reshape(n // k, k, -1)[:, index[2]].transpose(2, 0, 1)
  elif kind is Kind.HEADS_OUT:  # Rows of D: to (N, K, D), our head dims picked.
    out[:, :, offset:offset + n] = rows.T.reshape(out.shape[0], k, n)[:, index[1]]
  else:
    out[offset // k:(offset + n) // k] = rows.reshape(n // k, k)[:, index[1]]


def read(kind: Kind, tensor: Any, targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
         head_dim: int) -> None:
  """Fills each target's array with our parameter's slice `index` (slices with explicit bounds) of
  `targets` [(index, array)], read from `tensor` (`safetensors_reader.Tensor`) in one pass over the rows
  that any of them needs, a block at a time: the devices of a process share each read, and nothing but
  the targets is slice-sized. Rows of heads are read whole heads at a time."""
  wanted = [(their_index(kind, index, head_dim), index, out) for index, out in targets]
  columns = ()
  if len(tensor.shape) == 2:
    columns = (slice(min(w[0][1].start for w in wanted), max(w[0][1].stop for w in wanted)),)
  multiple = head_dim if kind in (Kind.IN_HEADS, Kind.HEADS) else 1
  for rows in _merged(sorted(w[0][0] for w in wanted)):
    for start, block in tensor.blocks((rows, *columns), rows_multiple=multiple):
      start += rows.start
      for (their_rows, *their_columns), index, out in wanted:
        first, last = max(their_rows.start, start), min(their_rows.stop, start + len(block))
        if first < last:
          part = block[first - start:last - start]
          if columns:
            part = part[:, their_columns[0].start - columns[0].start:their_columns[0].stop - columns[0].start]
          _place(kind, part, first - their_rows.start, index, head_dim, out)


def _merged(intervals: Sequence[slice]) -> list[slice]:
  """Sorted intervals with those that overlap or touch merged."""
  out: list[slice] = []
  for s in intervals:
    if out and s.start <= out[-1].stop:
      out[-1] = slice(out[-1].start, max(out[-1].stop, s.stop))
    else:
      out.append(s)
  return out


def write(kind: Kind, value: np.ndarray) -> np.ndarray:
  """Our whole parameter in the Hugging Face tensor's layout."""
  if kind is Kind.SAME:
    return value
  if kind is Kind.T:
    return np.ascontiguousarray(value.T)
  if kind is Kind.IN_HEADS:
    return np.ascontiguousarray(value.reshape(value.shape[0], -1).T)
  if kind is Kind.HEADS_OUT:
    return np.ascontiguousarray(value.reshape(-1, value.shape[2]).T)
  return value.reshape(-1)
