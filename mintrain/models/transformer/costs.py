"""What a transformer costs, as methods of its config (`TransformerConfig` mixes them in): FLOPs in
MaxText's convention (`mintrain.report`), the parameter count and the activations the backward pass keeps."""

from __future__ import annotations

import numpy as np

from mintrain.models.family import Ways
from mintrain.models.pipeline import UNPIPELINED, Schedule
from mintrain.models.transformer import moe
from mintrain.models.transformer.query_blocks import keys_scored


class Costs:
  """Reads the options of `TransformerConfig`, which it is a base of."""

  def forward_flops_per_token(self, seq_len: int, *, causal_half: bool = True) -> dict[str, float]:
    """Forward matmul FLOPs per token, by part (all layers summed)."""
    d, f, h, k = self.embed_dim, self.mlp_dim, self.num_heads, self.head_dim
    qk, v = self._qk_dim, self.value_dim
    # Scores (q.k) and probs @ v: 2*H*(qk + v) per query and key it attends to.
    keys = sum(self._keys_per_query(i, seq_len, causal_half) for i in range(self.num_layers))
    moe_layers = self.moe_layers
    flops = {
        'qkv': self.num_layers * (self._mla_projections() if self.mla
                                  else 2 * d * (h + 2 * self.kv_heads) * k),
        'attention': 2 * h * (qk + v) * keys,
        'out_proj': self.num_layers * 2 * h * v * d,
        'mlp': (self.num_layers - moe_layers) * 2 * d * f * 3,  # Gate, up and down.
        'logits': 2 * d * self.vocab_size,
    }
    if moe_layers:  # The active experts only: k of E per token; and the router, and the shared expert.
      flops['router'] = moe_layers * 2 * d * self.num_experts
      flops['experts'] = moe_layers * self.experts_per_token * 2 * d * self.expert_dim * 3
      if self.shared_expert_dim:
        gate = 2 * d if self.shared_expert_gate else 0
        flops['shared_expert'] = moe_layers * (2 * d * self.shared_expert_dim * 3 + gate)
    return flops

  def _keys_per_query(self, layer: int, seq_len: int, causal_half: bool) -> float:
    """Keys a query of layer `layer` attends to, on average over the sequence: half of them causally, and
    on a local layer the window's (W (L - W/2) / L for a window W < L); without `causal_half`, the keys
    it scores (`_keys_scored`)."""
    window = self.window(layer)
    if not causal_half:
      return self._keys_scored(layer, seq_len)
    if not window or window >= seq_len:
      return seq_len / 2
    return window * (seq_len - window / 2) / seq_len

  def _keys_scored(self, layer: int, seq_len: int, split: bool = False) -> float:
    """Keys a query of layer `layer` scores, on average: the einsum's blocks' (`query_blocks`) unless the
    length is `split` over `context`; `dot_product` scores every key."""
    if self.attention != 'einsum' or split:
      return seq_len
    return keys_scored(seq_len, self.attention_block_rows(seq_len), self.window(layer))

  @property
  def _qk_dim(self) -> int:
    """Each query and key head's width: latent attention's N + P, else head_dim."""
    return self.qk_nope_head_dim + self.head_dim if self.mla else self.head_dim

  def _mla_projections(self) -> int:
    """Latent attention's matmul FLOPs per token before the scores: the queries (through their latent),
    the key/value latent and rotary key, and every head's keys and values from the latent."""
    d, h, q, r = self.embed_dim, self.num_heads, self.q_lora_rank, self.kv_lora_rank
    queries = 2 * (d * q + q * h * self._qk_dim) if q else 2 * d * h * self._qk_dim
    return queries + 2 * d * (r + self.head_dim) + 2 * r * h * (self.qk_nope_head_dim + self.value_dim)

  def train_flops_per_row(self, seq_len: int, causal_half: bool = True) -> float:
    """Training (forward + backward) FLOPs of one sequence."""
    return 3 * sum(self.forward_flops_per_token(seq_len, causal_half=causal_half).values()) * seq_len

  def param_count(self) -> int:
    d, f, h, k, v = self.embed_dim, self.mlp_dim, self.num_heads, self.head_dim, self.vocab_size
    block = 2 * d * (h + self.kv_heads) * k + 2 * d  # q, k, v, out; two norms.
    if self.mla:  # Its projections (`_mla_projections`, one FLOP pair per weight), latent norms and out.
      q, r = self.q_lora_rank, self.kv_lora_rank
      block = self._mla_projections() // 2 + (q + r) + h * self.value_dim * d + 2 * d
    block += (h + 2 * self.kv_heads) * k if self.qkv_bias else 0
    block += 2 * k if self.qk_norm else 0  # One scale for the queries', one for the keys' heads.
    # Router, experts' gate, up and down.
    moe_mlp = d * self.num_experts + self.num_experts * 3 * d * self.expert_dim
    moe_mlp += 3 * d * self.shared_expert_dim + d * self.shared_expert_gate if self.shared_expert_dim else 0
    moe_mlp += self.num_experts if self.router_score == 'sigmoid' else 0  # Its balancing bias.
    mlps = (self.num_layers - self.moe_layers) * 3 * d * f + self.moe_layers * moe_mlp
    return v * d + self.num_layers * block + mlps + d + (0 if self.tie_embeddings else d * v)

  def activation_bytes(self, rows: int, seq_len: int, ways: Ways, schedule: Schedule = UNPIPELINED) -> int:
    """What the backward pass keeps for `rows` sequences on one device.

    Per layer, what autodiff saves (`_layer_bytes`); plus the float32 logits and their softmax (with the
    fused loss, one chunk's at a time, and the hidden states' gradient that it keeps instead). Pipelined
    (`schedule`), each step of the schedule runs a stage's block of 1 / (S R) of the layers on a microbatch
    of 1 / M of the rows, and its scan keeps every step's, the idle ones' too, and one step's more while
    copying it into or out of the stack; the loss still sees all the rows.
    """
    c = np.dtype(self.compute_dtype).itemsize
    pipelined = schedule.stages > 1
    layer, once = self._layer_bytes(rows // schedule.microbatches if pipelined else rows, seq_len, ways)
    if pipelined:
      block = self.num_layers // (schedule.stages * schedule.repeats)
      layers = (schedule.iterations + 1) * block * layer + once
    else:
      layers = self.num_layers * layer + once
    tokens = rows * seq_len / ways('length')
    chunks = self.loss_chunks
    logits = 2 * 4 * self.vocab_size / ways('vocab') / max(chunks, 1)  # Float32, and softmax.
    loss_grad = c * self.embed_dim if chunks > 0 else 0  # The fused loss keeps d loss / d hidden states.
    return int(layers + tokens * (logits + loss_grad + c * self.embed_dim))

  def _layer_bytes(self, rows: int, seq_len: int, ways: Ways) -> tuple[float, float]:
    """(what one layer keeps for `rows` sequences, on average over the layers; what is live once beside).

    Each norm's normalised and scaled input, the residual sum and the layer's output; q, k, v and the
    heads' output; the attention scores (float32) and probabilities of the keys scored; gate, up, SiLU's
    three and their product. With remat, a layer keeps only its input ('full') or its input and its
    matmul outputs ('save_matmuls'), and one layer's full activations are live again while its backward
    pass recomputes them. With `length` split (`mesh.context`) a device keeps its share of the tokens,
    each still scoring every key, and the keys and values it gathered.
    """
    c, d = np.dtype(self.compute_dtype).itemsize, self.embed_dim
    heads, mlp = self.num_heads / ways('heads'), self.mlp_dim / ways('mlp')
    tokens = rows * seq_len / ways('length')  # This device's queries.
    split = ways('length') > 1
    scored = sum(self._keys_scored(i, seq_len, split) for i in range(self.num_layers)) / self.num_layers
    # Norms (2 each), residual sum and output; q/k/v/out; gate/up/SiLU's/product; scores and probabilities.
    per_token_layer = (c * (6 * d + 2 * heads * (self._qk_dim + self.value_dim) + 6 * mlp)
                       + heads * scored * (4 + c))
    if self.mla:  # The latents: queries', keys' and values' (normed and not), and the rotary key.
      per_token_layer += c * (2 * self.q_lora_rank + 2 * self.kv_lora_rank + 2 * self.head_dim)
    if self.qk_norm:  # The normed queries and keys, inputs of RoPE (at most as many key heads as queries).
      per_token_layer += c * 2 * heads * self.head_dim
    # An MoE layer instead: float32 router logits and probabilities, and for each of its slots (E x C per
    # sequence, wherever expert parallelism moves them) the token in and out and the gate/up/product.
    k, slots = self.experts_per_token, 0
    if self.num_experts and self.capacity_factor == 0 and self.grouped_matmul != 'off':
      # Its choices, and with the experts split what it may receive for its own (`moe.peer_bound` from each
      # peer, either exchange); tiles hold 1.5x at most.
      ep = ways('expert')
      received = ep * moe.peer_bound(seq_len, k, self.num_experts // ep, ep, self.expert_exchange_factor)
      slots = (received if ep > 1 else seq_len * k) * 1.5
    elif self.num_experts:
      slots = self.num_experts * moe.capacity(seq_len, self.num_experts, k, self.capacity_factor)
    expert_mlp = self.expert_dim / ways('mlp')
    moe_layer = (per_token_layer - c * 6 * mlp + 2 * 4 * self.num_experts
                 + slots / seq_len * c * (2 * d + 3 * expert_mlp)
                 + c * 3 * self.shared_expert_dim / ways('mlp'))
    moe_layers = self.moe_layers
    # Keys and values of the whole sequence, gathered (all_gather; the ring keeps as much, block by block).
    gathered = 2 * c * heads * self.head_dim * rows * seq_len if ways('length') > 1 else 0
    dense_full, moe_full = tokens * per_token_layer + gathered, tokens * moe_layer + gathered
    if self.remat != 'none':
      # Input; plus, when saving matmuls, q/k/v, the attention projection, gate, up and down outputs.
      kept = c * d if self.remat == 'full' else c * (3 * d + 3 * heads * self.head_dim + 2 * mlp)
      return tokens * kept, moe_full if moe_layers else dense_full  # One layer's, recomputed.
    n = self.num_layers
    return ((n - moe_layers) * dense_full + moe_layers * moe_full) / n, 0.0
