"""Decoder-only transformer LM: pre-norm blocks of causal attention (RoPE) and gated MLP.

Shape letters: B batch, L length (M for keys), S cache length, D embed, F mlp,
H heads, G key/value heads, K head dim, V vocab. Heads and the MLP hidden dimension
are split over the `model`-style mesh axis by the rules; the model itself only names
logical axes.

Grouped-query attention (`num_kv_heads` = G < H; 1 is multi-query): G heads of keys
and values, each shared by H/G query heads (head h reads group h // (H/G), as
`transformers`' `repeat_kv`). Their logical axis is `kv_heads`; when the mesh splits
it more ways than G divides, they are replicated instead (`for_mesh`, reported by
`notes`). The KV cache in sampling holds G heads.

`__call__` is the training forward pass. `decode` is the same computation for
sampling: it appends the keys and values of new tokens to a per-layer cache and
attends over it, so each new token costs one step instead of a re-run of the prefix.

Packed rows (`mintrain.data.pipeline`) hold several documents. Their `segment_ids_BL` (which
document of the row each token is in; 0 is padding) and `positions_BL` (its position in that
document) make each document's tokens attend only to earlier tokens of the same document, rotated
for their own positions, so a document's predictions are those it would get alone; `loss` counts
only the targets its batch's `target_weights` count. Without them a row is one sequence. What a
query sees is a function of positions and segment ids (`context_attention.visible`), not of where
tokens are stored, so packed rows split over `context` too: gathered keys bring their positions and
segment ids along, and the ring's zigzag reorders them with the tokens and passes them with the keys.

Performance options (`TransformerConfig`), each computing the same function as the default:
  remat        recompute each block's activations in the backward pass instead of keeping them.
  scan_layers  parameters stacked on a leading `layers` axis and the blocks run by one `scan`,
               so compile time does not grow with depth; sampling slices the stack per layer.
  attention    'dot_product' uses `jax.nn.dot_product_attention` in training (cuDNN flash attention
               on an NVIDIA GPU in bfloat16/float16, XLA elsewhere: `attention_kernel`).
  mlp_overlap  the MLP's tensor-parallel communication overlapped with its matmuls
               (`collective_matmul`).
  context_attention
               with `length` split over devices (`mesh.context`): 'all_gather' gathers keys and values
               before attention; 'ring' passes them round the devices overlapped with blockwise
               attention, the sequence stored in zigzag order (`context_attention`). The ring computes
               attention itself, whatever `attention` says.
  loss_chunks  the output layer and the loss fused (`mintrain.models.loss.fused_cross_entropy`), over that
               many sequence chunks; 0 computes the logits, then the loss; -1 (auto) fuses on CPU only.
  linear       'custom_vjp' forms weight gradients with the smaller operand transposed (`layers.linear`);
               'einsum' leaves them to autodiff; 'auto' takes the custom VJP on CPU only.

Mixture of experts (`num_experts` > 0): every `moe_every`-th block's MLP is an `moe.MoE` layer of that many
experts, `experts_per_token` of them per token, split over the `expert` mesh axis; the others stay dense.
`loss`'s statistics then hold `aux_loss` (the router's weighted balancing and z-losses, which the train
step adds to the objective) and the routing statistics, averaged over the MoE layers; padding (segment 0)
takes no expert's slot and counts in none of them.

`FAMILY` is what the rest of mintrain knows of this model (`mintrain.models.family`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mintrain.data import synthetic, tokenizer
from mintrain.errors import ConfigError
from mintrain.fields import option
from mintrain.models.family import Family, Ways
from mintrain.models.layers import (
  LINEAR_OPTIONS,
  MATMUL,
  RMSNorm,
  dropout,
  gather,
  linear,
  linear_for_platform,
  param,
  split_layers,
  stack_layers,
)
from mintrain.models.loss import cross_entropy, fused_cross_entropy
from mintrain.models.transformer import collective_matmul, moe
from mintrain.models.transformer import hf as hf_llama
from mintrain.models.transformer.context_attention import ring_attention, visible, zigzag_order
from mintrain.partitioning import AxisRules

BLD = ('batch', 'length', 'embed')
BLHK = ('batch', 'length', 'heads', 'kv')

# Per layer, (keys_BSHK, values_BSHK) of every position written so far (zeros beyond).
KVCache = list[tuple[jax.Array, jax.Array]]

# What a rematerialised block keeps for the backward pass; the rest is recomputed there.
# 'full' keeps only the block's inputs. 'save_matmuls' also keeps the outputs of the matmuls
# against weights (dots without batch dimensions: q/k/v, output projection, gate, up, down) and
# recomputes the cheap elementwise work and the attention scores and probabilities, whose
# (length x length) size makes them the largest activations.
REMAT_POLICIES = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'save_matmuls': jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # The ring MLP's (mlp_overlap).
        jax.checkpoint_policies.save_only_these_names(MATMUL)),  # `linear`'s, whose dots remat cannot see.
}
REMAT_OPTIONS = ('none', *REMAT_POLICIES)
ATTENTION_OPTIONS = ('einsum', 'dot_product')
CONTEXT_ATTENTION_OPTIONS = ('all_gather', 'ring')
DTYPES = ('float32', 'bfloat16')
# The gate's nonlinearity: SwiGLU (Llama, Mistral, Qwen2) or GeGLU with tanh-approximated GELU (Gemma).
ACTIVATIONS = {'silu': jax.nn.silu, 'gelu_tanh': functools.partial(jax.nn.gelu, approximate=True)}
ROPE_SCALINGS = ('none', 'llama3')


def attention_kernel(platform: str, dtype: jnp.dtype, head_dim: int) -> str:
  """`jax.nn.dot_product_attention`'s implementation: cuDNN's flash attention on an NVIDIA GPU for the
  16-bit dtypes and head sizes it takes, XLA's formulation elsewhere. (Its own default, None, is
  always XLA in jax 0.10.)"""
  cudnn_ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
  return 'cudnn' if platform in ('gpu', 'cuda') and cudnn_ok else 'xla'


def _even(value: int) -> str | None:
  return None if value % 2 == 0 else 'must be even for rotary embeddings'


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """The `model` section of a transformer run; mintrain/configs/base.py has the defaults and their meaning."""

  vocab_size: int = option(at_least=0)  # 0 until `for_tokenizer` sets it.
  embed_dim: int = option(at_least=1)
  num_layers: int = option(at_least=1)
  num_heads: int = option(at_least=1)
  num_kv_heads: int = option(at_least=0)  # G; 0: as many as num_heads (multi-head attention).
  head_dim: int = option(at_least=2, check=_even)
  mlp_dim: int = option(at_least=1)
  tie_embeddings: bool = option()
  rope_base: float = option(above=0)
  # Llama 3.1's frequency scaling of RoPE ('llama3'), with its four parameters; 'none' leaves it out.
  rope_scaling: str = option(choices=ROPE_SCALINGS)
  rope_scaling_factor: float = option(above=0)
  rope_low_freq_factor: float = option(above=0)
  rope_high_freq_factor: float = option(above=0)
  rope_original_max_len: int = option(at_least=1)
  norm_eps: float = option(above=0)  # RMSNorm's epsilon.
  norm_plus_one: bool = option()  # Gemma: norms scale by (1 + weight), weights drawn as zeros.
  embed_scale: bool = option()  # Gemma: embeddings times sqrt(embed_dim) (not the tied output layer).
  qkv_bias: bool = option()  # Qwen2: biases on the query, key and value projections.
  # Mistral: each position attends over the last `sliding_window` only. Not applied: a longer sequence is
  # refused (`check_window`), so attention is always the same as the checkpoint's model's; 0: no window.
  sliding_window: int = option(at_least=0)
  mlp_activation: str = option(choices=tuple(ACTIVATIONS))
  dropout_rate: float = option(at_least=0, below=1)
  param_dtype: str = option(choices=DTYPES)
  compute_dtype: str = option(choices=DTYPES)
  remat: str = option(choices=REMAT_OPTIONS)
  scan_layers: bool = option()
  attention: str = option(choices=ATTENTION_OPTIONS)
  context_attention: str = option(choices=CONTEXT_ATTENTION_OPTIONS)
  mlp_overlap: bool = option()
  loss_chunks: int = option(at_least=-1)  # -1: auto; 0: logits, then loss; N: fused over N chunks.
  linear: str = option(choices=LINEAR_OPTIONS)  # How weight matmuls form their gradient.
  num_experts: int = option(at_least=0)  # E experts in each MoE layer; 0: every MLP dense.
  experts_per_token: int = option(at_least=1)  # k: experts each token is routed to.
  moe_every: int = option(at_least=1)  # Block i is MoE when (i + 1) % N == 0 (Qwen2-MoE's sparse step).
  expert_mlp_dim: int = option(at_least=0)  # F of each expert; 0: mlp_dim.
  shared_expert_dim: int = option(at_least=0)  # Qwen2-MoE's sigmoid-gated shared expert's width; 0: none.
  capacity_factor: float = option(at_least=0)  # Slots per expert: factor * L * k / E; 0: dropless.
  router_norm_topk: bool = option()  # Renormalise the top-k probabilities to sum to 1 (Mixtral).
  router_z_loss_weight: float = option(at_least=0)  # Of mean(logsumexp(router logits)^2) in the objective.
  load_balance_loss_weight: float = option(at_least=0)  # Of E * sum_e f_e * p_e in the objective.
  platform: str = option(derived=True, default='cpu')  # Of the mesh's devices; picks kernels.
  # The logical axis of the key/value heads: `heads` when they are the query heads (multi-head),
  # `kv_heads` when grouped, None when grouped but too few for the mesh's split (replicated).
  kv_heads_axis: str | None = option(derived=True, default='heads')
  kv_heads_ways: int = option(derived=True, default=1)  # How many ways the rules would split them.
  length_ways: int = option(derived=True, default=1)  # How many ways the rules split `length` (context).

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def grouped(self) -> bool:
    return self.kv_heads != self.num_heads

  @property
  def expert_dim(self) -> int:
    return self.expert_mlp_dim or self.mlp_dim

  def is_moe(self, layer: int) -> bool:
    return self.num_experts > 0 and (layer + 1) % self.moe_every == 0

  @property
  def moe_layers(self) -> int:
    return sum(self.is_moe(i) for i in range(self.num_layers))


def for_tokenizer(cfg: TransformerConfig, num_ids: Callable[[], int]) -> TransformerConfig:
  """model.vocab_size=0 takes the tokenizer's ids, padded to a multiple of 128 so `vocab` splits."""
  if cfg.vocab_size:
    return cfg
  return dataclasses.replace(cfg, vocab_size=tokenizer.padded_vocab_size(num_ids()))


def check(cfg: TransformerConfig, seq_len: int) -> None:
  if cfg.rope_scaling == 'llama3' and cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
    raise ConfigError(f'model.rope_high_freq_factor={cfg.rope_high_freq_factor} must be above '
                      f'model.rope_low_freq_factor={cfg.rope_low_freq_factor} (Llama 3 RoPE scaling).')
  if cfg.num_heads % cfg.kv_heads:
    raise ConfigError(f'model.num_kv_heads={cfg.num_kv_heads} must divide model.num_heads={cfg.num_heads} '
                      '(each key/value head serves the same number of query heads), or be 0 (as many as '
                      'num_heads).')
  check_window(cfg, seq_len, f'train.seq_len={seq_len}')
  ways = cfg.length_ways
  if cfg.context_attention == 'ring' and ways > 1 and seq_len % (2 * ways):
    raise ConfigError(f'model.context_attention=ring splits train.seq_len={seq_len} into 2 x {ways} chunks '
                      f'(two per device of the {ways}-way `length` split, for causal balance); use a '
                      f'multiple of {2 * ways}, or model.context_attention=all_gather.')
  if cfg.num_experts and cfg.experts_per_token > cfg.num_experts:
    raise ConfigError(f'model.experts_per_token={cfg.experts_per_token} must be at most model.num_experts='
                      f'{cfg.num_experts}.')
  if cfg.num_experts and cfg.scan_layers and cfg.moe_every != 1:
    raise ConfigError(f'model.scan_layers needs identical blocks; with model.moe_every={cfg.moe_every} some '
                      'are dense and some MoE. Set model.moe_every=1 or model.scan_layers=False.')
  if cfg.num_experts and cfg.mlp_overlap:
    raise ConfigError('model.mlp_overlap is for dense MLPs; set it False with model.num_experts > 0.')
  if cfg.loss_chunks > 0 and seq_len % cfg.loss_chunks:
    raise ConfigError(f'model.loss_chunks={cfg.loss_chunks} must be 0 (logits, then the loss), a positive '
                      f'divisor of train.seq_len={seq_len} (the fused loss over that many chunks), '
                      'or -1 (auto).')
  chunk = seq_len // cfg.loss_chunks if cfg.loss_chunks > 0 else ways
  if chunk % ways:
    raise ConfigError(f'model.loss_chunks={cfg.loss_chunks} leaves chunks of {chunk} tokens, which the '
                      f'{ways}-way `length` split (mesh.context) does not divide; use fewer chunks.')


def check_window(cfg: TransformerConfig, length: int, what: str) -> None:
  """A ConfigError when sequences of `length` positions (`what`) outrun the model's sliding window."""
  if cfg.sliding_window and length > cfg.sliding_window:
    raise ConfigError(f'{what} is longer than model.sliding_window={cfg.sliding_window}: the model attends '
                      'over that many positions only, a window mintrain does not apply; use sequences of at '
                      f'most {cfg.sliding_window} positions (train.seq_len <= {cfg.sliding_window}).')


def for_mesh(cfg: TransformerConfig, platform: str, ways: Ways) -> TransformerConfig:
  """Options left to 'auto' set for the platform: the fused loss and `linear`'s custom VJP were measured
  to help on CPU only (BENCHMARKS.md), so elsewhere they stay off until measured there. Grouped key/value
  heads that the rules' split of `kv_heads` does not divide are replicated."""
  chunks = cfg.loss_chunks if cfg.loss_chunks >= 0 else (1 if platform == 'cpu' else 0)
  kv_axis, kv_ways = 'heads', 1
  if cfg.grouped:
    kv_ways = ways('kv_heads')
    kv_axis = 'kv_heads' if cfg.kv_heads % kv_ways == 0 else None
  return dataclasses.replace(cfg, platform=platform, loss_chunks=chunks,
                             linear=linear_for_platform(cfg.linear, platform), kv_heads_axis=kv_axis,
                             kv_heads_ways=kv_ways, length_ways=ways('length'))


def notes(cfg: TransformerConfig) -> list[str]:
  if cfg.grouped and cfg.kv_heads_axis is None:
    return [f'model.num_kv_heads={cfg.kv_heads} key/value heads do not split {cfg.kv_heads_ways} ways '
            '(the rules for `kv_heads`); they are replicated on every device of that split.']
  return []


def rope_frequencies(cfg: TransformerConfig) -> jax.Array:
  """float32 (K/2,) inverse frequencies; with 'llama3' scaling, Llama 3.1's: wavelengths beyond the
  original context's / low_freq_factor slowed by `factor`, those below / high_freq_factor kept, and a
  smooth blend between (transformers' `_compute_llama3_parameters`)."""
  half = cfg.head_dim // 2
  if cfg.rope_scaling == 'none':
    return cfg.rope_base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  inv_freq = 1.0 / cfg.rope_base ** (np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
  factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old_len = cfg.rope_original_max_len
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.asarray(np.where(medium, blended, scaled), jnp.float32)


def rope(x_BLHK: jax.Array, inv_freq_K: jax.Array, positions_BL: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding on the last dimension (split-half convention, as `transformers`).

  `positions_BL` ((B or 1, L)) are the tokens' positions (default 0..L-1): a decode step passes its
  offset, so a token is rotated the same as in training; packed rows pass each document's own.
  """
  _, seq_len, _, head_dim = x_BLHK.shape
  half = head_dim // 2
  if positions_BL is None:
    positions_BL = jnp.arange(seq_len)[None, :]
  angle_BLK = positions_BL.astype(jnp.float32)[:, :, None] * inv_freq_K[None, None, :]
  sin, cos = jnp.sin(angle_BLK)[:, :, None, :], jnp.cos(angle_BLK)[:, :, None, :]
  x = x_BLHK.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


def same_segment(segment_ids_BL: jax.Array, k_segment_ids_BM: jax.Array) -> jax.Array:
  """bool (B, 1, L, M): whether query l and key m are in the same document of their row (heads broadcast)."""
  return (segment_ids_BL[:, :, None] == k_segment_ids_BM[:, None, :])[:, None]


def kv_layout(cfg: TransformerConfig) -> tuple[str | None, ...]:
  """Logical axes of keys and values (BLGK), also those of the KV cache."""
  return ('batch', 'length', cfg.kv_heads_axis, 'kv')


class Attention(nnx.Module):
  """Causal self-attention, multi-head or grouped-query; heads are the tensor-parallel dimension."""

  def __init__(self, cfg: TransformerConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    d, h, g, k = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    dtype = jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=0, out_axis=(1, 2))
    out_init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=(0, 1), out_axis=2)
    kv_axes = ('embed', cfg.kv_heads_axis, 'kv')
    if cfg.qkv_bias:
      zeros = nnx.initializers.zeros
      self.bq_HK = param(rngs, zeros, (h, k), ('heads', 'kv'), dtype, rules, decay=False)
      self.bk_GK = param(rngs, zeros, (g, k), kv_axes[1:], dtype, rules, decay=False)
      self.bv_GK = param(rngs, zeros, (g, k), kv_axes[1:], dtype, rules, decay=False)
    self.wq_DHK = param(rngs, init, (d, h, k), ('embed', 'heads', 'kv'), dtype, rules)
    # (D, G, K): the names of the multi-head case (G = H), which keep older checkpoints' paths.
    self.wk_DHK = param(rngs, init, (d, g, k), kv_axes, dtype, rules)
    self.wv_DHK = param(rngs, init, (d, g, k), kv_axes, dtype, rules)
    self.wo_HKD = param(rngs, out_init, (h, k, d), ('heads', 'kv', 'embed'), dtype, rules)
    self.cfg, self.rules = cfg, rules

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array,
               segment_ids_BL: jax.Array | None = None) -> jax.Array:
    """Causal attention by the tokens' positions (`positions_BL`, (B or 1, L): where each stored token
    sits, in order except for the ring's zigzag); with `segment_ids_BL`, only within each token's document."""
    cfg = self.cfg
    q_BLHK, k_BMGK, v_BMGK = self._qkv(x_BLD, positions_BL)
    k_BMHK, v_BMHK = self._repeat_kv(k_BMGK), self._repeat_kv(v_BMGK)
    if cfg.context_attention == 'ring' and cfg.length_ways > 1:
      return self._project(ring_attention(q_BLHK, k_BMHK, v_BMHK, positions_BL, segment_ids_BL,
                                         spec=self.rules.activation_spec(BLHK, q_BLHK.shape),
                                         scale=cfg.head_dim ** -0.5))
    # The keys' positions and segments, whole like the keys themselves (`_gather_length`).
    k_positions_BM = self._gather_length(q_BLHK, positions_BL)
    k_segment_ids_BM = None if segment_ids_BL is None else self._gather_length(q_BLHK, segment_ids_BL)
    if cfg.attention == 'dot_product':  # Only ever in natural order (the ring takes the zigzag).
      k_BMHK, v_BMHK = self._gather_length(q_BLHK, k_BMHK), self._gather_length(q_BLHK, v_BMHK)
      same_B1LM = None if segment_ids_BL is None else same_segment(segment_ids_BL, k_segment_ids_BM)
      # On cuDNN the mask becomes an additive bias, which its flash attention takes.
      implementation = attention_kernel(cfg.platform, q_BLHK.dtype, cfg.head_dim)
      out_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BMHK, v_BMHK, mask=same_B1LM, is_causal=True,
                                              scale=cfg.head_dim ** -0.5, implementation=implementation)
      return self._project(out_BLHK)
    visible_BLM = visible(positions_BL, k_positions_BM, segment_ids_BL, k_segment_ids_BM)
    return self._attend(q_BLHK, k_BMHK, v_BMHK, visible_BLM[:, None])

  def decode(self, x_BLD: jax.Array, kv: tuple[jax.Array, jax.Array],
             start: jax.Array | int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Attention of L new tokens at positions start.. over the cache, which they are written into first."""
    rules = self.rules
    positions_L = start + jnp.arange(x_BLD.shape[1])
    q_BLHK, k_BLGK, v_BLGK = self._qkv(x_BLD, positions_L[None, :])
    keys_BSGK, values_BSGK = (rules.reshard(self._write(cache, new, start), kv_layout(self.cfg))
                              for cache, new in zip(kv, (k_BLGK, v_BLGK)))
    # Causal over absolute positions; the unwritten (zero) slots beyond are never visible.
    visible_LS = visible(positions_L, jnp.arange(keys_BSGK.shape[1]))
    out_BLD = self._attend(q_BLHK, self._repeat_kv(keys_BSGK), self._repeat_kv(values_BSGK), visible_LS)
    return out_BLD, (keys_BSGK, values_BSGK)

  def _write(self, cache_BSGK: jax.Array, new_BLGK: jax.Array, start: jax.Array | int) -> jax.Array:
    """The cache with the new keys (or values) at slots start..start+L-1. A single token cannot split
    like a cache whose length is split (`mesh.context`): it is written by a select over the slots."""
    new_BLGK = new_BLGK.astype(cache_BSGK.dtype)
    if new_BLGK.shape[1] == 1 and self.cfg.length_ways > 1:
      slot_S = jnp.arange(cache_BSGK.shape[1]) == start
      return jnp.where(slot_S[None, :, None, None], new_BLGK, cache_BSGK)
    new_BLGK = jax.sharding.reshard(new_BLGK, jax.typeof(cache_BSGK).sharding.spec)
    return jax.lax.dynamic_update_slice(cache_BSGK, new_BLGK, (0, start, 0, 0))

  def _gather_length(self, q_BLHK: jax.Array, x_BM: jax.Array) -> jax.Array:
    """Keys or values (BMHK), or their positions or segment ids (BM), whole along their length (an
    all-gather over `context`) when the queries' length is split: each device's queries may see any key.
    Otherwise (one decode token) they stay split, and attention reduces over their split instead."""
    if self.rules.activation_spec(('batch', 'length'), q_BLHK.shape[:2])[1] is None:
      return x_BM
    return self.rules.reshard(x_BM, ('batch', None, 'heads', 'kv')[:x_BM.ndim])

  def _qkv(self, x_BLD: jax.Array, positions_BL: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries (BLHK) and keys (BLGK) rotated for their positions, and values (BLGK)."""
    cfg, rules, dtype = self.cfg, self.rules, x_BLD.dtype
    custom_vjp = cfg.linear == 'custom_vjp'
    if not cfg.grouped:  # C: query, key, value in one matmul.
      w_DCHK = jnp.stack([gather(w, rules, dtype) for w in (self.wq_DHK, self.wk_DHK, self.wv_DHK)], axis=1)
      qkv_BLCHK = linear('BLD,DCHK->BLCHK', x_BLD, w_DCHK, custom_vjp=custom_vjp)
      q_BLHK, k_BLGK, v_BLGK = qkv_BLCHK[:, :, 0], qkv_BLCHK[:, :, 1], qkv_BLCHK[:, :, 2]
    else:  # Queries, then C: key and value in one matmul.
      q_BLHK = linear('BLD,DHK->BLHK', x_BLD, gather(self.wq_DHK, rules, dtype), custom_vjp=custom_vjp)
      w_DCGK = jnp.stack([gather(w, rules, dtype) for w in (self.wk_DHK, self.wv_DHK)], axis=1)
      kv_BLCGK = linear('BLD,DCGK->BLCGK', x_BLD, w_DCGK, custom_vjp=custom_vjp)
      k_BLGK, v_BLGK = kv_BLCGK[:, :, 0], kv_BLCGK[:, :, 1]
    layout = kv_layout(cfg)
    if cfg.qkv_bias:
      q_BLHK = q_BLHK + gather(self.bq_HK, rules, dtype)
      k_BLGK = k_BLGK + gather(self.bk_GK, rules, dtype)
      v_BLGK = v_BLGK + gather(self.bv_GK, rules, dtype)
    inv_freq_K = rope_frequencies(cfg)
    q_BLHK = rules.reshard(rope(q_BLHK, inv_freq_K, positions_BL), BLHK)
    k_BLGK = rules.reshard(rope(k_BLGK, inv_freq_K, positions_BL), layout)
    return q_BLHK, k_BLGK, rules.reshard(v_BLGK, layout)

  def _repeat_kv(self, x_BMGK: jax.Array) -> jax.Array:
    """Each key/value head once per query head it serves (head h reads group h // (H/G)), in BLHK."""
    if not self.cfg.grouped:
      return x_BMGK
    b, m, g, k = x_BMGK.shape
    r = self.cfg.num_heads // g
    # A new minor axis, merged into G: a split G stays split, and each device keeps its own groups' heads.
    x_BMGRK = jnp.broadcast_to(x_BMGK[:, :, :, None, :], (b, m, g, r, k))
    return self.rules.reshard(x_BMGRK.reshape(b, m, g * r, k), BLHK)

  def _attend(self, q_BLHK: jax.Array, k_BMHK: jax.Array, v_BMHK: jax.Array,
              visible_LM: jax.Array) -> jax.Array:
    """Softmax attention of each query over the keys it may see (`visible_LM`, (L, M) or per row
    (B or 1, 1, L, M)), then the output projection."""
    cfg, dtype = self.cfg, q_BLHK.dtype
    k_BMHK, v_BMHK = self._gather_length(q_BLHK, k_BMHK), self._gather_length(q_BLHK, v_BMHK)
    scores_BHLM = jnp.einsum('BLHK,BMHK->BHLM', q_BLHK, k_BMHK).astype(jnp.float32)
    scores_BHLM = scores_BHLM * cfg.head_dim ** -0.5
    scores_BHLM = jnp.where(visible_LM, scores_BHLM, jnp.finfo(jnp.float32).min)
    probs_BHLM = jax.nn.softmax(scores_BHLM, axis=-1).astype(dtype)
    # Stated, as a decode step's keys may be split: then this contraction sums over `context`.
    out_spec = self.rules.activation_spec(BLHK, q_BLHK.shape)
    return self._project(jnp.einsum('BHLM,BMHK->BLHK', probs_BHLM, v_BMHK, out_sharding=out_spec))

  def _project(self, out_BLHK: jax.Array) -> jax.Array:
    """The output projection of the heads' outputs back to the residual stream."""
    rules, dtype = self.rules, out_BLHK.dtype
    out_BLHK = rules.reshard(out_BLHK, BLHK)
    # Contracting the sharded heads needs an explicit output layout (a reduce over `model`).
    return linear('BLHK,HKD->BLD', out_BLHK, gather(self.wo_HKD, rules, dtype),
                  rules.activation_spec(BLD, out_BLHK.shape[:2]), custom_vjp=self.cfg.linear == 'custom_vjp')


class GatedMLP(nnx.Module):
  """SwiGLU MLP: column-parallel gate/up, row-parallel down (Megatron layout).

  With mlp_overlap, on a mesh that splits `mlp`, the same matmuls run as a ring of collective
  matmuls over the sequence (`collective_matmul`).
  """

  def __init__(self, cfg: TransformerConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    d, f, dtype = cfg.embed_dim, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.lecun_normal()
    self.wi_gate_DF = param(rngs, init, (d, f), ('embed', 'mlp'), dtype, rules)
    self.wi_up_DF = param(rngs, init, (d, f), ('embed', 'mlp'), dtype, rules)
    self.wo_FD = param(rngs, init, (f, d), ('mlp', 'embed'), dtype, rules)
    self.rules, self.overlap, self.custom_vjp = rules, cfg.mlp_overlap, cfg.linear == 'custom_vjp'
    self.activation = ACTIVATIONS[cfg.mlp_activation]

  def __call__(self, x_BLD: jax.Array, *, overlap: bool = True) -> jax.Array:
    """`overlap=False` forces the plain path (decode steps are too short to split into chunks)."""
    rules, dtype = self.rules, x_BLD.dtype
    w_gate_DF = gather(self.wi_gate_DF, rules, dtype)
    w_up_DF = gather(self.wi_up_DF, rules, dtype)
    w_down_FD = gather(self.wo_FD, rules, dtype)
    if overlap and self.overlap and collective_matmul.ring_axes(rules)[1] > 1:
      return rules.reshard(collective_matmul.gated_mlp(x_BLD, w_gate_DF, w_up_DF, w_down_FD, rules,
                                                       self.activation), BLD)
    # Gate and up as one matmul: one pass over x and a wider, faster product.
    w_DGF = jnp.stack([w_gate_DF, w_up_DF], axis=1)
    gate_up_BLGF = linear('BLD,DGF->BLGF', x_BLD, w_DGF, custom_vjp=self.custom_vjp)
    gate_BLF, up_BLF = gate_up_BLGF[:, :, 0], gate_up_BLGF[:, :, 1]
    h_BLF = rules.reshard(self.activation(gate_BLF) * up_BLF, ('batch', 'length', 'mlp'))
    return linear('BLF,FD->BLD', h_BLF, w_down_FD, rules.activation_spec(BLD, h_BLF.shape[:2]),
                  custom_vjp=self.custom_vjp)


def norm(cfg: TransformerConfig, rules: AxisRules, rngs: nnx.Rngs) -> RMSNorm:
  return RMSNorm(cfg.embed_dim, rules=rules, param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs,
                 eps=cfg.norm_eps, plus_one=cfg.norm_plus_one)


class Block(nnx.Module):
  """Attention, then a dense MLP or (`moe_layer`) a mixture of experts; `__call__` also returns the MoE
  layer's statistics ({} for a dense block)."""

  def __init__(self, cfg: TransformerConfig, *, rules: AxisRules, rngs: nnx.Rngs, moe_layer: bool = False):
    self.attn_norm = norm(cfg, rules, rngs)
    self.attn = Attention(cfg, rules=rules, rngs=rngs)
    self.mlp_norm = norm(cfg, rules, rngs)
    self.mlp = (moe.MoE(cfg, rules=rules, rngs=rngs, activation=ACTIVATIONS[cfg.mlp_activation]) if moe_layer
                else GatedMLP(cfg, rules=rules, rngs=rngs))
    self.rules, self.dropout_rate, self.moe_layer = rules, cfg.dropout_rate, moe_layer

  def __call__(self, x_BLD: jax.Array, key: jax.Array | None, positions_BL: jax.Array,
               segment_ids_BL: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    keys = jax.random.split(key) if key is not None else (None, None)
    attn_BLD = self.attn(self.attn_norm(x_BLD), positions_BL, segment_ids_BL)
    x_BLD = x_BLD + dropout(attn_BLD, self.dropout_rate, keys[0])
    h_BLD = self.mlp_norm(x_BLD)
    if self.moe_layer:  # Padding (segment 0) neither takes an expert's slot nor counts in the statistics.
      mlp_BLD, stats = self.mlp(h_BLD, tokens_BL=None if segment_ids_BL is None else segment_ids_BL > 0)
    else:
      mlp_BLD, stats = self.mlp(h_BLD), {}
    x_BLD = x_BLD + dropout(mlp_BLD, self.dropout_rate, keys[1])
    return self.rules.reshard(x_BLD, BLD), stats

  def decode(self, x_BLD: jax.Array, kv: tuple[jax.Array, jax.Array],
             start: jax.Array | int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The block without dropout, attending over (and updating) its layer's cache."""
    attn_BLD, kv = self.attn.decode(self.attn_norm(x_BLD), kv, start)
    x_BLD = x_BLD + attn_BLD
    if self.moe_layer:
      x_BLD = x_BLD + self.mlp(self.mlp_norm(x_BLD), dropless=True)[0]
    else:
      x_BLD = x_BLD + self.mlp(self.mlp_norm(x_BLD), overlap=False)
    return self.rules.reshard(x_BLD, BLD), kv


class Transformer(nnx.Module):
  """tokens_BL -> logits_BLV (float32)."""

  def __init__(self, cfg: TransformerConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    embed_init = nnx.initializers.normal(cfg.embed_dim ** -0.5)
    self.embedding_VD = param(rngs, embed_init, (cfg.vocab_size, cfg.embed_dim), ('vocab', 'embed'), dtype,
                              rules, decay=False)  # A lookup table: decay would pull rare tokens to zero.
    blocks = [Block(cfg, rules=rules, rngs=rngs, moe_layer=cfg.is_moe(i)) for i in range(cfg.num_layers)]
    # With scan_layers, one Block whose parameters are all layers' stacked on a leading `layers` axis.
    self.blocks = stack_layers(blocks, rules) if cfg.scan_layers else nnx.List(blocks)
    self.final_norm = norm(cfg, rules, rngs)
    if not cfg.tie_embeddings:
      self.unembed_DV = param(rngs, nnx.initializers.lecun_normal(), (cfg.embed_dim, cfg.vocab_size),
                              ('embed', 'vocab'), dtype, rules)
    self.cfg, self.rules = cfg, rules

  def __call__(self, tokens_BL: jax.Array, *, dropout_key: jax.Array | None = None,
               segment_ids_BL: jax.Array | None = None, positions_BL: jax.Array | None = None) -> jax.Array:
    """Logits; with `segment_ids_BL` and `positions_BL`, of packed documents (see the module doc)."""
    order_L = self._order(tokens_BL.shape[1])
    positions_BL = self._positions(positions_BL, tokens_BL.shape[1], order_L)
    tokens_BL, segment_ids_BL = self._stored(tokens_BL, order_L), self._stored(segment_ids_BL, order_L)
    table_VD, x_BLD = self._embed(tokens_BL)
    x_BLD = self._run_blocks(x_BLD, dropout_key, positions_BL, segment_ids_BL)[0]
    if order_L is not None:  # Back to the natural order, through a gather of the whole length.
      x_BLD = self._stored(x_BLD, np.argsort(order_L).astype(np.int32))
    return self._logits(x_BLD, table_VD)

  def loss(self, batch: dict[str, jax.Array], *, dropout_key: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(mean cross-entropy of the next-token predictions over the targets that count, their count,
    statistics): with MoE layers, their `moe_statistics` ({} without).

    `batch` holds 'inputs' and 'targets' (B, L) int32 and, from packed or padded rows, 'segment_ids',
    'positions' (B, L) int32 and 'target_weights' (B, L) float32 (`mintrain.data.pipeline`); without
    them every target counts and a row is one sequence. A mean over tokens: the order they are stored
    in (the ring's zigzag) does not matter.
    """
    order_L = self._order(batch['inputs'].shape[1])
    positions_BL = self._positions(batch.get('positions'), batch['inputs'].shape[1], order_L)
    keys = ('inputs', 'targets', 'target_weights', 'segment_ids')
    tokens_BL, targets_BL, weights_BL, segment_ids_BL = (self._stored(batch.get(k), order_L) for k in keys)
    targets_BL = self.rules.reshard(targets_BL, ('batch', 'length'))  # Split as the hidden states are.
    if weights_BL is None:
      weights_BL = jnp.ones(targets_BL.shape, jnp.float32, out_sharding=jax.typeof(targets_BL).sharding)
    weights_BL = self.rules.reshard(weights_BL, ('batch', 'length'))
    table_VD, x_BLD = self._embed(tokens_BL)
    x_BLD, stats = self._run_blocks(x_BLD, dropout_key, positions_BL, segment_ids_BL)
    if self.cfg.loss_chunks <= 0:
      loss = cross_entropy(self._logits(x_BLD, table_VD), targets_BL, weights_BL)
    else:
      loss = fused_cross_entropy(self.final_norm(x_BLD), self._unembedding(table_VD), targets_BL, weights_BL,
                                 self.rules, self.cfg.loss_chunks)
    return loss, jnp.sum(weights_BL), moe_statistics(self.cfg, stats) if stats else {}

  def decode(self, tokens_BL: jax.Array, cache: KVCache,
             start: jax.Array | int) -> tuple[jax.Array, KVCache]:
    """(logits_BLV, cache) for L new tokens at positions start..start+L-1, no dropout.

    Each token attends to the cached positions before it and to the new tokens up to
    itself, exactly as in `__call__` on the whole sequence. Prefill passes the prompt
    with start=0; each sampling step then passes one token.
    """
    table_VD, x_BLD = self._embed(tokens_BL)
    new_cache = []
    for block, kv in zip(self._layers(), cache, strict=True):
      x_BLD, kv = block.decode(x_BLD, kv, start)
      new_cache.append(kv)
    return self._logits(x_BLD, table_VD), new_cache

  def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    """Zero keys and values for `max_len` positions in every layer, laid out (under a mesh) as the
    attention's keys and values (batch, length, kv heads, kv), so it is split like what fills it. Its
    length is rounded up to split evenly over `context`; the slots beyond are never visible."""
    check_window(self.cfg, max_len, f'a KV cache of {max_len} positions (prompt and new tokens)')
    max_len = -(-max_len // self.cfg.length_ways) * self.cfg.length_ways
    shape = (batch, max_len, self.cfg.kv_heads, self.cfg.head_dim)
    spec = None if jax.sharding.get_abstract_mesh().empty else self.rules.activation_spec(kv_layout(self.cfg))
    return [(jnp.zeros(shape, dtype, out_sharding=spec), jnp.zeros(shape, dtype, out_sharding=spec))
            for _ in range(self.cfg.num_layers)]

  def _order(self, seq_len: int) -> np.ndarray | None:
    """The positions in the order the sequence is stored: the zigzag for the ring attention over a split
    `length` (causal load balance, `context_attention`); None for the natural order."""
    if self.cfg.context_attention == 'ring' and self.cfg.length_ways > 1:
      return zigzag_order(seq_len, self.cfg.length_ways)
    return None

  def _positions(self, positions_BL: jax.Array | None, seq_len: int, order_L: np.ndarray | None) -> jax.Array:
    """(B or 1, L) positions in storage order: packed rows' own (B, L), else 0..L-1 for every row."""
    if positions_BL is not None:
      return self._stored(positions_BL, order_L)
    return jnp.asarray(np.arange(seq_len, dtype=np.int32) if order_L is None else order_L)[None, :]

  def _stored(self, x: jax.Array | None, order_L: np.ndarray | None) -> jax.Array | None:
    """Tokens, targets, weights, positions or segment ids (BL), or hidden states (BLD), with the length
    taken in `order_L`."""
    if x is None or order_L is None:
      return x
    rules, axes = self.rules, ('batch', None, 'embed')[:x.ndim]
    whole = rules.reshard(x, axes)  # A gather along a split length has no layout of its own.
    stored = whole.at[:, order_L].get(out_sharding=rules.activation_spec(axes, whole.shape))
    return rules.reshard(stored, ('batch', 'length', 'embed')[:x.ndim])

  def _run_blocks(self, x_BLD: jax.Array, dropout_key: jax.Array | None, positions_BL: jax.Array,
                  segment_ids_BL: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Every block in turn: unrolled, or one `scan` over the stacked layers; rematerialised as configured.
    Returns the output and the MoE layers' statistics, each stacked on a leading layer axis ({} if none).
    With the ring, dropout masks are drawn for the stored (zigzag) order: as random, not the same draws."""
    cfg, rules = self.cfg, self.rules
    positions_BL = rules.reshard(positions_BL, ('batch', 'length'))
    if segment_ids_BL is not None:
      segment_ids_BL = rules.reshard(segment_ids_BL, ('batch', 'length'))

    def run(make_block, params, x_BLD: jax.Array, i: jax.Array | int, positions_BL: jax.Array,
            segment_ids_BL: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
      key = jax.random.fold_in(dropout_key, i) if dropout_key is not None else None
      return make_block(params)(x_BLD, key, positions_BL, segment_ids_BL)

    if cfg.remat != 'none':
      # A scan already keeps XLA from merging the recomputation back into the forward pass.
      run = jax.checkpoint(run, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers,
                           static_argnums=(0,))
    if not cfg.scan_layers:
      layer_stats = []
      for i, block in enumerate(self.blocks):
        graphdef, params = nnx.split(block)
        x_BLD, stats = run(functools.partial(nnx.merge, graphdef), params, x_BLD, i, positions_BL,
                           segment_ids_BL)
        layer_stats += [stats] if stats else []
      return x_BLD, jax.tree.map(lambda *xs: jnp.stack(xs), *layer_stats) if layer_stats else {}
    make_layer, params_N = split_layers(self.blocks)

    def body(x_BLD: jax.Array, layer: tuple[list[jax.Array], jax.Array]):
      params, i = layer
      return run(make_layer, params, x_BLD, i, positions_BL, segment_ids_BL)

    return jax.lax.scan(body, x_BLD, (params_N, jnp.arange(cfg.num_layers)))

  def _layers(self) -> list[Block]:
    """One Block per layer; with scan_layers, each holds its layer's slice of the stacked parameters."""
    if not self.cfg.scan_layers:
      return list(self.blocks)
    make_layer, params_N = split_layers(self.blocks)
    return [make_layer([p[i] for p in params_N]) for i in range(self.cfg.num_layers)]

  def _embed(self, tokens_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(table_VD in its compute layout, x_BLD); the table is reused by a tied output layer."""
    rules = self.rules
    check_window(self.cfg, tokens_BL.shape[1], f'a sequence of {tokens_BL.shape[1]} tokens')
    table_VD = gather(self.embedding_VD, rules, jnp.dtype(self.cfg.compute_dtype))
    x_BLD = table_VD.at[tokens_BL].get(out_sharding=rules.activation_spec(BLD, tokens_BL.shape))
    if self.cfg.embed_scale:  # Rounded to the compute dtype first, as Gemma's `normalizer`.
      x_BLD = x_BLD * jnp.asarray(self.cfg.embed_dim ** 0.5, x_BLD.dtype)
    return table_VD, x_BLD

  def _logits(self, x_BLD: jax.Array, table_VD: jax.Array) -> jax.Array:
    logits_BLV = jnp.einsum('BLD,DV->BLV', self.final_norm(x_BLD), self._unembedding(table_VD))
    return self.rules.reshard(logits_BLV.astype(jnp.float32), ('batch', 'length', 'vocab'))

  def _unembedding(self, table_VD: jax.Array) -> jax.Array:
    """The output projection w_DV in its compute layout: the embedding table's transpose when tied."""
    if self.cfg.tie_embeddings:
      return table_VD.T
    return gather(self.unembed_DV, self.rules, table_VD.dtype)


def moe_statistics(cfg: TransformerConfig, stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The MoE layers' statistics (stacked on a leading layer axis) as metrics, averaged over the layers:
  `aux_loss` (the weighted sum of the balancing and z-losses, added to the objective), each loss, the
  dropped fraction of top-k choices, the busiest expert's share times E (1: balanced) and every expert's
  share of the choices (`moe_expert_share_<e>`)."""
  mean = {name: jnp.mean(value, axis=0) for name, value in stats.items()}
  share_E = mean.pop('expert_share')
  out = {'aux_loss': (cfg.load_balance_loss_weight * mean['load_balance_loss']
                      + cfg.router_z_loss_weight * mean['router_z_loss'])}
  out |= {f'moe_{name}': value for name, value in mean.items()}
  out['moe_expert_load_max'] = jnp.max(share_E) * cfg.num_experts
  out |= {f'moe_expert_share_{e}': share_E[e] for e in range(cfg.num_experts)}
  return out


def forward_flops_per_token(cfg: TransformerConfig, seq_len: int, *,
                            causal_half: bool = True) -> dict[str, float]:
  """Forward matmul FLOPs per token, by part (all layers summed); MaxText's convention (`mintrain.report`)."""
  d, f, h, k = cfg.embed_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim
  attention = 4 * seq_len * h * k  # Scores (q.k) and probs @ v: 2*L*H*K each per query.
  if causal_half:
    attention /= 2
  moe_layers = cfg.moe_layers
  flops = {
      'qkv': cfg.num_layers * 2 * d * (h + 2 * cfg.kv_heads) * k,
      'attention': cfg.num_layers * attention,
      'out_proj': cfg.num_layers * 2 * h * k * d,
      'mlp': (cfg.num_layers - moe_layers) * 2 * d * f * 3,  # Gate, up and down.
      'logits': 2 * d * cfg.vocab_size,
  }
  if moe_layers:  # The active experts only: k of E per token; and the router, and the shared expert.
    flops['router'] = moe_layers * 2 * d * cfg.num_experts
    flops['experts'] = moe_layers * cfg.experts_per_token * 2 * d * cfg.expert_dim * 3
    if cfg.shared_expert_dim:
      flops['shared_expert'] = moe_layers * (2 * d * cfg.shared_expert_dim * 3 + 2 * d)
  return flops


def train_flops_per_row(cfg: TransformerConfig, seq_len: int, causal_half: bool = True) -> float:
  """Training (forward + backward) FLOPs of one sequence."""
  return 3 * sum(forward_flops_per_token(cfg, seq_len, causal_half=causal_half).values()) * seq_len


def param_count(cfg: TransformerConfig) -> int:
  d, f, h, k, v = cfg.embed_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim, cfg.vocab_size
  block = 2 * d * (h + cfg.kv_heads) * k + 2 * d  # q, k, v, out; two norms.
  block += (h + 2 * cfg.kv_heads) * k if cfg.qkv_bias else 0
  moe_mlp = d * cfg.num_experts + cfg.num_experts * 3 * d * cfg.expert_dim  # Router, experts' gate, up, down.
  moe_mlp += 3 * d * cfg.shared_expert_dim + d if cfg.shared_expert_dim else 0
  mlps = (cfg.num_layers - cfg.moe_layers) * 3 * d * f + cfg.moe_layers * moe_mlp
  return v * d + cfg.num_layers * block + mlps + d + (0 if cfg.tie_embeddings else d * v)


def activation_bytes(cfg: TransformerConfig, rows: int, seq_len: int, ways: Ways) -> int:
  """What the backward pass keeps for `rows` sequences on one device (`mintrain.report`).

  Per layer, the inputs of every matmul, norm and nonlinearity and the attention probabilities; plus
  the float32 logits and their softmax (with the fused loss, one chunk's at a time, and the hidden
  states' gradient that it keeps instead). With remat, a layer keeps only its input ('full') or its
  input and its matmul outputs ('save_matmuls'), and one layer's full activations are live again
  while its backward pass recomputes them. With `length` split (`mesh.context`) a device keeps its
  share of the tokens, each still scoring every key, and the keys and values it gathered.
  """
  c, d = np.dtype(cfg.compute_dtype).itemsize, cfg.embed_dim
  heads, mlp = cfg.num_heads / ways('heads'), cfg.mlp_dim / ways('mlp')
  tokens = rows * seq_len / ways('length')  # This device's queries.
  per_token_layer = (c * (4 * d + 4 * heads * cfg.head_dim + 3 * mlp)  # Norms, q/k/v/out, gate/up/product.
                     + heads * seq_len * (4 + c))  # Attention scores (float32) and probabilities.
  # An MoE layer instead: float32 router logits and probabilities, and for each of its slots (E x C per
  # sequence, wherever expert parallelism moves them) the token in and out and the gate/up/product.
  slots = cfg.num_experts * moe.capacity(seq_len, cfg.num_experts, cfg.experts_per_token, cfg.capacity_factor)
  expert_mlp = cfg.expert_dim / ways('mlp')
  moe_layer = (per_token_layer - c * 3 * mlp + 2 * 4 * cfg.num_experts
               + slots / seq_len * c * (2 * d + 3 * expert_mlp) + c * 3 * cfg.shared_expert_dim / ways('mlp'))
  moe_layers = cfg.moe_layers
  # Keys and values of the whole sequence, gathered (all_gather; the ring keeps as much, block by block).
  gathered = 2 * c * heads * cfg.head_dim * rows * seq_len if ways('length') > 1 else 0
  dense_full, moe_full = tokens * per_token_layer + gathered, tokens * moe_layer + gathered
  if cfg.remat == 'none':
    layers = (cfg.num_layers - moe_layers) * dense_full + moe_layers * moe_full
  else:
    # Input; plus, when saving matmuls, q/k/v, the attention projection, gate, up and down outputs.
    kept = c * d if cfg.remat == 'full' else c * (3 * d + 3 * heads * cfg.head_dim + 2 * mlp)
    largest = moe_full if moe_layers else dense_full  # One layer's, recomputed for its backward.
    layers = cfg.num_layers * tokens * kept + largest
  chunks = cfg.loss_chunks
  logits = 2 * 4 * cfg.vocab_size / ways('vocab') / max(chunks, 1)  # Float32, and softmax.
  loss_grad = c * d if chunks > 0 else 0  # The fused loss keeps d loss / d hidden states from its forward.
  return int(layers + tokens * (logits + loss_grad + c * d))


FAMILY = Family(
    config=TransformerConfig,
    make=lambda cfg, rules, rngs: Transformer(cfg, rules=rules, rngs=rngs),
    param_count=param_count,
    train_flops_per_row=train_flops_per_row,
    tokens_per_row=lambda cfg, seq_len: seq_len,
    activation_bytes=activation_bytes,
    compute_dtype=lambda cfg: cfg.compute_dtype,
    synthetic_rows=lambda cfg, seed, step, rows, seq_len: synthetic.token_rows(seed, step, rows, seq_len,
                                                                               cfg.vocab_size),
    for_mesh=for_mesh,
    notes=notes,
    hf=hf_llama,
    eval_metrics=lambda cfg, loss: {'eval_bits_per_token': loss / math.log(2)},
    vocab_size=lambda cfg: cfg.vocab_size,
    for_tokenizer=for_tokenizer,
    check=check,
)
