"""Decoder-only transformer LM: pre-norm blocks of causal attention (RoPE) and gated MLP.

Shape letters: B batch, L length (M for keys), D embed, F mlp, H heads,
K head dim, V vocab. Heads and the MLP hidden dimension are split over the
`model`-style mesh axis by the rules; the model itself only names logical axes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.models.layers import RMSNorm, dropout, gather, param
from mintrain.partitioning import AxisRules

BLD = ('batch', 'length', 'embed')
BLHK = ('batch', 'length', 'heads', 'kv')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  tie_embeddings: bool = True
  rope_base: float = 10000.0
  dropout_rate: float = 0.0
  param_dtype: str = 'float32'
  compute_dtype: str = 'float32'


def rope(x_BLHK: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding on the last dimension (split-half convention)."""
  _, seq_len, _, head_dim = x_BLHK.shape
  half = head_dim // 2
  inv_freq_K = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_LK = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq_K[None, :]
  sin, cos = jnp.sin(angle_LK)[None, :, None, :], jnp.cos(angle_LK)[None, :, None, :]
  x = x_BLHK.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention; heads are the tensor-parallel dimension."""

  def __init__(self, cfg: TransformerConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    d, h, k, dtype = cfg.embed_dim, cfg.num_heads, cfg.head_dim, jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=0, out_axis=(1, 2))
    out_init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', in_axis=(0, 1), out_axis=2)
    self.wq_DHK = param(rngs, init, (d, h, k), ('embed', 'heads', 'kv'), dtype, rules)
    self.wk_DHK = param(rngs, init, (d, h, k), ('embed', 'heads', 'kv'), dtype, rules)
    self.wv_DHK = param(rngs, init, (d, h, k), ('embed', 'heads', 'kv'), dtype, rules)
    self.wo_HKD = param(rngs, out_init, (h, k, d), ('heads', 'kv', 'embed'), dtype, rules)
    self.cfg, self.rules = cfg, rules

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    cfg, rules, dtype = self.cfg, self.rules, x_BLD.dtype
    q_BLHK = jnp.einsum('BLD,DHK->BLHK', x_BLD, gather(self.wq_DHK, rules, dtype))
    k_BMHK = jnp.einsum('BLD,DHK->BLHK', x_BLD, gather(self.wk_DHK, rules, dtype))
    v_BMHK = jnp.einsum('BLD,DHK->BLHK', x_BLD, gather(self.wv_DHK, rules, dtype))
    q_BLHK = rules.reshard(rope(q_BLHK, cfg.rope_base), BLHK)
    k_BMHK = rules.reshard(rope(k_BMHK, cfg.rope_base), BLHK)
    v_BMHK = rules.reshard(v_BMHK, BLHK)

    scores_BHLM = jnp.einsum('BLHK,BMHK->BHLM', q_BLHK, k_BMHK).astype(jnp.float32)
    scores_BHLM = scores_BHLM * cfg.head_dim ** -0.5
    seq_len = x_BLD.shape[1]
    causal_LM = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    scores_BHLM = jnp.where(causal_LM, scores_BHLM, jnp.finfo(jnp.float32).min)
    probs_BHLM = jax.nn.softmax(scores_BHLM, axis=-1).astype(dtype)
    out_BLHK = rules.reshard(jnp.einsum('BHLM,BMHK->BLHK', probs_BHLM, v_BMHK), BLHK)
    # Contracting the sharded heads needs an explicit output layout (a reduce over `model`).
    return jnp.einsum('BLHK,HKD->BLD', out_BLHK, gather(self.wo_HKD, rules, dtype),
                      out_sharding=rules.activation_spec(BLD))


class GatedMLP(nnx.Module):
  """SwiGLU MLP: column-parallel gate/up, row-parallel down (Megatron layout)."""

  def __init__(self, cfg: TransformerConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    d, f, dtype = cfg.embed_dim, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.lecun_normal()
    self.wi_gate_DF = param(rngs, init, (d, f), ('embed', 'mlp'), dtype, rules)
    self.wi_up_DF = param(rngs, init, (d, f), ('embed', 'mlp'), dtype, rules)
    self.wo_FD = param(rngs, init, (f, d), ('mlp', 'embed'), dtype, rules)
    self.rules = rules

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    rules, dtype = self.rules, x_BLD.dtype
    gate_BLF = jnp.einsum('BLD,DF->BLF', x_BLD, gather(self.wi_gate_DF, rules, dtype))
    up_BLF = jnp.einsum('BLD,DF->BLF', x_BLD, gather(self.wi_up_DF, rules, dtype))
    h_BLF = rules.reshard(jax.nn.silu(gate_BLF) * up_BLF, ('batch', 'length', 'mlp'))
    return jnp.einsum('BLF,FD->BLD', h_BLF, gather(self.wo_FD, rules, dtype),
                      out_sharding=rules.activation_spec(BLD))


class Block(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.embed_dim, rules=rules, param_dtype=dtype, rngs=rngs)
    self.attn = Attention(cfg, rules=rules, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, rules=rules, param_dtype=dtype, rngs=rngs)
    self.mlp = GatedMLP(cfg, rules=rules, rngs=rngs)
    self.rules, self.dropout_rate = rules, cfg.dropout_rate

  def __call__(self, x_BLD: jax.Array, key: jax.Array | None) -> jax.Array:
    keys = jax.random.split(key) if key is not None else (None, None)
    x_BLD = x_BLD + dropout(self.attn(self.attn_norm(x_BLD)), self.dropout_rate, keys[0])
    x_BLD = x_BLD + dropout(self.mlp(self.mlp_norm(x_BLD)), self.dropout_rate, keys[1])
    return self.rules.reshard(x_BLD, BLD)


class Transformer(nnx.Module):
  """tokens_BL -> logits_BLV (float32)."""

  def __init__(self, cfg: TransformerConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    embed_init = nnx.initializers.normal(cfg.embed_dim ** -0.5)
    self.embedding_VD = param(rngs, embed_init, (cfg.vocab_size, cfg.embed_dim), ('vocab', 'embed'), dtype,
                              rules)
    self.blocks = nnx.List([Block(cfg, rules=rules, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.embed_dim, rules=rules, param_dtype=dtype, rngs=rngs)
    if not cfg.tie_embeddings:
      self.unembed_DV = param(rngs, nnx.initializers.lecun_normal(), (cfg.embed_dim, cfg.vocab_size),
                              ('embed', 'vocab'), dtype, rules)
    self.cfg, self.rules = cfg, rules

  def __call__(self, tokens_BL: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
    cfg, rules = self.cfg, self.rules
    dtype = jnp.dtype(cfg.compute_dtype)
    table_VD = gather(self.embedding_VD, rules, dtype)
    x_BLD = table_VD.at[tokens_BL].get(out_sharding=rules.activation_spec(BLD))
    for i, block in enumerate(self.blocks):
      key = jax.random.fold_in(dropout_key, i) if dropout_key is not None else None
      x_BLD = block(x_BLD, key)
    x_BLD = self.final_norm(x_BLD)
    if cfg.tie_embeddings:
      logits_BLV = jnp.einsum('BLD,VD->BLV', x_BLD, table_VD)
    else:
      logits_BLV = jnp.einsum('BLD,DV->BLV', x_BLD, gather(self.unembed_DV, rules, dtype))
    return rules.reshard(logits_BLV.astype(jnp.float32), ('batch', 'length', 'vocab'))
