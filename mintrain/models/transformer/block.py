"""The transformer's layers: a pre-norm block of causal attention (RoPE, `attention`, or latent attention,
`mla`) and a gated MLP or a mixture of experts (`moe`), and a multi-token prediction depth (`PredictAhead`),
one more block. `model.Transformer` stacks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.models.family import Placement
from mintrain.models.layers import RMSNorm, dropout, fold, gather, gather_split, linear, matmul, param, plus
from mintrain.models.transformer import collective_matmul, mla, moe
from mintrain.models.transformer.attention import BLD, Attention
from mintrain.models.transformer.config import ACTIVATIONS, TransformerConfig
from mintrain.partitioning import AxisRules


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

  def __call__(self, x_BLD: jax.Array, *, overlap: bool = True, key: jax.Array | None = None) -> jax.Array:
    """`overlap=False` forces the plain path (decode steps are too short to split into chunks). `key`: LoRA
    adapters' dropout (`layers.gather_split`), training only; their terms take the plain path."""
    rules, dtype = self.rules, x_BLD.dtype
    w_gate_DF, gate_adapter = gather_split(self.wi_gate_DF, rules, dtype, fold(key, 0))
    w_up_DF, up_adapter = gather_split(self.wi_up_DF, rules, dtype, fold(key, 1))
    w_down_FD, down_adapter = gather_split(self.wo_FD, rules, dtype, fold(key, 2))
    adapters = (gate_adapter, up_adapter, down_adapter)
    if overlap and self.overlap and collective_matmul.ring_axes(rules)[1] > 1 and adapters == (None,) * 3:
      return rules.reshard(collective_matmul.gated_mlp(x_BLD, w_gate_DF, w_up_DF, w_down_FD, rules,
                                                       self.activation), BLD)
    # Gate and up as one matmul: one pass over x and a wider, faster product.
    w_DGF = jnp.stack([w_gate_DF, w_up_DF], axis=1)
    gate_up_BLGF = linear('BLD,DGF->BLGF', x_BLD, w_DGF, custom_vjp=self.custom_vjp)
    gate_BLGF, up_BLGF = jnp.split(gate_up_BLGF, 2, axis=2)
    gate_BLF = plus(gate_BLGF[:, :, 0], gate_adapter, x_BLD)
    up_BLF = plus(up_BLGF[:, :, 0], up_adapter, x_BLD)
    h_BLF = rules.reshard(self.activation(gate_BLF) * up_BLF, ('batch', 'length', 'mlp'))
    y_BLD = linear('BLF,FD->BLD', h_BLF, w_down_FD, rules.activation_spec(BLD, h_BLF.shape[:2]),
                   custom_vjp=self.custom_vjp)
    return plus(y_BLD, down_adapter, h_BLF)


def norm(cfg: TransformerConfig, rules: AxisRules, rngs: nnx.Rngs) -> RMSNorm:
  return RMSNorm(cfg.embed_dim, rules=rules, param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs,
                 eps=cfg.norm_eps, plus_one=cfg.norm_plus_one)


class Block(nnx.Module):
  """Attention, then a dense MLP or (`moe_layer`) a mixture of experts; `__call__` also returns the MoE
  layer's statistics ({} for a dense block). With `post_norms` (Gemma 2 and 3) each of their outputs is
  normed too, before it joins the residual stream."""

  def __init__(self, cfg: TransformerConfig, placement: Placement, *, rules: AxisRules, rngs: nnx.Rngs,
               moe_layer: bool = False, window: int = 0):
    self.attn_norm = norm(cfg, rules, rngs)
    self.attn = (mla.LatentAttention(cfg, placement, rules=rules, rngs=rngs) if cfg.mla
                 else Attention(cfg, placement, rules=rules, rngs=rngs, window=window))
    if cfg.post_norms:
      self.attn_post_norm = norm(cfg, rules, rngs)
    self.mlp_norm = norm(cfg, rules, rngs)
    activation = ACTIVATIONS[cfg.mlp_activation]
    self.mlp = (moe.MoE(cfg, placement, rules=rules, rngs=rngs, activation=activation) if moe_layer
                else GatedMLP(cfg, rules=rules, rngs=rngs))
    if cfg.post_norms:
      self.mlp_post_norm = norm(cfg, rules, rngs)
    self.rules, self.dropout_rate, self.moe_layer = rules, cfg.dropout_rate, moe_layer
    self.post_norms = cfg.post_norms

  def _post(self, norm_name: str, x_BLD: jax.Array) -> jax.Array:
    return getattr(self, norm_name)(x_BLD) if self.post_norms else x_BLD

  def __call__(self, x_BLD: jax.Array, key: jax.Array | None, positions_BL: jax.Array,
               segment_ids_BL: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    keys = jax.random.split(key) if key is not None else (None, None)
    attn_BLD = self._post('attn_post_norm', self.attn(self.attn_norm(x_BLD), positions_BL, segment_ids_BL,
                                                      key=fold(key, 2)))
    x_BLD = x_BLD + dropout(attn_BLD, self.dropout_rate, keys[0])
    h_BLD = self.mlp_norm(x_BLD)
    if self.moe_layer:  # Padding (segment 0) neither takes an expert's slot nor counts in the statistics.
      mlp_BLD, stats = self.mlp(h_BLD, tokens_BL=None if segment_ids_BL is None else segment_ids_BL > 0,
                                key=fold(key, 3))
    else:
      mlp_BLD, stats = self.mlp(h_BLD, key=fold(key, 3)), {}
    x_BLD = x_BLD + dropout(self._post('mlp_post_norm', mlp_BLD), self.dropout_rate, keys[1])
    return self.rules.reshard(x_BLD, BLD), stats

  def decode(self, x_BLD: jax.Array, kv: tuple[jax.Array, jax.Array], start: jax.Array | int,
             real_B: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The block without dropout, attending over (and updating) its layer's cache (`Attention.decode`)."""
    attn_BLD, kv = self.attn.decode(self.attn_norm(x_BLD), kv, start, real_B)
    x_BLD = x_BLD + self._post('attn_post_norm', attn_BLD)
    if self.moe_layer:
      mlp_BLD = self.mlp(self.mlp_norm(x_BLD), dropless=True)[0]
    else:
      mlp_BLD = self.mlp(self.mlp_norm(x_BLD), overlap=False)
    x_BLD = x_BLD + self._post('mlp_post_norm', mlp_BLD)
    return self.rules.reshard(x_BLD, BLD), kv


class PredictAhead(nnx.Module):
  """One multi-token prediction depth (DeepSeek-V3's MTP module): the previous depth's hidden states and
  the embeddings of the tokens k ahead, each normed, joined by one projection and run through one more
  block; its own norm before the shared output layer predicts the token k + 1 ahead."""

  def __init__(self, cfg: TransformerConfig, placement: Placement, *, rules: AxisRules, rngs: nnx.Rngs):
    d = cfg.embed_dim
    self.hidden_norm, self.embed_norm, self.out_norm = (norm(cfg, rules, rngs) for _ in range(3))
    self.join_CD = param(rngs, nnx.initializers.lecun_normal(), (2 * d, d), (None, 'embed'),
                         jnp.dtype(cfg.param_dtype), rules)
    self.block = Block(cfg, placement, rules=rules, rngs=rngs, moe_layer=cfg.num_experts > 0)
    self.rules = rules

  def __call__(self, h_BLD: jax.Array, e_BLD: jax.Array, key: jax.Array | None, positions_BL: jax.Array,
               segment_ids_BL: jax.Array | None) -> jax.Array:
    joined_BLC = jnp.concatenate([self.embed_norm(e_BLD), self.hidden_norm(h_BLD)], axis=-1)
    h_BLD = matmul('BLC,CD->BLD', joined_BLC, gather(self.join_CD, self.rules, h_BLD.dtype),
                   self.rules.activation_spec(BLD, h_BLD.shape[:2]))
    return self.block(h_BLD, key, positions_BL, segment_ids_BL)[0]
