"""Causal self-attention of the transformer: RoPE, multi-head or grouped-query heads, its einsum,
dot_product and ring paths, and the KV-cache writes of decoding.

Grouped-query attention (`num_kv_heads` = G < H; 1 is multi-query): G heads of keys and values, each
shared by H/G query heads (head h reads group h // (H/G), as `transformers`' `repeat_kv`). Their logical
axis is `kv_heads`; when the mesh splits it more ways than G divides, they are replicated instead
(`TransformerConfig.kv_heads_axis`). What a query sees is a function of positions and segment ids
(`context_attention.visible`), not of where tokens are stored, so packed rows split over `context` too.
A local layer (`TransformerConfig.window`) sees only the last `sliding_window` positions, in every path;
its KV cache is a rolling buffer of that many slots (position p in slot p % slots).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from mintrain.models.family import Placement
from mintrain.models.layers import fold, gather, gather_split, linear, matmul, param, plus
from mintrain.models.transformer.config import TransformerConfig
from mintrain.models.transformer.context_attention import NEG, ring_attention, scores, visible
from mintrain.models.transformer.query_blocks import Blocks, query_blocks
from mintrain.partitioning import AxisRules

BLD = ('batch', 'length', 'embed')
BLHK = ('batch', 'length', 'heads', 'kv')

# Per layer, (keys_BSHK, values_BSHK): a global layer's of every position written so far (zeros beyond), a
# local layer's of the last slots positions (`Attention.decode`).
KVCache = list[tuple[jax.Array, jax.Array]]


def attention_kernel(platform: str, dtype: jnp.dtype, head_dim: int) -> str:
  """`jax.nn.dot_product_attention`'s implementation: cuDNN's flash attention on an NVIDIA GPU for the
  16-bit dtypes and head sizes it takes, XLA's formulation elsewhere. (Its own default, None, is
  always XLA in jax 0.10.)"""
  cudnn_ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
  return 'cudnn' if platform in ('gpu', 'cuda') and cudnn_ok else 'xla'



def rope_frequencies(cfg: TransformerConfig, positions_BL: jax.Array,
                     local: bool = False) -> tuple[jax.Array, float]:
  """float32 (K/2,) inverse frequencies for tokens at `positions_BL`, and the scale of cos and sin (YaRN's
  attention factor, 1 otherwise), as transformers' `rope_type`s (`modeling_rope_utils`). A `local`
  layer's are unscaled, from its own base, when `rope_local_base` is set (Gemma 3)."""
  half, scaling, factor = cfg.head_dim // 2, cfg.rope_scaling, cfg.rope_scaling_factor
  if local and cfg.rope_local_base:
    return cfg.rope_local_base ** (-jnp.arange(half, dtype=jnp.float32) / half), 1.0
  default_K = cfg.rope_base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if scaling == 'none':
    return default_K, 1.0
  if scaling == 'linear':  # Positions divided by the factor, which is the same as frequencies.
    return default_K / factor, 1.0
  if scaling == 'dynamic':
    return _dynamic_ntk(cfg, positions_BL), 1.0
  if scaling == 'yarn':
    return _yarn(cfg)
  return _llama3(cfg), 1.0


def _llama3(cfg: TransformerConfig) -> jax.Array:
  """Llama 3.1's: wavelengths beyond the original context's / low_freq_factor slowed by `factor`, those
  below / high_freq_factor kept, and a smooth blend between (`_compute_llama3_parameters`)."""
  half = cfg.head_dim // 2
  inv_freq = 1.0 / cfg.rope_base ** (np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
  factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old_len = cfg.rope_original_max_len
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.asarray(np.where(medium, blended, scaled), jnp.float32)


def _dynamic_ntk(cfg: TransformerConfig, positions_BL: jax.Array) -> jax.Array:
  """NTK scaling by the call's own length (its last position + 1): the default frequencies up to
  rope_original_max_len, past it a base raised so the lowest frequency stretches with the length. As
  transformers recomputes them for each forward pass (and decode step) that grows past that length."""
  dim, old_len, factor = cfg.head_dim, cfg.rope_original_max_len, cfg.rope_scaling_factor
  seq_len = jnp.maximum(jnp.max(positions_BL) + 1, old_len).astype(jnp.float32)
  base = cfg.rope_base * (factor * seq_len / old_len - (factor - 1)) ** (dim / (dim - 2))
  return 1.0 / base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)


def _yarn(cfg: TransformerConfig) -> tuple[jax.Array, float]:
  """YaRN: frequencies turning more than beta_fast times over the original context kept, fewer than
  beta_slow divided by the factor, a linear blend between; cos and sin scaled by the attention factor
  (`_compute_yarn_parameters`)."""
  dim, base, factor = cfg.head_dim, cfg.rope_base, cfg.rope_scaling_factor

  def dimension(rotations: float) -> float:  # The dimension whose frequency turns `rotations` times.
    return dim * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = dimension(cfg.rope_beta_fast), dimension(cfg.rope_beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  high = high + 0.001 if low == high else high
  ramp_K = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  pos_freqs_K = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  keep_K = 1 - ramp_K
  inv_freq_K = 1.0 / (factor * pos_freqs_K) * (1 - keep_K) + 1.0 / pos_freqs_K * keep_K
  return inv_freq_K, cfg.yarn_attention_factor


def rope(x_BLHK: jax.Array, inv_freq_K: jax.Array, positions_BL: jax.Array | None = None,
         scale: float = 1.0) -> jax.Array:
  """Rotary position embedding on the last dimension (split-half convention, as `transformers`), cos and
  sin times `scale` (YaRN's attention factor).

  `positions_BL` ((B or 1, L)) are the tokens' positions (default 0..L-1): a decode step passes its
  offset, so a token is rotated the same as in training; packed rows pass each document's own.
  """
  _, seq_len, _, head_dim = x_BLHK.shape
  half = head_dim // 2
  if positions_BL is None:
    positions_BL = jnp.arange(seq_len)[None, :]
  angle_BLK = positions_BL.astype(jnp.float32)[:, :, None] * inv_freq_K[None, None, :]
  sin, cos = jnp.sin(angle_BLK)[:, :, None, :] * scale, jnp.cos(angle_BLK)[:, :, None, :] * scale
  x = x_BLHK.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


def same_segment(segment_ids_BL: jax.Array, k_segment_ids_BM: jax.Array) -> jax.Array:
  """bool (B, 1, L, M): whether query l and key m are in the same document of their row (heads broadcast)."""
  return (segment_ids_BL[:, :, None] == k_segment_ids_BM[:, None, :])[:, None]


def softmax_attention(q_BLHK: jax.Array, k_BMHK: jax.Array, v_BMHU: jax.Array, visible_LM: jax.Array,
                      scale: float, softcap: float, out_spec: P, blocks: Blocks | None = None) -> jax.Array:
  """(B, L, H, U): each query's softmax over the keys it may see (`visible_LM`, (..., L, M)) of the
  values, in float32 scores (soft-capped when `softcap` > 0), block by block of `blocks` (None: one block
  of all queries and keys; blocks: `query_blocks`)."""
  outs = []
  for s, e, k, m in blocks or [(0, q_BLHK.shape[1], 0, k_BMHK.shape[1])]:
    scores_BHLM = scores(q_BLHK[:, s:e], k_BMHK[:, k:m], scale, softcap)
    scores_BHLM = jnp.where(visible_LM[..., s:e, k:m], scores_BHLM, NEG)
    probs_BHLM = jax.nn.softmax(scores_BHLM, axis=-1).astype(q_BLHK.dtype)
    outs.append(matmul('BHLM,BMHU->BLHU', probs_BHLM, v_BMHU[:, k:m], out_spec))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def decode_positions(start: jax.Array | int, length: int) -> jax.Array:
  """Positions of L new tokens at `start`: (1, L) for one start, (B, L) for one per row (B,), where each
  row has one token (sampling's step over prompts of several lengths)."""
  if jnp.ndim(start) == 1 and length != 1:
    raise ValueError(f'a start per row takes one new token per row; got {length}.')
  return jnp.reshape(start, (-1, 1)) + jnp.arange(length)


def write_rows(cache_BSX: jax.Array, new_B1X: jax.Array, start_B: jax.Array) -> jax.Array:
  """The cache with row b's one new entry at slot start_B[b], each device writing its own rows (a scatter
  over rows split across devices would gather its updates)."""
  def each(cache_BSX, new_B1X, start_B):
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s,) + (0,) * (c.ndim - 1)))(
        cache_BSX, new_B1X, start_B)
  spec = jax.typeof(cache_BSX).sharding.spec
  if jax.sharding.get_abstract_mesh().empty or not spec:
    return each(cache_BSX, new_B1X, start_B)
  rows = P(spec[0])
  return jax.shard_map(each, in_specs=(spec, spec, rows), out_specs=spec)(
      cache_BSX, jax.sharding.reshard(new_B1X, spec), jax.sharding.reshard(start_B, rows))


def kv_layout(kv_axis: str | None) -> tuple[str | None, ...]:
  """Logical axes of keys and values (BLGK), also those of the KV cache."""
  return ('batch', 'length', kv_axis, 'kv')


class Attention(nnx.Module):
  """Causal self-attention, multi-head or grouped-query; heads are the tensor-parallel dimension."""

  def __init__(self, cfg: TransformerConfig, placement: Placement, *, rules: AxisRules, rngs: nnx.Rngs,
               window: int = 0):
    d, h, g, k = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    dtype = jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=0, out_axis=(1, 2))
    out_init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=(0, 1), out_axis=2)
    kv_axes = ('embed', cfg.kv_heads_axis(placement), 'kv')
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
    if cfg.qk_norm:  # One scale over head_dim, shared by all query (key) heads.
      norm_init = nnx.initializers.zeros if cfg.norm_plus_one else nnx.initializers.ones
      self.q_norm_K = param(rngs, norm_init, (k,), ('kv',), dtype, rules)
      self.k_norm_K = param(rngs, norm_init, (k,), ('kv',), dtype, rules)
    self.cfg, self.placement, self.rules, self.window = cfg, placement, rules, window
    self.kv_layout = kv_layout(kv_axes[1])
    self.score_scale, self.softcap = cfg.score_scale, cfg.attn_softcap

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array,
               segment_ids_BL: jax.Array | None = None, key: jax.Array | None = None) -> jax.Array:
    """Causal attention by the tokens' positions (`positions_BL`, (B or 1, L): where each stored token
    sits, in order except for the ring's zigzag); with `segment_ids_BL`, only within each token's document.
    `key`: LoRA adapters' dropout (`layers.gather_split`), training only."""
    cfg = self.cfg
    q_BLHK, k_BMGK, v_BMGK = self._qkv(x_BLD, positions_BL, key)
    out_key = fold(key, 3)
    k_BMHK, v_BMHK = self._repeat_kv(k_BMGK), self._repeat_kv(v_BMGK)
    if cfg.context_attention == 'ring' and self.placement.ways('length') > 1:
      return self._project(ring_attention(q_BLHK, k_BMHK, v_BMHK, positions_BL, segment_ids_BL,
                                         spec=self.rules.activation_spec(BLHK, q_BLHK.shape),
                                         scale=cfg.score_scale, softcap=cfg.attn_softcap, window=self.window),
                         out_key)
    # The keys' positions and segments, whole like the keys themselves (`_gather_length`).
    k_positions_BM = self._gather_length(q_BLHK, positions_BL)
    k_segment_ids_BM = None if segment_ids_BL is None else self._gather_length(q_BLHK, segment_ids_BL)
    if cfg.attention == 'dot_product':  # Only ever in natural order (the ring takes the zigzag).
      k_BMHK, v_BMHK = self._gather_length(q_BLHK, k_BMHK), self._gather_length(q_BLHK, v_BMHK)
      same_B1LM = None if segment_ids_BL is None else same_segment(segment_ids_BL, k_segment_ids_BM)
      # On cuDNN the mask becomes an additive bias, which its flash attention takes, as it takes the window
      # (by index, which within a document is by position).
      implementation = attention_kernel(self.placement.platform, q_BLHK.dtype, cfg.head_dim)
      out_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BMHK, v_BMHK, mask=same_B1LM, is_causal=True,
                                              scale=cfg.score_scale, implementation=implementation,
                                              local_window_size=(self.window - 1, 0) if self.window else None)
      return self._project(out_BLHK, out_key)
    visible_BLM = visible(positions_BL, k_positions_BM, segment_ids_BL, k_segment_ids_BM, self.window)
    return self._attend(q_BLHK, k_BMHK, v_BMHK, visible_BLM[:, None], out_key, self._blocks(q_BLHK))

  def decode(self, x_BLD: jax.Array, kv: tuple[jax.Array, jax.Array], start: jax.Array | int,
             real_B: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Attention of L new tokens at positions start.. over the cache, which they are written into first
    (a local layer's: after, as the buffer may hold fewer slots than the new tokens reach back). `start`
    is one position for all rows, or one per row (B,) for a single new token each (`decode_positions`);
    `real_B`, of a prefill at start 0: how many of each row's new tokens are real, the rest padding that
    no real token sees (a local buffer keeps each row's last real ones)."""
    rules = self.rules
    positions_BL = decode_positions(start, x_BLD.shape[1])
    q_BLHK, k_BLGK, v_BLGK = self._qkv(x_BLD, positions_BL)
    if self.window:
      return self._decode_local(q_BLHK, k_BLGK, v_BLGK, kv, start, real_B)
    keys_BSGK, values_BSGK = (rules.reshard(self._write(cache, new, start), self.kv_layout)
                              for cache, new in zip(kv, (k_BLGK, v_BLGK)))
    # Causal over absolute positions; the slots beyond (zeros, or a shorter row's padding) are never visible.
    visible_BLS = visible(positions_BL, jnp.arange(keys_BSGK.shape[1]))
    out_BLD = self._attend(q_BLHK, self._repeat_kv(keys_BSGK), self._repeat_kv(values_BSGK),
                           visible_BLS[:, None], blocks=self._blocks(q_BLHK, start))
    return out_BLD, (keys_BSGK, values_BSGK)

  def _decode_local(self, q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array,
                    kv: tuple[jax.Array, jax.Array], start: jax.Array | int,
                    real_B: jax.Array | None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """A local layer's decode: the new tokens attend over the buffer's slots and themselves, then the last
    of them (of each row's real ones) overwrite the buffer's oldest. Buffers are whole along their length
    on every device."""
    length, slots = q_BLHK.shape[1], kv[0].shape[1]
    whole = ('batch', None, self.kv_layout[2], 'kv')
    new = [self.rules.reshard(x.astype(kv[0].dtype), whole) for x in (k_BLGK, v_BLGK)]
    slot_S, start_B1 = jnp.arange(slots), jnp.reshape(start, (-1, 1))
    # The latest position before `start` that each slot holds (per row: (B or 1, S)); negative for a slot
    # not yet written.
    held_BS = slot_S + slots * ((start_B1 - 1 - slot_S) // slots)
    # The first prefill's buffer holds nothing: its tokens see only each other, in the training pass's blocks.
    blocks = self._blocks(q_BLHK, start) if isinstance(start, int) and start == 0 else None
    positions_BL = decode_positions(start, length)
    k_positions_BM, (keys_BMGK, values_BMGK) = positions_BL, new
    if not blocks:
      k_positions_BM = jnp.concatenate([jnp.broadcast_to(held_BS, (k_positions_BM.shape[0], slots)),
                                        k_positions_BM], axis=1)
      keys_BMGK, values_BMGK = (jnp.concatenate([cache, x], axis=1) for cache, x in zip(kv, new))
    visible_BLM = visible(positions_BL, k_positions_BM, window=self.window)
    visible_BLM = visible_BLM & (k_positions_BM >= 0)[:, None, :]
    whole_heads = ('batch', None, 'heads', 'kv')
    out_BLD = self._attend(q_BLHK, self._repeat_kv(keys_BMGK, whole_heads),
                           self._repeat_kv(values_BMGK, whole_heads), visible_BLM[:, None], blocks=blocks)
    return out_BLD, tuple(self._write_local(cache, x, start, real_B) for cache, x in zip(kv, new))

  def _write_local(self, buffer_BSGK: jax.Array, new_BLGK: jax.Array, start: jax.Array | int,
                   real_B: jax.Array | None) -> jax.Array:
    """A local layer's buffer after L new tokens at `start`: slot s takes the last new token j (of each
    row's first real_B) with (start + j) % slots == s, if any."""
    length, slots = new_BLGK.shape[1], buffer_BSGK.shape[1]
    slot_S = jnp.arange(slots)
    if jnp.ndim(start) == 1:  # One token per row, into its row's slot.
      return write_rows(buffer_BSGK, new_BLGK, start % slots)
    if real_B is not None:  # A prefill at 0: token j to slot j % slots while j is a real one, chunk by chunk.
      for c in range(0, length, slots):
        chunk_BSGK = new_BLGK[:, c:c + slots]
        taken_BS = (c + slot_S[:chunk_BSGK.shape[1]] < real_B[:, None])[:, :, None, None]
        buffer_BSGK = buffer_BSGK.at[:, :chunk_BSGK.shape[1]].set(
            jnp.where(taken_BS, chunk_BSGK, buffer_BSGK[:, :chunk_BSGK.shape[1]]))
      return buffer_BSGK
    first_S = (slot_S - start) % slots
    last_S = first_S + slots * ((length - 1 - first_S) // slots)
    written_S = (first_S < length)[None, :, None, None]
    spec = self.rules.activation_spec(('batch', None, self.kv_layout[2], 'kv'), buffer_BSGK.shape)
    source_S = jnp.clip(last_S, 0, length - 1)
    return jnp.where(written_S, new_BLGK.at[:, source_S].get(out_sharding=spec), buffer_BSGK)

  def _write(self, cache_BSGK: jax.Array, new_BLGK: jax.Array, start: jax.Array | int) -> jax.Array:
    """The cache with the new keys (or values) at slots start..start+L-1 (a start per row: each row's one
    token at its slot). A single token cannot split like a cache whose length is split (`mesh.context`):
    it is written by a select over the slots, as is one per row there."""
    new_BLGK = new_BLGK.astype(cache_BSGK.dtype)
    if jnp.ndim(start) == 1 and self.placement.ways('length') == 1:
      return write_rows(cache_BSGK, new_BLGK, start)
    if jnp.ndim(start) == 1 or (new_BLGK.shape[1] == 1 and self.placement.ways('length') > 1):
      slot_BS = jnp.arange(cache_BSGK.shape[1]) == jnp.reshape(start, (-1, 1))
      return jnp.where(slot_BS[:, :, None, None], new_BLGK, cache_BSGK)
    new_BLGK = jax.sharding.reshard(new_BLGK, jax.typeof(cache_BSGK).sharding.spec)
    return jax.lax.dynamic_update_slice(cache_BSGK, new_BLGK, (0, start, 0, 0))

  def _gather_length(self, q_BLHK: jax.Array, x_BM: jax.Array) -> jax.Array:
    """Keys or values (BMHK), or their positions or segment ids (BM), whole along their length (an
    all-gather over `context`) when the queries' length is split: each device's queries may see any key.
    Otherwise (one decode token) they stay split, and attention reduces over their split instead."""
    if self.rules.activation_spec(('batch', 'length'), q_BLHK.shape[:2])[1] is None:
      return x_BM
    return self.rules.reshard(x_BM, ('batch', None, 'heads', 'kv')[:x_BM.ndim])

  def _qkv(self, x_BLD: jax.Array, positions_BL: jax.Array,
           key: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries (BLHK) and keys (BLGK) rotated for their positions, and values (BLGK)."""
    cfg, rules, dtype = self.cfg, self.rules, x_BLD.dtype
    custom_vjp = cfg.linear == 'custom_vjp'
    weights = (self.wq_DHK, self.wk_DHK, self.wv_DHK)
    (wq_DHK, q_adapter), (wk_DGK, k_adapter), (wv_DGK, v_adapter) = (
        gather_split(w, rules, dtype, fold(key, i)) for i, w in enumerate(weights))
    if not cfg.grouped:  # C: query, key, value in one matmul.
      w_DCHK = jnp.stack([wq_DHK, wk_DGK, wv_DGK], axis=1)
      qkv_BLCHK = linear('BLD,DCHK->BLCHK', x_BLD, w_DCHK, custom_vjp=custom_vjp)
      q_BLHK, k_BLGK, v_BLGK = (x[:, :, 0] for x in jnp.split(qkv_BLCHK, 3, axis=2))
    else:  # Queries, then C: key and value in one matmul.
      q_BLHK = linear('BLD,DHK->BLHK', x_BLD, wq_DHK, custom_vjp=custom_vjp)
      w_DCGK = jnp.stack([wk_DGK, wv_DGK], axis=1)
      kv_BLCGK = linear('BLD,DCGK->BLCGK', x_BLD, w_DCGK, custom_vjp=custom_vjp)
      k_BLGK, v_BLGK = kv_BLCGK[:, :, 0], kv_BLCGK[:, :, 1]
    q_BLHK, k_BLGK, v_BLGK = (plus(y, adapter, x_BLD) for y, adapter in
                              ((q_BLHK, q_adapter), (k_BLGK, k_adapter), (v_BLGK, v_adapter)))
    if cfg.qkv_bias:
      q_BLHK = q_BLHK + gather(self.bq_HK, rules, dtype)
      k_BLGK = k_BLGK + gather(self.bk_GK, rules, dtype)
      v_BLGK = v_BLGK + gather(self.bv_GK, rules, dtype)
    if cfg.qk_norm:
      q_BLHK, k_BLGK = self._head_norm(q_BLHK, self.q_norm_K), self._head_norm(k_BLGK, self.k_norm_K)
    inv_freq_K, scale = rope_frequencies(cfg, positions_BL, local=self.window > 0)
    q_BLHK = rules.reshard(rope(q_BLHK, inv_freq_K, positions_BL, scale), BLHK)
    k_BLGK = rules.reshard(rope(k_BLGK, inv_freq_K, positions_BL, scale), self.kv_layout)
    return q_BLHK, k_BLGK, rules.reshard(v_BLGK, self.kv_layout)

  def _head_norm(self, x_BLHK: jax.Array, scale: nnx.Param) -> jax.Array:
    """RMSNorm of each head over head_dim in float32 (QK-norm), scaled by (1 + w) with norm_plus_one."""
    x = x_BLHK.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps)
    scale_K = gather(scale, self.rules, jnp.float32)
    return (x * (1.0 + scale_K if self.cfg.norm_plus_one else scale_K)).astype(x_BLHK.dtype)

  def _repeat_kv(self, x_BMGK: jax.Array, layout: tuple[str | None, ...] = BLHK) -> jax.Array:
    """Each key/value head once per query head it serves (head h reads group h // (H/G)), in `layout`."""
    if not self.cfg.grouped:
      return x_BMGK
    b, m, g, k = x_BMGK.shape
    r = self.cfg.num_heads // g
    # A new minor axis, merged into G: a split G stays split, and each device keeps its own groups' heads.
    x_BMGRK = jnp.broadcast_to(x_BMGK[:, :, :, None, :], (b, m, g, r, k))
    return self.rules.reshard(x_BMGRK.reshape(b, m, g * r, k), layout)

  def _attend(self, q_BLHK: jax.Array, k_BMHK: jax.Array, v_BMHK: jax.Array, visible_LM: jax.Array,
              key: jax.Array | None = None, blocks: Blocks | None = None) -> jax.Array:
    """Softmax attention of each query over the keys it may see (`visible_LM`, (L, M) or per row
    (B or 1, 1, L, M)), by `blocks` of queries (default: one), then the output projection."""
    k_BMHK, v_BMHK = self._gather_length(q_BLHK, k_BMHK), self._gather_length(q_BLHK, v_BMHK)
    # Stated, as a decode step's keys may be split: then this contraction sums over `context`.
    out_spec = self.rules.activation_spec(BLHK, q_BLHK.shape)
    out_BLHK = softmax_attention(q_BLHK, k_BMHK, v_BMHK, visible_LM, self.score_scale, self.softcap,
                                 out_spec, blocks)
    return self._project(out_BLHK, key)

  def _blocks(self, q_BLHK: jax.Array, start: jax.Array | int = 0) -> Blocks | None:
    """The blocks of queries at positions start.. (`query_blocks`) over keys stored in position order: a
    training pass's (start 0), or new tokens' over a cache that holds positions 0.. (the prefill, a
    prompt's last tokens one at a time), none scoring the slots past start + L. None for a start known
    only when the step runs (the sampling loop's), or when the mesh splits the length (each device's
    queries may see any key)."""
    if not isinstance(start, int) or self.placement.ways('length') > 1:
      return None
    length = q_BLHK.shape[1]
    return query_blocks(length, self.cfg.attention_block_rows(length), self.window, start)

  def _project(self, out_BLHK: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """The output projection of the heads' outputs back to the residual stream."""
    rules, dtype = self.rules, out_BLHK.dtype
    out_BLHK = rules.reshard(out_BLHK, BLHK)
    w_HKD, adapter = gather_split(self.wo_HKD, rules, dtype, key)
    # Contracting the sharded heads needs an explicit output layout (a reduce over `model`).
    y_BLD = linear('BLHK,HKD->BLD', out_BLHK, w_HKD, rules.activation_spec(BLD, out_BLHK.shape[:2]),
                   custom_vjp=self.cfg.linear == 'custom_vjp')
    return plus(y_BLD, adapter, out_BLHK)

