"""Mixture-of-experts MLP: a top-k router over E gated-MLP experts, experts split over a mesh axis.

The router scores by softmax (Mixtral, Qwen) or by sigmoid (DeepSeek-V3). A sigmoid router chooses by
score plus a per-expert bias (`router_bias_E`) that takes no gradient and that the train step moves
towards balance (`Transformer.after_step`, the auxiliary-loss-free rule), optionally within the best of
groups of experts, and weights each choice by its score alone.

Shape letters: B batch, L length, D embed, E experts, A the top-k choices of a token, C capacity (slots per
expert per sequence), F expert mlp width, T a device's tokens, N its choices, P peers (S as senders), G a
device's experts, R rows.

Dropless routing (capacity factor 0) sorts each device's choices by expert and runs them through a grouped
matmul (`grouped`), so the experts compute the routed tokens only; with the experts split, the choices
travel to their experts' devices and back by all-to-all (`model.expert_exchange`: ragged, each peer sent
exactly its choices, where the platform has `jax.lax.ragged_all_to_all`; else padded). With a capacity
factor, dispatch is per sequence, so what a token meets does not depend on how the batch is split: each
expert has C = ceil(capacity_factor * L * k / E) slots per sequence, filled in GShard's priority order; a
choice that finds its expert full is dropped and the residual stream carries the token on, and an
all-to-all sends each expert's slots to its devices. Both run inside `jax.shard_map` over the `expert`
mesh axes; the rules must split `batch` over those axes too (the default rules do). The layer returns the
load-balancing loss (Switch) and the router z-loss (ST-MoE) with the routing statistics; padding (segment
0) is routed nowhere and counts in none.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mintrain.models.family import Placement
from mintrain.models.layers import fold, gather, gather_split, matmul, param, plus
from mintrain.models.transformer import grouped
from mintrain.partitioning import AxisRules, spec_axes

BLD = ('batch', 'length', 'embed')
EXPERT_IN = ('expert', 'embed', 'mlp')
EXPERT_OUT = ('expert', 'mlp', 'embed')


def capacity(seq_len: int, num_experts: int, k: int, capacity_factor: float) -> int:
  """Slots per expert per sequence: L when dropless (factor 0), else ceil(factor * L * k / E), at most L."""
  if capacity_factor <= 0:
    return seq_len
  return min(seq_len, max(1, math.ceil(capacity_factor * seq_len * k / num_experts)))


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k` over the last axis, each device on its own rows. XLA's partitioner gathers a split
  TopK's operand whole onto every device: the router scores of the global batch, on each of them."""
  given = tuple(jax.typeof(x).sharding.spec)
  spec = P(*given, *(None,) * (x.ndim - len(given)))
  if spec[-1] is not None:
    spec = P(*spec[:-1], None)
    x = jax.sharding.reshard(x, spec)
  axes = {a for entry in spec for a in spec_axes(entry)}
  if not axes:
    return jax.lax.top_k(x, k)
  return jax.shard_map(lambda x: tuple(jax.lax.top_k(x, k)), in_specs=spec, out_specs=(spec, spec),
                       axis_names=axes)(x)


def route(logits_BLE: jax.Array, k: int, norm_topk: bool, *, bias_E: jax.Array | None = None,
          groups: int = 1, group_topk: int = 1, scale: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(probs_BLE, weights_BLA, experts_BLA): the scores (softmax; sigmoid when `bias_E` is given), the top
  k's weights and indices, as transformers' Mixtral/Qwen and DeepSeek-V3 routers compute them."""
  if bias_E is None:
    probs_BLE = jax.nn.softmax(logits_BLE, axis=-1)
    choice_BLE = probs_BLE
  else:
    probs_BLE = jax.nn.sigmoid(logits_BLE)
    choice_BLE = probs_BLE + jax.lax.stop_gradient(bias_E)
  if groups > 1:  # Only the experts of the group_topk groups whose two best choices sum highest.
    b, length, e = choice_BLE.shape
    group_BLG = jnp.sum(top_k(choice_BLE.reshape(b, length, groups, e // groups), 2)[0], axis=-1)
    kept_BLG = jnp.sum(jax.nn.one_hot(top_k(group_BLG, group_topk)[1], groups, dtype=bool), axis=-2)
    kept_BLE = jnp.repeat(kept_BLG, e // groups, axis=-1)
    choice_BLE = jnp.where(kept_BLE, choice_BLE, -jnp.inf)
  _, experts_BLA = top_k(choice_BLE, k)
  weights_BLA = jnp.take_along_axis(probs_BLE, experts_BLA, axis=-1)
  if norm_topk:
    tiny = 0.0 if bias_E is None else 1e-20  # DeepSeek's guard against a zero sum.
    weights_BLA = weights_BLA / (jnp.sum(weights_BLA, axis=-1, keepdims=True) + tiny)
  return probs_BLE, weights_BLA * scale if scale != 1.0 else weights_BLA, experts_BLA


def slots(experts_BLA: jax.Array, num_experts: int, cap: int,
          tokens_BL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(slot_BLA, kept_BLA): each choice's slot e * C + position in its expert's queue, and whether it fits.

  Positions count, per sequence and expert, the choices before it in priority order: all first choices
  in position order, then all second choices, ... Where `tokens_BL` (bool) is False (padding), the
  choices queue for nothing and are not kept.
  """
  b, length, k = experts_BLA.shape
  onehot_BALE = jax.nn.one_hot(jnp.swapaxes(experts_BLA, 1, 2), num_experts, dtype=jnp.int32)
  if tokens_BL is not None:
    onehot_BALE = onehot_BALE * tokens_BL[:, None, :, None].astype(jnp.int32)
  onehot_BNE = onehot_BALE.reshape(b, k * length, num_experts)  # N: choices in priority order.
  position_BN = jnp.sum((jnp.cumsum(onehot_BNE, axis=1) - 1) * onehot_BNE, axis=-1)
  position_BLA = jnp.swapaxes(position_BN.reshape(b, k, length), 1, 2)
  kept_BLA = position_BLA < cap
  if tokens_BL is not None:
    kept_BLA = kept_BLA & tokens_BL[:, :, None]
  return experts_BLA * cap + position_BLA, kept_BLA


def _dispatch(x_LD: jax.Array, slot_LA: jax.Array, kept_LA: jax.Array, num_slots: int) -> jax.Array:
  """One sequence's tokens in their slots (num_slots, D); empty slots are zeros, dropped choices vanish."""
  length, k = slot_LA.shape
  target_N = jnp.where(kept_LA, slot_LA, num_slots).reshape(-1)  # Dropped ones go to a spare row.
  x_ND = jnp.broadcast_to(x_LD[:, None, :], (length, k, x_LD.shape[-1])).reshape(length * k, -1)
  return jnp.zeros((num_slots + 1, x_LD.shape[-1]), x_LD.dtype).at[target_N].set(x_ND)[:num_slots]


def _combine(y_SD: jax.Array, slot_LA: jax.Array, kept_LA: jax.Array, weights_LA: jax.Array) -> jax.Array:
  """Each token's output: its kept choices' expert outputs, weighted by the router (L, D)."""
  y_LAD = y_SD[jnp.where(kept_LA, slot_LA, 0)]
  return matmul('LAD,LA->LD', y_LAD, jnp.where(kept_LA, weights_LA, 0).astype(y_SD.dtype))


def _experts_local(x_BLD, slot_BLA, kept_BLA, weights_BLA, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                   num_experts: int, cap: int, expert_axes: tuple[str, ...], mlp_axes: tuple[str, ...],
                   activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """One device's part, inside `shard_map`: its sequences' tokens through the experts, and back."""
  b, _, d = x_BLD.shape
  x_BSD = jax.vmap(_dispatch, in_axes=(0, 0, 0, None))(x_BLD, slot_BLA, kept_BLA, num_experts * cap)
  x_BECD = x_BSD.reshape(b, num_experts, cap, d)
  if expert_axes:  # Its experts' slots from every device of the expert group: (ep * B, E / ep, C, D).
    x_BECD = jax.lax.all_to_all(x_BECD, expert_axes, split_axis=1, concat_axis=0, tiled=True)
  # Each expert's slots of every sequence as one matrix: XLA:CPU has no bfloat16 product summed in float32
  # with the experts between two free dimensions ('BECD,EDF->BECF' fails to run).
  x_ERD = x_BECD.transpose(1, 0, 2, 3).reshape(x_BECD.shape[1], -1, d)
  gate_ERF = matmul('ERD,EDF->ERF', x_ERD, w_gate_EDF)
  up_ERF = matmul('ERD,EDF->ERF', x_ERD, w_up_EDF)
  y_ERD = matmul('ERF,EFD->ERD', activation(gate_ERF) * up_ERF, w_down_EFD)
  y_BECD = y_ERD.reshape(x_BECD.shape[1], x_BECD.shape[0], cap, d).transpose(1, 0, 2, 3)
  if mlp_axes:  # Each device summed its part of F.
    y_BECD = jax.lax.psum(y_BECD, mlp_axes)
  if expert_axes:
    y_BECD = jax.lax.all_to_all(y_BECD, expert_axes, split_axis=0, concat_axis=1, tiled=True)
  y_BSD = y_BECD.reshape(b, num_experts * cap, d)
  return jax.vmap(_combine)(y_BSD, slot_BLA, kept_BLA, weights_BLA)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *,
                      axis_name: tuple[str, ...]) -> jax.Array:
  """`jax.lax.ragged_all_to_all`, the GPU's and TPU's collective (XLA:CPU has none), called by this module's
  name so that a test on the CPU can stand an emulation in for it."""
  return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   axis_name=axis_name)


def peer_bound(tokens: int, k: int, local: int, ep: int, exchange: float) -> int:
  """The most choices a device sends one peer: `exchange` times the even share of its tokens x k choices
  (0: no bound), and never more than a peer can take, min(k, local) per token (a token's k are distinct)."""
  most = tokens * min(k, local)
  return most if exchange <= 0 else min(most, math.ceil(exchange * tokens * k / ep))


def _ragged_exchange(x_sorted_ND: jax.Array, expert_N: jax.Array,
                     mlp: Callable[[jax.Array, jax.Array], jax.Array], *, local: int, ep: int, bound: int,
                     axes: tuple[str, ...]) -> jax.Array:
  """The outputs (N, D) of the choices sorted by expert, each peer sent exactly its run of them (the first
  `bound`; the rest get zeros) by `ragged_all_to_all`, one slice per expert. A receiver writes the rows
  expert by expert, peer 0's first, into ep x bound rows (the most it can be sent), so its grouped matmul
  gets them sorted. One all_gather of every device's count per expert gives every offset, there and back.

  Slices are indexed (S, P, G): from device S to device P for P's expert G."""
  d, e = x_sorted_ND.shape[1], ep * local
  count_SPG = jax.lax.all_gather(jnp.bincount(expert_N, length=e + 1)[:e], axes).reshape(ep, ep, local)
  start_SPG = jnp.cumsum(count_SPG.reshape(ep, e), axis=1).reshape(ep, ep, local) - count_SPG
  reach_SPG = jnp.minimum(jnp.cumsum(count_SPG, axis=2), bound)  # Each peer's run, cut at the bound.
  sent_SPG = jnp.diff(reach_SPG, axis=2, prepend=0)
  taken_PG = jnp.sum(sent_SPG, axis=0)
  # Where a slice lands in its receiver: after the rows of the receiver's earlier experts, and of its own
  # expert from earlier senders.
  at_SPG = (jnp.cumsum(taken_PG, axis=1) - taken_PG)[None] + jnp.cumsum(sent_SPG, axis=0) - sent_SPG
  me = jax.lax.axis_index(axes)

  def sending(x_SPG: jax.Array) -> jax.Array:  # This device's slices as their sender, flat.
    return x_SPG[me].reshape(-1).astype(jnp.int32)

  def receiving(x_SPG: jax.Array) -> jax.Array:  # And as their receiver.
    return x_SPG[:, me].reshape(-1).astype(jnp.int32)

  rows = ep * bound
  recv_RD = ragged_all_to_all(x_sorted_ND, jnp.zeros_like(x_sorted_ND, shape=(rows, d)), sending(start_SPG),
                              sending(sent_SPG), sending(at_SPG), receiving(sent_SPG), axis_name=axes)
  group_R = jnp.searchsorted(jnp.cumsum(taken_PG[me]), jnp.arange(rows), side='right')  # local: none.
  y_RD = mlp(recv_RD, group_R)
  return ragged_all_to_all(y_RD, jnp.zeros_like(x_sorted_ND), receiving(at_SPG), receiving(sent_SPG),
                           receiving(start_SPG), sending(sent_SPG), axis_name=axes)


def _grouped_local(x_BLD, experts_BLA, routed_BLA, weights_BLA, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                   num_experts: int, expert_axes: tuple[str, ...], mlp_axes: tuple[str, ...], kernel: str,
                   tile: int, platform: str, exchange: float, ragged: bool,
                   activation: Callable[[jax.Array], jax.Array]
                   ) -> tuple[jax.Array, jax.Array]:
  """Dropless, one device's part inside `shard_map`: each routed choice through its expert alone (no
  slots), by a grouped matmul (`grouped.gated_mlp`). With experts split over `expert_axes`, the choices
  go to their experts' devices and back by all-to-all, ragged (`ragged`) or padded, each peer sent at most
  `peer_bound` of them; the ones past it are dropped. Returns (y_BLD, kept_BLA)."""
  b, length, d = x_BLD.shape
  k, local = experts_BLA.shape[-1], w_gate_EDF.shape[0]
  n = b * length * k  # N: this device's choices.
  expert_N = jnp.where(routed_BLA, experts_BLA, num_experts).reshape(n)  # E: padding, routed nowhere.
  x_TD = x_BLD.reshape(b * length, d)  # Choice i is token i // k's.
  # Tiles for the rows a device expects to compute, as many as its own choices: the padded exchange's
  # buffers hold `exchange` times more, mostly padding that no tile covers.
  tile = grouped.tile_rows(n, local, tile, platform)

  def mlp(x_RD: jax.Array, group_R: jax.Array) -> jax.Array:
    y_RD = grouped.gated_mlp(x_RD, group_R, w_gate_EDF, w_up_EDF, w_down_EFD, activation, kernel=kernel,
                             tile=tile)
    return jax.lax.psum(y_RD, mlp_axes) if mlp_axes else y_RD  # Each device summed its part of F.

  if not expert_axes:
    y_ND, kept_N = mlp(jnp.repeat(x_TD, k, axis=0), expert_N), routed_BLA.reshape(n)
  else:  # Sorted by expert, so by peer: peer j's choices are a run of the sorted ones.
    ep = num_experts // local
    bound = peer_bound(b * length, k, local, ep, exchange)
    order_N = jnp.argsort(expert_N, stable=True)
    count_P = jnp.bincount(expert_N // local, length=ep + 1)[:ep]
    start_P = jnp.cumsum(count_P) - count_P
    # Each choice's peer (ep: padding) and place in the run it sends that peer.
    rank_N = grouped.ranks(order_N)
    peer_N = jnp.minimum(expert_N // local, ep)
    sender_N = jnp.minimum(peer_N, ep - 1)  # A real peer for every choice (padding: masked by kept_N).
    place_N = rank_N - start_P[sender_N]
    kept_N = (peer_N < ep) & (place_N < bound)
    if ragged:
      y_sorted_ND = _ragged_exchange(x_TD[order_N // k], expert_N, mlp, local=local, ep=ep, bound=bound,
                                     axes=expert_axes)
      y_ND = y_sorted_ND[rank_N]
    else:  # Each peer sent `bound` rows: its run, then zeros.
      sent_PB = jnp.arange(bound)[None, :] < count_P[:, None]
      at_PB = order_N[jnp.minimum(start_P[:, None] + jnp.arange(bound)[None, :], n - 1)]
      send_PBD = jnp.where(sent_PB[..., None], x_TD[at_PB // k], 0)
      group_PB = jnp.where(sent_PB, expert_N[at_PB] % local, local)
      # Row i of what arrives came from peer i; the outputs go back to the same places.
      recv_PBD = jax.lax.all_to_all(send_PBD, expert_axes, 0, 0, tiled=True)
      group_PB = jax.lax.all_to_all(group_PB, expert_axes, 0, 0, tiled=True)
      y_RD = mlp(recv_PBD.reshape(ep * bound, d), group_PB.reshape(-1))
      y_PBD = jax.lax.all_to_all(y_RD.reshape(ep, bound, d), expert_axes, 0, 0, tiled=True)
      y_ND = y_PBD[sender_N, jnp.minimum(place_N, bound - 1)]
    y_ND = jnp.where(kept_N[:, None], y_ND, 0)
  kept_BLA = kept_N.reshape(b, length, k)
  y_BLAD = y_ND.reshape(b, length, k, d)
  weights_BLA = jnp.where(kept_BLA, weights_BLA, 0).astype(y_BLAD.dtype)
  return matmul('BLAD,BLA->BLD', y_BLAD, weights_BLA), kept_BLA


def expert_layout(rules: AxisRules) -> tuple[P, P, P, tuple[str, ...], tuple[str, ...]]:
  """(tokens' spec, expert-in spec, expert-out spec, expert mesh axes, mlp mesh axes) of the MoE layer."""
  batch = rules.activation_spec(BLD)[0]
  w_in = rules.activation_spec(EXPERT_IN, 'experts (E, D, F)')
  batch_axes, expert_axes, mlp_axes = spec_axes(batch), spec_axes(w_in[0]), spec_axes(w_in[2])
  if w_in[1] is not None or set(batch_axes) & set(mlp_axes) or not set(expert_axes) <= set(batch_axes):
    raise ValueError(f'A mixture-of-experts layer needs `embed` replicated and `batch` split over the mesh '
                     f'axes of `expert` ({_names(expert_axes)}) and not over those of `mlp` '
                     f'({_names(mlp_axes)}); partitioning.rules split `batch` over {_names(batch_axes)}. '
                     'Change those rules.')
  return P(batch, None, None), w_in, rules.activation_spec(EXPERT_OUT), expert_axes, mlp_axes


def _names(axes: tuple[str, ...]) -> str:
  return ' x '.join(axes) or 'none'


def statistics(logits_BLE: jax.Array, probs_BLE: jax.Array, experts_BLA: jax.Array, kept_BLA: jax.Array,
               tokens_BL: jax.Array | None) -> dict[str, jax.Array]:
  """The auxiliary losses and routing statistics, averaged over the routed tokens (`tokens_BL`; None: all)."""
  e, k = logits_BLE.shape[-1], experts_BLA.shape[-1]
  weight_BL = jnp.ones_like(logits_BLE[..., 0]) if tokens_BL is None else tokens_BL.astype(jnp.float32)
  routed = jnp.maximum(jnp.sum(weight_BL), 1.0)

  def mean(x_BL: jax.Array) -> jax.Array:
    return jnp.sum(x_BL * weight_BL) / routed

  onehot_BLAE = jax.nn.one_hot(experts_BLA, e, dtype=jnp.float32)
  share_E = jnp.sum(onehot_BLAE * weight_BL[:, :, None, None], axis=(0, 1, 2)) / (routed * k)
  prob_E = jnp.sum(probs_BLE * weight_BL[:, :, None], axis=(0, 1)) / routed
  return {
      'load_balance_loss': e * jnp.sum(share_E * prob_E),
      'router_z_loss': mean(jnp.square(jax.nn.logsumexp(logits_BLE, axis=-1))),
      'dropped_fraction': 1.0 - mean(jnp.mean(kept_BLA.astype(jnp.float32), axis=-1)),
      'expert_share': share_E,
  }


class MoE(nnx.Module):
  """The MLP of a mixture-of-experts block: (x_BLD) -> (y_BLD, statistics)."""

  def __init__(self, cfg, placement: Placement, *, rules: AxisRules, rngs: nnx.Rngs,
               activation: Callable[[jax.Array], jax.Array]):
    d, e, f = cfg.embed_dim, cfg.num_experts, cfg.expert_dim
    dtype = jnp.dtype(cfg.param_dtype)
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.router_DE = param(rngs, nnx.initializers.lecun_normal(), (d, e), ('embed', None), dtype, rules)
    if cfg.router_score == 'sigmoid':  # A parameter without gradient, moved by `after_step` instead.
      self.router_bias_E = param(rngs, nnx.initializers.zeros, (e,), (None,), jnp.float32, rules, decay=False)
    self.wi_gate_EDF = param(rngs, init, (e, d, f), EXPERT_IN, dtype, rules)
    self.wi_up_EDF = param(rngs, init, (e, d, f), EXPERT_IN, dtype, rules)
    self.wo_EFD = param(rngs, init, (e, f, d), EXPERT_OUT, dtype, rules)
    if cfg.shared_expert_dim:  # One more gated MLP every token takes (Qwen2-MoE: scaled by a sigmoid gate).
      s = cfg.shared_expert_dim
      dense = nnx.initializers.lecun_normal()
      if cfg.shared_expert_gate:
        self.shared_gate_D1 = param(rngs, dense, (d, 1), ('embed', None), dtype, rules)
      self.shared_wi_gate_DF = param(rngs, dense, (d, s), ('embed', 'mlp'), dtype, rules)
      self.shared_wi_up_DF = param(rngs, dense, (d, s), ('embed', 'mlp'), dtype, rules)
      self.shared_wo_FD = param(rngs, dense, (s, d), ('mlp', 'embed'), dtype, rules)
    self.cfg, self.rules, self.activation, self.platform = cfg, rules, activation, placement.platform

  def __call__(self, x_BLD: jax.Array, *, tokens_BL: jax.Array | None = None, dropless: bool = False,
               key: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`tokens_BL` (bool; None: all) marks the tokens to route: the others (padding) take no slot, get
    zeros and count in no statistic. `dropless=True` gives every expert L slots whatever the capacity
    factor (sampling). Capacity is per sequence, so the layer routes whole sequences: a `length` split
    over `context` is gathered at its entry and split again at its exit. `key`: the shared expert's LoRA
    adapters' dropout (`layers.gather_split`), training only."""
    cfg, rules, dtype = self.cfg, self.rules, x_BLD.dtype
    x_BLD = rules.reshard(x_BLD, ('batch', None, 'embed'))
    if tokens_BL is not None:
      tokens_BL = rules.reshard(tokens_BL, ('batch', None))
    e, k, length = cfg.num_experts, cfg.experts_per_token, x_BLD.shape[1]
    logits_BLE = jnp.einsum('BLD,DE->BLE', x_BLD, gather(self.router_DE, rules, dtype),
                            preferred_element_type=jnp.float32)
    bias_E = gather(self.router_bias_E, rules, jnp.float32) if cfg.router_score == 'sigmoid' else None
    probs_BLE, weights_BLA, experts_BLA = route(logits_BLE, k, cfg.router_norm_topk, bias_E=bias_E,
                                                groups=cfg.router_groups, group_topk=cfg.router_group_topk,
                                                scale=cfg.routed_scaling_factor)
    cap = capacity(length, e, k, 0.0 if dropless else cfg.capacity_factor)
    tokens, w_in, w_out, expert_axes, mlp_axes = expert_layout(rules)
    choice = P(tokens[0], None, None)
    specs = (tokens, choice, choice, choice, w_in, w_in, w_out)  # Tokens, three per choice, the experts.
    weights = (gather(self.wi_gate_EDF, rules, dtype), gather(self.wi_up_EDF, rules, dtype),
               gather(self.wo_EFD, rules, dtype))
    if cap == length and cfg.grouped_matmul != 'off':  # Dropless: each choice to its expert alone.
      routed_BLA = jax.sharding.reshard(jnp.ones(experts_BLA.shape, bool) if tokens_BL is None else
                                        jnp.broadcast_to(tokens_BL[:, :, None], experts_BLA.shape), choice)
      body = jax.shard_map(
          lambda *args: _grouped_local(*args, num_experts=e, expert_axes=expert_axes, mlp_axes=mlp_axes,
                                       kernel=cfg.grouped_matmul, tile=cfg.moe_tile, platform=self.platform,
                                       exchange=cfg.expert_exchange_factor,
                                       ragged=cfg.expert_exchange == 'ragged', activation=self.activation),
          in_specs=specs, out_specs=(tokens, choice))
      y_BLD, kept_BLA = body(jax.sharding.reshard(x_BLD, tokens), experts_BLA, routed_BLA,
                             weights_BLA.astype(dtype), *weights)
    else:
      slot_BLA, kept_BLA = slots(experts_BLA, e, cap, tokens_BL)
      body = jax.shard_map(
          lambda *args: _experts_local(*args, num_experts=e, cap=cap, expert_axes=expert_axes,
                                       mlp_axes=mlp_axes, activation=self.activation),
          in_specs=specs, out_specs=tokens)
      y_BLD = body(jax.sharding.reshard(x_BLD, tokens), slot_BLA, kept_BLA, weights_BLA.astype(dtype),
                   *weights)
    y_BLD = rules.reshard(y_BLD, BLD)
    if cfg.shared_expert_dim:
      y_BLD = y_BLD + self._shared(x_BLD, key)
    return y_BLD, statistics(logits_BLE, probs_BLE, experts_BLA, kept_BLA, tokens_BL)

  def _shared(self, x_BLD: jax.Array, key: jax.Array | None = None) -> jax.Array:
    rules, dtype = self.rules, x_BLD.dtype
    (w_gate_DF, gate), (w_up_DF, up), (w_down_FD, down) = (
        gather_split(w, rules, dtype, fold(key, i))
        for i, w in enumerate((self.shared_wi_gate_DF, self.shared_wi_up_DF, self.shared_wo_FD)))
    gate_BLF = plus(matmul('BLD,DF->BLF', x_BLD, w_gate_DF), gate, x_BLD)
    up_BLF = plus(matmul('BLD,DF->BLF', x_BLD, w_up_DF), up, x_BLD)
    h_BLF = rules.reshard(self.activation(gate_BLF) * up_BLF, ('batch', 'length', 'mlp'))
    y_BLD = plus(matmul('BLF,FD->BLD', h_BLF, w_down_FD, rules.activation_spec(BLD)), down,
                 h_BLF)
    if not self.cfg.shared_expert_gate:
      return y_BLD
    gate_BL1 = jax.nn.sigmoid(matmul('BLD,DO->BLO', x_BLD, gather(self.shared_gate_D1, rules, dtype)))
    return y_BLD * gate_BL1
