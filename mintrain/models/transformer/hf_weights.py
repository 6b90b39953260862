"""Hugging Face tensors <-> the transformer family's parameters: names, and each one's reshaping.

Weights: `transformers` stores a projection as (out, in); mintrain stores (in, heads, head_dim) and
(heads, head_dim, out). Each mintrain parameter maps to one tensor by one `Kind` of reshaping, which also
maps any rectangular slice of it to one rectangular slice of the tensor, read block by block (`read`).
A mixture's experts (E, ...) are E tensors, one per expert (transformers 5 fuses them in memory but
saves them so): their names are a tuple, and each expert's slice is read from its own tensor.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mintrain.models.transformer.hf_config import hf_model_type
from mintrain.runtime import host_allocator

# A multimodal checkpoint's text model tensors: {their prefix: the text model's}, in either layout.
TEXT_PREFIXES = {'language_model.model.': 'model.', 'language_model.lm_head.': 'lm_head.',
                 'model.language_model.': 'model.'}


class Kind(enum.Enum):
  SAME = 'same'  # Same layout (embeddings, norm scales).
  T = 'transpose'  # ours (in, out) = theirs (out, in).T
  IN_HEADS = 'in_heads'  # ours (D, N, K) = theirs (N*K, D).T, reshaped.
  HEADS_OUT = 'heads_out'  # ours (N, K, D) = theirs (D, N*K).T, reshaped.
  HEADS = 'heads'  # ours (N, K) = theirs (N*K,), reshaped.



def text_tensors(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
  """(`tensors` by the names `weight_names` gives, a line saying what was left out or None): a multimodal
  checkpoint's text model under its own names, without the vision tower and projector."""
  if not any(name.startswith(tuple(TEXT_PREFIXES)) for name in tensors):
    return dict(tensors), None
  text, other = {}, []
  for name, tensor in tensors.items():
    prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
    if prefix is None:
      other.append(name)
    else:
      text[TEXT_PREFIXES[prefix] + name[len(prefix):]] = tensor
  return text, (f'{len(other)} tensors of the vision tower and projector are left out: mintrain reads the '
                'text model of this multimodal checkpoint.' if other else None)


def weight_names(cfg: Any) -> dict[str, tuple[str | tuple[str, ...], Kind] | None]:
  """{mintrain parameter path (unscanned layers): (Hugging Face tensor name, Kind)}; a parameter stacked
  from several tensors on its first axis (a mixture's experts) has a tuple of names. The multi-token
  prediction layers (training only) map to None: export leaves them out, as transformers drops them."""
  names: dict[str, Any] = {'embedding_VD': ('model.embed_tokens.weight', Kind.SAME),
                           'final_norm.scale': ('model.norm.weight', Kind.SAME)}
  if not cfg.tie_embeddings:
    names['unembed_DV'] = ('lm_head.weight', Kind.T)
  for i in range(cfg.num_layers):
    names |= _layer_names(cfg, f'blocks.{i}', f'model.layers.{i}', cfg.is_moe(i))
  for j in range(cfg.mtp_layers):
    ours = f'mtp.{j}'
    block = _layer_names(cfg, f'{ours}.block', f'model.layers.{cfg.num_layers + j}', cfg.num_experts > 0)
    names |= dict.fromkeys([*block, f'{ours}.join_CD',
                            *(f'{ours}.{n}_norm.scale' for n in ('hidden', 'embed', 'out'))])
  return names


def _layer_names(cfg: Any, ours: str, theirs: str, moe: bool) -> dict[str, Any]:
  """One block's parameters."""
  names = {
      f'{ours}.attn_norm.scale': (f'{theirs}.input_layernorm.weight', Kind.SAME),
      f'{ours}.mlp_norm.scale': (f'{theirs}.{"pre_feedforward" if cfg.post_norms else "post_attention"}'
                                 '_layernorm.weight', Kind.SAME),
      f'{ours}.attn.wo_HKD': (f'{theirs}.self_attn.o_proj.weight', Kind.HEADS_OUT),
  }
  names |= _mla_names(cfg, ours, theirs) if cfg.mla else {
      f'{ours}.attn.wq_DHK': (f'{theirs}.self_attn.q_proj.weight', Kind.IN_HEADS),
      f'{ours}.attn.wk_DHK': (f'{theirs}.self_attn.k_proj.weight', Kind.IN_HEADS),
      f'{ours}.attn.wv_DHK': (f'{theirs}.self_attn.v_proj.weight', Kind.IN_HEADS),
  }
  names |= _moe_names(cfg, ours, theirs) if moe else {
      f'{ours}.mlp.wi_gate_DF': (f'{theirs}.mlp.gate_proj.weight', Kind.T),
      f'{ours}.mlp.wi_up_DF': (f'{theirs}.mlp.up_proj.weight', Kind.T),
      f'{ours}.mlp.wo_FD': (f'{theirs}.mlp.down_proj.weight', Kind.T),
  }
  if cfg.post_norms:
    names |= {f'{ours}.attn_post_norm.scale': (f'{theirs}.post_attention_layernorm.weight', Kind.SAME),
              f'{ours}.mlp_post_norm.scale': (f'{theirs}.post_feedforward_layernorm.weight', Kind.SAME)}
  if cfg.qk_norm:
    names |= {f'{ours}.attn.q_norm_K': (f'{theirs}.self_attn.q_norm.weight', Kind.SAME),
              f'{ours}.attn.k_norm_K': (f'{theirs}.self_attn.k_norm.weight', Kind.SAME)}
  if cfg.qkv_bias:
    names |= {f'{ours}.attn.bq_HK': (f'{theirs}.self_attn.q_proj.bias', Kind.HEADS),
              f'{ours}.attn.bk_GK': (f'{theirs}.self_attn.k_proj.bias', Kind.HEADS),
              f'{ours}.attn.bv_GK': (f'{theirs}.self_attn.v_proj.bias', Kind.HEADS)}
  return names


def _mla_names(cfg: Any, ours: str, theirs: str) -> dict[str, tuple[str, Kind]]:
  """One latent attention's projections and norms (DeepSeek-V3)."""
  attn = f'{theirs}.self_attn'
  names = {f'{ours}.attn.wkv_a_DC': (f'{attn}.kv_a_proj_with_mqa.weight', Kind.T),
           f'{ours}.attn.kv_norm_R': (f'{attn}.kv_a_layernorm.weight', Kind.SAME),
           f'{ours}.attn.wkv_b_RHK': (f'{attn}.kv_b_proj.weight', Kind.IN_HEADS)}
  if not cfg.q_lora_rank:
    return names | {f'{ours}.attn.wq_DHK': (f'{attn}.q_proj.weight', Kind.IN_HEADS)}
  return names | {f'{ours}.attn.wq_a_DQ': (f'{attn}.q_a_proj.weight', Kind.T),
                  f'{ours}.attn.q_norm_Q': (f'{attn}.q_a_layernorm.weight', Kind.SAME),
                  f'{ours}.attn.wq_b_QHK': (f'{attn}.q_b_proj.weight', Kind.IN_HEADS)}


def _moe_names(cfg: Any, ours: str, theirs: str) -> dict[str, tuple[str | tuple[str, ...], Kind]]:
  """One MoE layer's router and experts (and Qwen2-MoE's shared expert and its gate)."""
  experts = range(cfg.num_experts)
  if hf_model_type(cfg) == 'mixtral':
    moe = f'{theirs}.block_sparse_moe'
    return {f'{ours}.mlp.router_DE': (f'{moe}.gate.weight', Kind.T),
            f'{ours}.mlp.wi_gate_EDF': (tuple(f'{moe}.experts.{e}.w1.weight' for e in experts), Kind.T),
            f'{ours}.mlp.wi_up_EDF': (tuple(f'{moe}.experts.{e}.w3.weight' for e in experts), Kind.T),
            f'{ours}.mlp.wo_EFD': (tuple(f'{moe}.experts.{e}.w2.weight' for e in experts), Kind.T)}
  moe = f'{theirs}.mlp'
  names = {f'{ours}.mlp.router_DE': (f'{moe}.gate.weight', Kind.T)}
  if cfg.router_score == 'sigmoid':
    names[f'{ours}.mlp.router_bias_E'] = (f'{moe}.gate.e_score_correction_bias', Kind.SAME)
  if cfg.shared_expert_dim and not cfg.shared_expert_gate:  # DeepSeek's.
    names |= {f'{ours}.mlp.shared_wi_gate_DF': (f'{moe}.shared_experts.gate_proj.weight', Kind.T),
              f'{ours}.mlp.shared_wi_up_DF': (f'{moe}.shared_experts.up_proj.weight', Kind.T),
              f'{ours}.mlp.shared_wo_FD': (f'{moe}.shared_experts.down_proj.weight', Kind.T)}
  elif cfg.shared_expert_dim:
    names |= {f'{ours}.mlp.shared_gate_D1': (f'{moe}.shared_expert_gate.weight', Kind.T),
              f'{ours}.mlp.shared_wi_gate_DF': (f'{moe}.shared_expert.gate_proj.weight', Kind.T),
              f'{ours}.mlp.shared_wi_up_DF': (f'{moe}.shared_expert.up_proj.weight', Kind.T),
              f'{ours}.mlp.shared_wo_FD': (f'{moe}.shared_expert.down_proj.weight', Kind.T)}
  for path, proj in (('wi_gate_EDF', 'gate_proj'), ('wi_up_EDF', 'up_proj'), ('wo_EFD', 'down_proj')):
    names[f'{ours}.mlp.{path}'] = (tuple(f'{moe}.experts.{e}.{proj}.weight' for e in experts), Kind.T)
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
  start `offset` rows into it. Transposes (of whole heads) go through `copy_transposed`."""
  k, n = head_dim, len(rows)
  if kind is Kind.SAME:
    out[offset:offset + n] = rows
  elif kind is Kind.T:
    host_allocator.copy_transposed(out[:, offset:offset + n], rows)
  elif kind is Kind.IN_HEADS and index[2] == slice(0, k):  # (heads x K, D) rows to (D, heads, K).
    host_allocator.copy_transposed(_merged_view(out[:, offset // k:(offset + n) // k], 1), rows)
  elif kind is Kind.IN_HEADS:  # Rows of whole heads: (heads, K, D), our head dims picked, to (D, heads, K).
    out[:, offset // k:(offset + n) // k] = rows.reshape(n // k, k, -1)[:, index[2]].transpose(2, 0, 1)
  elif kind is Kind.HEADS_OUT and index[1] == slice(0, k):  # (D, N x K) rows to (N, K, D).
    host_allocator.copy_transposed(_merged_view(out[:, :, offset:offset + n], 0), rows)
  elif kind is Kind.HEADS_OUT:  # Rows of D: to (N, K, D), our head dims picked.
    out[:, :, offset:offset + n] = rows.T.reshape(out.shape[0], k, n)[:, index[1]]
  else:
    out[offset // k:(offset + n) // k] = rows.reshape(n // k, k)[:, index[1]]


def _merged_view(x: np.ndarray, axis: int) -> np.ndarray:
  """`x` with axes `axis` and `axis + 1` as one, as a view (setting `shape` raises rather than copy)."""
  view = x.view()
  view.shape = (*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])
  return view


def read(kind: Kind, tensor: Any, targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
         shape: tuple[int, ...]) -> None:
  """Fills each target's array with our parameter's slice `index` (slices with explicit bounds) of
  `targets` [(index, array)], read from `tensor` (`safetensors_reader.Tensor`) in one pass over the rows
  that any of them needs, a block at a time: the devices of a process share each read, and nothing but
  the targets is slice-sized. Rows of heads are read whole heads at a time. `shape` is our whole
  parameter's, whose head size (latent attention's differ by projection) says how rows form heads."""
  head_dim = shape[1] if kind is Kind.HEADS_OUT else shape[-1]
  wanted = [(their_index(kind, index, head_dim), index, out) for index, out in targets]
  if kind is Kind.SAME:  # Slices of whole rows are read straight into their (contiguous) arrays.
    whole = [w for w in wanted if w[2].flags.c_contiguous
             and all(s == slice(0, n) for s, n in zip(w[0][1:], tensor.shape[1:]))]
    for (rows, *_), _, out in whole:
      tensor.read_rows(rows.start, out)
    wanted = [w for w in wanted if not any(w is v for v in whole)]
    if not wanted:
      return
  columns = ()
  if len(tensor.shape) == 2:
    columns = (slice(min(w[0][1].start for w in wanted), max(w[0][1].stop for w in wanted)),)
  multiple = head_dim if kind in (Kind.IN_HEADS, Kind.HEADS) else 1
  for rows in _merged(sorted(w[0][0] for w in wanted)):
    for start, block in tensor.row_blocks((rows, *columns), rows_multiple=multiple):
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
