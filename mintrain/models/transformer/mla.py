"""Multi-head latent attention (DeepSeek-V2/V3): keys and values rebuilt from a small shared latent, so a
KV cache holds that latent and one rotary key per position instead of every head's keys and values.

Shape letters beyond the family's: Q the queries' low-rank width (q_lora_rank), R the latent's
(kv_lora_rank), C = R + P what the latent projection gives, N the query/key dims without position
(qk_nope_head_dim), P the rotary ones (head_dim), U the values' (v_head_dim). Each head's query and key is
N dims without RoPE, then P with it; the rotary key is one for all heads. DeepSeek's checkpoints lay the
rotary dims out in interleaved pairs (`rope_interleave`): they are taken apart into the two halves that
`attention.rope` rotates, in queries and keys alike, so scores are those of transformers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.models.family import Placement
from mintrain.models.layers import gather, linear, param
from mintrain.models.transformer.attention import BLHK, Attention, decode_positions, rope, rope_frequencies
from mintrain.models.transformer.config import TransformerConfig
from mintrain.models.transformer.context_attention import visible
from mintrain.partitioning import AxisRules

LATENT = ('batch', 'length', None, 'kv')  # The cache's latent (BS1R) and rotary key (BS1P).
# transformers' latent norms keep their class default, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def cache_shapes(cfg: TransformerConfig, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The per-layer cache of MLA: the normed latent and the rotated shared key of each position."""
  return (batch, max_len, 1, cfg.kv_lora_rank), (batch, max_len, 1, cfg.head_dim)


class LatentAttention(Attention):
  """Causal multi-head latent attention; heads are the tensor-parallel dimension. Its cache is
  (latent_BS1R, rotary key_BS1P) per layer."""

  def __init__(self, cfg: TransformerConfig, placement: Placement, *, rules: AxisRules, rngs: nnx.Rngs):
    d, h, q, r = cfg.embed_dim, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    qk, p, u = cfg.qk_nope_head_dim + cfg.head_dim, cfg.head_dim, cfg.v_head_dim
    dtype = jnp.dtype(cfg.param_dtype)
    dense = nnx.initializers.lecun_normal()
    init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=0, out_axis=(1, 2))
    out_init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=(0, 1), out_axis=2)
    if q:
      self.wq_a_DQ = param(rngs, dense, (d, q), ('embed', 'latent'), dtype, rules)
      self.q_norm_Q = param(rngs, nnx.initializers.ones, (q,), ('latent',), dtype, rules)
      self.wq_b_QHK = param(rngs, init, (q, h, qk), ('latent', 'heads', 'kv'), dtype, rules)
    else:
      self.wq_DHK = param(rngs, init, (d, h, qk), ('embed', 'heads', 'kv'), dtype, rules)
    self.wkv_a_DC = param(rngs, dense, (d, r + p), ('embed', 'latent'), dtype, rules)
    self.kv_norm_R = param(rngs, nnx.initializers.ones, (r,), ('latent',), dtype, rules)
    self.wkv_b_RHK = param(rngs, init, (r, h, cfg.qk_nope_head_dim + u), ('latent', 'heads', 'kv'), dtype,
                           rules)
    self.wo_HKD = param(rngs, out_init, (h, u, d), ('heads', 'kv', 'embed'), dtype, rules)
    self.cfg, self.placement, self.rules, self.window = cfg, placement, rules, 0
    self.kv_layout = LATENT
    self.score_scale, self.softcap = cfg.mla_softmax_scale, 0.0

  def __call__(self, x_BLD: jax.Array, positions_BL: jax.Array,
               segment_ids_BL: jax.Array | None = None, key: jax.Array | None = None) -> jax.Array:
    """As `Attention.__call__` (its einsum path and the `context` split's all-gather of keys). LoRA adapters
    on its projections apply merged, without lora.dropout (`key` is not used)."""
    q_BLHK, latent_BL1R, k_rot_BL1P = self._latent(x_BLD, positions_BL)
    k_BMHK, v_BMHU = self._expand(latent_BL1R, k_rot_BL1P)
    k_positions_BM = self._gather_length(q_BLHK, positions_BL)
    k_segment_ids_BM = None if segment_ids_BL is None else self._gather_length(q_BLHK, segment_ids_BL)
    visible_BLM = visible(positions_BL, k_positions_BM, segment_ids_BL, k_segment_ids_BM)
    return self._attend(q_BLHK, k_BMHK, v_BMHU, visible_BLM[:, None], blocks=self._blocks(q_BLHK))

  def decode(self, x_BLD: jax.Array, kv: tuple[jax.Array, jax.Array], start: jax.Array | int,
             real_B: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """L new tokens at positions start.. (as `Attention.decode`) over the cache of latents, which they are
    written into first. A global layer's slots past a row's real tokens are never visible: `real_B` is
    not needed."""
    positions_BL = decode_positions(start, x_BLD.shape[1])
    q_BLHK, latent_BL1R, k_rot_BL1P = self._latent(x_BLD, positions_BL)
    latent_BS1R, k_rot_BS1P = (self.rules.reshard(self._write(cache, new, start), LATENT)
                               for cache, new in zip(kv, (latent_BL1R, k_rot_BL1P)))
    blocks = self._blocks(q_BLHK, start)
    seen = blocks[-1][-1] if blocks else latent_BS1R.shape[1]  # Only the slots before it are expanded.
    k_BSHK, v_BSHU = self._expand(latent_BS1R[:, :seen], k_rot_BS1P[:, :seen])
    visible_BLS = visible(positions_BL, jnp.arange(seen))
    return (self._attend(q_BLHK, k_BSHK, v_BSHU, visible_BLS[:, None], blocks=blocks),
            (latent_BS1R, k_rot_BS1P))

  def _latent(self, x_BLD: jax.Array, positions_BL: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries (BLHK, rotated), the normed latent (BL1R) and the rotated shared key (BL1P)."""
    cfg, rules, dtype = self.cfg, self.rules, x_BLD.dtype
    custom_vjp, n, r = cfg.linear == 'custom_vjp', cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
      q_BLQ = linear('BLD,DQ->BLQ', x_BLD, gather(self.wq_a_DQ, rules, dtype), custom_vjp=custom_vjp)
      q_BLQ = self._norm(q_BLQ, self.q_norm_Q)
      q_BLHK = linear('BLQ,QHK->BLHK', q_BLQ, gather(self.wq_b_QHK, rules, dtype), custom_vjp=custom_vjp)
    else:
      q_BLHK = linear('BLD,DHK->BLHK', x_BLD, gather(self.wq_DHK, rules, dtype), custom_vjp=custom_vjp)
    kv_BLC = linear('BLD,DC->BLC', x_BLD, gather(self.wkv_a_DC, rules, dtype), custom_vjp=custom_vjp)
    latent_BL1R = self._norm(kv_BLC[:, :, None, :r], self.kv_norm_R)
    inv_freq_P, scale = rope_frequencies(cfg, positions_BL)
    q_rot_BLHP = rules.reshard(rope(self._halves(q_BLHK[..., n:]), inv_freq_P, positions_BL, scale), BLHK)
    k_rot_BL1P = rope(self._halves(kv_BLC[:, :, None, r:]), inv_freq_P, positions_BL, scale)
    q_BLHK = jnp.concatenate([rules.reshard(q_BLHK[..., :n], BLHK), q_rot_BLHP], axis=-1)
    return q_BLHK, rules.reshard(latent_BL1R, LATENT), rules.reshard(k_rot_BL1P, LATENT)

  def _expand(self, latent_BM1R: jax.Array, k_rot_BM1P: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every head's keys (BMHK: N dims from the latent, then the shared rotary key) and values (BMHU)."""
    cfg, rules, n = self.cfg, self.rules, self.cfg.qk_nope_head_dim
    w_RHK = gather(self.wkv_b_RHK, rules, latent_BM1R.dtype)
    kv_BMHK = linear('BMR,RHK->BMHK', latent_BM1R[:, :, 0], w_RHK, custom_vjp=cfg.linear == 'custom_vjp')
    kv_BMHK = rules.reshard(kv_BMHK, BLHK)
    b, m, h, _ = kv_BMHK.shape
    k_rot_BMHP = rules.reshard(jnp.broadcast_to(k_rot_BM1P, (b, m, h, cfg.head_dim)), BLHK)
    k_BMHK = jnp.concatenate([kv_BMHK[..., :n], k_rot_BMHP.astype(kv_BMHK.dtype)], axis=-1)
    return rules.reshard(k_BMHK, BLHK), rules.reshard(kv_BMHK[..., n:], BLHK)

  def _halves(self, x_BLHP: jax.Array) -> jax.Array:
    """Interleaved rotary pairs (x0, x1), (x2, x3), ... as the halves (x0, x2, ...), (x1, x3, ...)."""
    if not self.cfg.rope_interleave:
      return x_BLHP
    return jnp.concatenate([x_BLHP[..., 0::2], x_BLHP[..., 1::2]], axis=-1)

  def _norm(self, x: jax.Array, scale: nnx.Param) -> jax.Array:
    """RMSNorm of a low-rank projection over its last axis, in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + LATENT_NORM_EPS)
    return (x32 * gather(scale, self.rules, jnp.float32)).astype(x.dtype)
