"""Decoder-only transformer LM: pre-norm blocks (`block.Block`) of causal attention and a gated MLP or, every
`moe_every`-th block but `dense_layers` when `num_experts` > 0, a mixture of experts; in training, optional
multi-token prediction depths (`block.PredictAhead`).

`__call__` is the training forward pass; `decode` is the same computation over a per-layer KV cache, so
each sampled token costs one step instead of a re-run of the prefix. Packed rows' `segment_ids_BL` and
`positions_BL` make each document attend only to itself, at its own positions, so its predictions are
those it would get alone; `loss` counts only the targets that `target_weights` count. Every performance
option (remat, scan_layers, attention, mlp_overlap, context_attention, loss_chunks, linear: their
meaning in mintrain/configs/base.py) computes the same function as the default.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mintrain.models.family import Placement
from mintrain.models.layers import (
  MATMUL,
  gather,
  matmul,
  on_params_mesh,
  param,
  run_layers,
  split_layers,
  stack_layers,
  whole_layers,
)
from mintrain.models.loss import cross_entropy, fused_cross_entropy, token_losses
from mintrain.models.transformer import mla
from mintrain.models.transformer.attention import BLD, KVCache, kv_layout
from mintrain.models.transformer.block import Block, PredictAhead, norm
from mintrain.models.transformer.config import TransformerConfig
from mintrain.models.transformer.context_attention import zigzag_order
from mintrain.partitioning import AxisRules

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


def at_position(x_BLX: jax.Array, position: jax.Array | int) -> jax.Array:
  """(B, X): one position's entries (or, for positions (B,), each row's own), as a masked sum over the
  length: that may be split over devices (`mesh.context`), where a slice of one position has no layout."""
  hit_BL = jnp.arange(x_BLX.shape[1]) == jnp.reshape(position, (-1, 1))
  return jnp.sum(jnp.where(hit_BL[:, :, None], x_BLX, 0.0), axis=1)


class Transformer(nnx.Module):
  """tokens_BL -> logits_BLV (float32), laid out for `placement` (`mintrain.models.family.Placement`)."""

  def __init__(self, cfg: TransformerConfig, placement: Placement, *, rules: AxisRules, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.param_dtype)
    embed_init = nnx.initializers.normal(cfg.embed_dim ** -0.5)
    self.embedding_VD = param(rngs, embed_init, (cfg.vocab_size, cfg.embed_dim), ('vocab', 'embed'), dtype,
                              rules, decay=False)  # A lookup table: decay would pull rare tokens to zero.
    def block(i: int, rngs: nnx.Rngs) -> Block:
      return Block(cfg, placement, rules=rules, rngs=rngs, moe_layer=cfg.is_moe(i), window=cfg.window(i))

    # With scan_layers, one Block whose parameters are all layers' stacked on a leading `layers` axis (the
    # blocks are identical: `check`).
    self.blocks = (stack_layers(functools.partial(block, 0), cfg.num_layers, rngs, rules) if cfg.scan_layers
                   else nnx.List([block(i, rngs) for i in range(cfg.num_layers)]))
    self.final_norm = norm(cfg, rules, rngs)
    if not cfg.tie_embeddings:
      self.unembed_DV = param(rngs, nnx.initializers.lecun_normal(), (cfg.embed_dim, cfg.vocab_size),
                              ('embed', 'vocab'), dtype, rules)
    if cfg.mtp_layers:  # Training only: `loss` adds their predictions; logits and decoding never run them.
      self.mtp = nnx.List([PredictAhead(cfg, placement, rules=rules, rngs=rngs)
                           for _ in range(cfg.mtp_layers)])
    self.cfg, self.rules = cfg, rules
    # How many ways `length` is split (mesh.context), and the key/value (and KV cache) layout.
    self.length_ways, self.kv_layout = placement.ways('length'), kv_layout(cfg.kv_heads_axis(placement))
    self.pipeline = placement.pipeline  # How the stacked blocks run over mesh.stage (`models.pipeline`).

  @on_params_mesh
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

  @on_params_mesh
  def loss(self, batch: dict[str, jax.Array], *, dropout_key: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(mean cross-entropy of the next-token predictions over the targets that count, their count,
    statistics): with MoE layers, their `moe_statistics` ({} without).

    `batch` holds 'inputs' and 'targets' (B, L) int32 and, from packed or padded rows, 'segment_ids',
    'positions' (B, L) int32 and 'target_weights' (B, L) float32 (`mintrain.data.pipeline`); without
    them every target counts and a row is one sequence. A mean over tokens: the order they are stored
    in (the ring's zigzag) does not matter.
    """
    h = self._hidden(batch, dropout_key)
    x_BLD, table_VD, targets_BL, weights_BL = h['x'], h['table'], h['targets'], h['weights']
    loss = self._lm_loss(self.final_norm(x_BLD), table_VD, targets_BL, weights_BL)
    stats = moe_statistics(self.cfg, h['stats']) if h['stats'] else {}
    if self.cfg.mtp_layers:
      mtp_loss = self._mtp_loss(x_BLD, table_VD, h['tokens'], targets_BL, weights_BL, h['positions'],
                                h['segment_ids'], dropout_key)
      stats['mtp_loss'] = mtp_loss
      stats['aux_loss'] = stats.get('aux_loss', 0.0) + self.cfg.mtp_loss_weight * mtp_loss
    return loss, jnp.sum(weights_BL), stats

  @on_params_mesh
  def sequence_log_probs(self, batch: dict[str, jax.Array], *, dropout_key: jax.Array | None = None,
                         documents: int = 0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(B,) float32 summed log-probability of each row's counted targets (weighted by 'target_weights'),
    and the statistics of `loss`: what preference objectives score a response by. Through the logits, not
    the fused loss: each row needs its own sum. With `documents`, (B, documents): each packed document's
    sum apart, by 'segment_ids' 1 ... documents."""
    h = self._hidden(batch, dropout_key)
    logp_BL = -token_losses(self._logits(h['x'], h['table']), h['targets']) * h['weights']
    stats = moe_statistics(self.cfg, h['stats']) if h['stats'] else {}
    if not documents:
      return jnp.sum(logp_BL, axis=1), stats
    segment_ids_BL = self.rules.reshard(h['segment_ids'], ('batch', 'length'))  # Split as the targets are.
    ids_N = jnp.arange(1, documents + 1, dtype=jnp.int32)
    return jnp.sum(jnp.where(segment_ids_BL[..., None] == ids_N, logp_BL[..., None], 0.0), axis=1), stats

  @on_params_mesh
  def token_log_probs(self, batch: dict[str, jax.Array], *, dropout_key: jax.Array | None = None
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(B, L) float32 log-probability of each target, in the batch's order (not the ring's storage order),
    and the statistics of `loss`: what policy-gradient objectives weigh token by token."""
    h = self._hidden(batch, dropout_key)
    logp_BL = -token_losses(self._logits(h['x'], h['table']), h['targets'])
    order_L = self._order(logp_BL.shape[1])
    if order_L is not None:
      logp_BL = self._stored(logp_BL, np.argsort(order_L))
    return logp_BL, moe_statistics(self.cfg, h['stats']) if h['stats'] else {}

  def _hidden(self, batch: dict[str, jax.Array], dropout_key: jax.Array | None) -> dict[str, Any]:
    """A batch through the blocks, in storage order: the hidden states `x` (before the final norm), the
    embedding `table`, `tokens`, `targets`, `weights`, `positions`, `segment_ids` and the blocks' `stats`."""
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
    return {'x': x_BLD, 'table': table_VD, 'tokens': tokens_BL, 'targets': targets_BL, 'weights': weights_BL,
            'positions': positions_BL, 'segment_ids': segment_ids_BL, 'stats': stats}

  def _lm_loss(self, h_BLD: jax.Array, table_VD: jax.Array, targets_BL: jax.Array,
               weights_BL: jax.Array) -> jax.Array:
    """Mean cross-entropy of the output layer on normed hidden states (fused over chunks if asked)."""
    if self.cfg.loss_chunks <= 0:
      return cross_entropy(self._vocab_logits(h_BLD, table_VD), targets_BL, weights_BL)
    return fused_cross_entropy(h_BLD, self._unembedding(table_VD), targets_BL, weights_BL, self.rules,
                               self.cfg.loss_chunks)

  def _mtp_loss(self, x_BLD: jax.Array, table_VD: jax.Array, tokens_BL: jax.Array, targets_BL: jax.Array,
                weights_BL: jax.Array, positions_BL: jax.Array, segment_ids_BL: jax.Array | None,
                dropout_key: jax.Array | None) -> jax.Array:
    """The mean over depths k = 1.. of the cross-entropy of predicting the token k + 1 ahead (DeepSeek-V3's
    multi-token prediction), each depth reading the previous one's hidden states and the tokens k ahead.
    A position counts where its target k ahead counts and is in the same document; the last k do not."""
    rules, total = self.rules, 0.0
    positions_BL = rules.reshard(jnp.broadcast_to(positions_BL, tokens_BL.shape), ('batch', 'length'))

    def ahead(x_BL: jax.Array, k: int) -> jax.Array:  # x at position i + k, zeros past the end.
      whole_BL = rules.reshard(x_BL, ('batch', None))
      return rules.reshard(jnp.pad(whole_BL[:, k:], ((0, 0), (0, k))), ('batch', 'length'))

    for k, layer in enumerate(self.mtp, 1):
      weights_k_BL = ahead(weights_BL, k)
      if segment_ids_BL is not None:
        weights_k_BL = weights_k_BL * (ahead(segment_ids_BL, k) == segment_ids_BL)
      e_BLD = table_VD.at[ahead(tokens_BL, k)].get(out_sharding=rules.activation_spec(BLD, tokens_BL.shape))
      key = None if dropout_key is None else jax.random.fold_in(dropout_key, self.cfg.num_layers + k)
      x_BLD = layer(x_BLD, e_BLD, key, positions_BL, segment_ids_BL)
      total = total + self._lm_loss(layer.out_norm(x_BLD), table_VD, ahead(targets_BL, k), weights_k_BL)
    return total / len(self.mtp)

  @on_params_mesh
  def decode(self, tokens_BL: jax.Array, cache: KVCache, start: jax.Array | int, *,
             last: jax.Array | int | None = None) -> tuple[jax.Array, KVCache]:
    """(logits_BLV, cache) for L new tokens at positions start..start+L-1, no dropout.

    Each token attends to the cached positions before it and to the new tokens up to
    itself, exactly as in `__call__` on the whole sequence. Prefill passes the prompt
    with start=0; each sampling step then passes one token, at one position for all rows or at
    each row's own (`start` (B,): prompts of several lengths, padded on the right).
    With `last` (an index of the new tokens, or one per row (B,)), the logits there alone (B, 1, V), what
    sampling reads after a prefill, whose (B, L, V) would outweigh it. One per row is a prefill (start 0)
    of prompts padded on the right: a row's tokens after its `last` are padding, never seen by its later
    tokens, which overwrite their slots.
    """
    real_B = None if last is None or jnp.ndim(last) == 0 else last + 1
    if real_B is not None and not (isinstance(start, int) and start == 0):
      raise ValueError('a last token per row is a prefill of padded prompts: start must be 0.')
    table_VD, x_BLD = self._embed(tokens_BL)
    new_cache = []
    for block, kv in zip(self._layers(), cache, strict=True):
      x_BLD, kv = block.decode(x_BLD, kv, start, real_B)
      new_cache.append(kv)
    if last is not None:
      x_BLD = at_position(x_BLD, last)[:, None]
    return self._logits(x_BLD, table_VD), new_cache

  @on_params_mesh
  def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    """Zero keys and values for `max_len` positions in every layer, laid out (under a mesh) as the
    attention's keys and values (batch, length, kv heads, kv), so it is split like what fills it. Its
    length is rounded up to split evenly over `context`; the slots beyond are never visible. A local
    layer's holds only its window (a rolling buffer), whole along its length on every device; latent
    attention's, each position's latent and shared rotary key."""
    cfg, rules, mesh = self.cfg, self.rules, jax.sharding.get_abstract_mesh()
    padded = -(-max_len // self.length_ways) * self.length_ways
    if cfg.mla:
      spec = None if mesh.empty else rules.activation_spec(mla.LATENT)
      return [tuple(jnp.zeros(s, dtype, out_sharding=spec) for s in mla.cache_shapes(cfg, batch, padded))
              for _ in range(cfg.num_layers)]
    cache = []
    for i in range(cfg.num_layers):
      window = cfg.window(i)
      shape = (batch, min(window, max_len) if window else padded, cfg.kv_heads, cfg.head_dim)
      layout = (*self.kv_layout[:1], None, *self.kv_layout[2:]) if window else self.kv_layout
      spec = None if mesh.empty else rules.activation_spec(layout)
      cache.append((jnp.zeros(shape, dtype, out_sharding=spec), jnp.zeros(shape, dtype, out_sharding=spec)))
    return cache

  def after_step(self, balance: dict[str, jax.Array]) -> nnx.State:
    """The parameters after the train step's update, with each sigmoid router's balancing bias moved by
    router_bias_rate towards balance: bias += rate * sign(mean load - load), from `balance['expert_share']`
    ((MoE layers, E), each expert's share of the step's choices, the same on every mesh)."""
    cfg = self.cfg
    share_NE = balance['expert_share']
    step_NE = cfg.router_bias_rate * jnp.sign(jnp.mean(share_NE, axis=-1, keepdims=True) - share_NE)
    if cfg.scan_layers:  # Every layer is MoE (`check`): one stacked bias.
      bias = self.blocks.mlp.router_bias_E
      bias[...] = bias[...] + step_NE.astype(bias.dtype)
    else:
      for n, i in enumerate(i for i in range(cfg.num_layers) if cfg.is_moe(i)):
        bias = self.blocks[i].mlp.router_bias_E
        bias[...] = bias[...] + step_NE[n].astype(bias.dtype)
    return nnx.state(self, nnx.Param)

  def _order(self, seq_len: int) -> np.ndarray | None:
    """The positions in the order the sequence is stored: the zigzag for the ring attention over a split
    `length` (causal load balance, `context_attention`); None for the natural order."""
    if self.cfg.context_attention == 'ring' and self.length_ways > 1:
      return zigzag_order(seq_len, self.length_ways)
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
    """Every block in turn (`layers.run_layers`): the output and the MoE layers' statistics, each stacked
    on a leading layer axis ({} if none). With the ring, dropout masks are drawn for the stored (zigzag)
    order: as random, not the same draws."""
    rules = self.rules
    positions_BL = rules.reshard(positions_BL, ('batch', 'length'))
    if segment_ids_BL is not None:
      segment_ids_BL = rules.reshard(segment_ids_BL, ('batch', 'length'))
    return run_layers(self.blocks, x_BLD, dropout_key, positions_BL, segment_ids_BL,
                      scanned=self.cfg.scan_layers, policy=REMAT_POLICIES.get(self.cfg.remat),
                      schedule=self.pipeline)

  def _layers(self) -> list[Block]:
    """One Block per layer; with scan_layers, each holds its layer's slice of the stacked parameters."""
    if not self.cfg.scan_layers:
      return list(self.blocks)
    make_layer, params_N = split_layers(self.blocks)
    params_N = [whole_layers(p) for p in params_N]
    return [make_layer([p[i] for p in params_N]) for i in range(self.cfg.num_layers)]

  def _embed(self, tokens_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(table_VD in its compute layout, x_BLD); the table is reused by a tied output layer."""
    rules = self.rules
    table_VD = gather(self.embedding_VD, rules, jnp.dtype(self.cfg.compute_dtype))
    x_BLD = table_VD.at[tokens_BL].get(out_sharding=rules.activation_spec(BLD, tokens_BL.shape))
    if self.cfg.embed_scale:  # Rounded to the compute dtype first, as Gemma's `normalizer`.
      x_BLD = x_BLD * jnp.asarray(self.cfg.embed_dim ** 0.5, x_BLD.dtype)
    return table_VD, x_BLD

  def _logits(self, x_BLD: jax.Array, table_VD: jax.Array) -> jax.Array:
    """float32 logits, soft-capped to cap * tanh(logits / cap) with `final_softcap` (Gemma 2)."""
    return self._vocab_logits(self.final_norm(x_BLD), table_VD)

  def _vocab_logits(self, h_BLD: jax.Array, table_VD: jax.Array) -> jax.Array:
    """float32 logits of normed hidden states (the model's or a prediction depth's), soft-capped as
    `_logits` says."""
    logits_BLV = matmul('BLD,DV->BLV', h_BLD, self._unembedding(table_VD)).astype(jnp.float32)
    if cap := self.cfg.final_softcap:
      logits_BLV = cap * jnp.tanh(logits_BLV / cap)
    return self.rules.reshard(logits_BLV, ('batch', 'length', 'vocab'))

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
  if cfg.router_score == 'sigmoid' and cfg.router_bias_rate:  # Per layer, for `Transformer.after_step`.
    out['balance'] = {'expert_share': stats['expert_share']}
  return out
