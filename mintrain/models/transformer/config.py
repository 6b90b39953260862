"""The transformer's `model` section: its options, their checks and what the platform and mesh decide.

Shape letters (the whole family): B batch, L length (M for keys), S cache length, D embed, F mlp,
H heads, G key/value heads, K head dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax

from mintrain.data import synthetic, tokenizer
from mintrain.errors import ConfigError
from mintrain.fields import option
from mintrain.models.family import ModelConfig, Placement
from mintrain.models.layers import LINEAR_OPTIONS, linear_for_platform
from mintrain.models.pipeline import Schedule
from mintrain.models.transformer.costs import Costs

# What a rematerialised block keeps for the backward pass (`model.REMAT_POLICIES`); 'none' keeps everything.
REMAT_OPTIONS = ('none', 'full', 'save_matmuls')
ATTENTION_OPTIONS = ('einsum', 'dot_product')
CONTEXT_ATTENTION_OPTIONS = ('all_gather', 'ring')
DTYPES = ('float32', 'bfloat16')
# The gate's nonlinearity: SwiGLU (Llama, Mistral, Qwen2) or GeGLU with tanh-approximated GELU (Gemma).
ACTIVATIONS = {'silu': jax.nn.silu, 'gelu_tanh': functools.partial(jax.nn.gelu, approximate=True)}
# How RoPE's frequencies stretch to longer contexts, as transformers' `rope_type`s (`attention`).
ROPE_SCALINGS = ('none', 'llama3', 'linear', 'dynamic', 'yarn')
ROUTER_SCORES = ('softmax', 'sigmoid')
GROUPED_MATMUL_OPTIONS = ('auto', 'ragged_dot', 'tiles', 'mosaic_gpu', 'off')
EXPERT_EXCHANGE_OPTIONS = ('auto', 'ragged', 'padded')
RAGGED_EXCHANGE_PLATFORMS = ('gpu', 'tpu')  # Where XLA implements ragged-all-to-all (XLA:CPU does not).
MOSAIC_GPU_DTYPES = {'gpu': ('bfloat16',)}  # Where grouped_matmul=mosaic_gpu runs, in which compute dtypes.


def _even(value: int) -> str | None:
  return None if value % 2 == 0 else 'must be even for rotary embeddings'


@dataclasses.dataclass(frozen=True)
class TransformerConfig(Costs, ModelConfig):
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
  # RoPE's frequency scaling: Llama 3.1's ('llama3'), positions divided by the factor ('linear'), NTK by
  # the sequence's length past rope_original_max_len ('dynamic') or YaRN ('yarn'); 'none' leaves it out.
  rope_scaling: str = option(choices=ROPE_SCALINGS)
  rope_scaling_factor: float = option(above=0)
  rope_low_freq_factor: float = option(above=0)
  rope_high_freq_factor: float = option(above=0)
  rope_original_max_len: int = option(at_least=1)
  rope_beta_fast: float = option(above=0)  # YaRN: a frequency turning more often over the context is kept.
  rope_beta_slow: float = option(above=0)  # YaRN: one turning less often is divided by the factor.
  rope_attention_factor: float = option(at_least=0)  # YaRN: scale of cos and sin; 0: 0.1 ln(factor) + 1.
  rope_truncate: bool = option()  # YaRN: round the blend's range of dimensions outwards to integers.
  norm_eps: float = option(above=0)  # RMSNorm's epsilon.
  norm_plus_one: bool = option()  # Gemma: norms scale by (1 + weight), weights drawn as zeros.
  embed_scale: bool = option()  # Gemma: embeddings times sqrt(embed_dim) (not the tied output layer).
  qkv_bias: bool = option()  # Qwen2: biases on the query, key and value projections.
  qk_norm: bool = option()  # Qwen3: RMSNorm of each query and key head over head_dim, before RoPE.
  # Local layers attend over the last `sliding_window` positions only (a query sees itself and the
  # window - 1 before it); 0: no window. Every layer is local (Mistral) unless `global_every` says.
  sliding_window: int = option(at_least=0)
  global_every: int = option(at_least=0)  # With a window, layer i is global if (i + 1) % N == 0; 0: none is.
  rope_local_base: float = option(at_least=0)  # Gemma 3: local layers' RoPE base, unscaled; 0: as global.
  attn_softcap: float = option(at_least=0)  # Gemma 2: scores become cap * tanh(scores / cap); 0: none.
  final_softcap: float = option(at_least=0)  # Gemma 2: the same on the output logits; 0: none.
  query_scale: float = option(at_least=0)  # Scores times query_scale ** -0.5 (Gemma's pre-attn scalar); 0: K.
  post_norms: bool = option()  # Gemma 2 and 3: RMSNorm of the attention's and the MLP's outputs too.
  # DeepSeek's multi-head latent attention (`mla`) when kv_lora_rank > 0: keys and values from a latent of
  # that width; head_dim is then the rotary part of each query and key head, qk_nope_head_dim the rest.
  kv_lora_rank: int = option(at_least=0)
  q_lora_rank: int = option(at_least=0)  # Queries through a normed latent of this width; 0: one projection.
  qk_nope_head_dim: int = option(at_least=0)
  v_head_dim: int = option(at_least=0)  # Of each value head (0: head_dim); MLA only.
  rope_interleave: bool = option()  # MLA: checkpoints store the rotary dims as interleaved pairs.
  # MLA under YaRN: scores also times mscale^2 = (0.1 * this * ln(rope_scaling_factor) + 1)^2; 0: not.
  mla_mscale_all_dim: float = option(at_least=0)
  mlp_activation: str = option(choices=tuple(ACTIVATIONS))
  dropout_rate: float = option(at_least=0, below=1)
  param_dtype: str = option(choices=DTYPES)
  compute_dtype: str = option(choices=DTYPES)
  remat: str = option(choices=REMAT_OPTIONS)
  scan_layers: bool = option()
  attention: str = option(choices=ATTENTION_OPTIONS)
  attention_block: int = option(at_least=0)  # Query rows per causal block of the einsum; 0: by the length.
  context_attention: str = option(choices=CONTEXT_ATTENTION_OPTIONS)
  mlp_overlap: bool = option()
  loss_chunks: int = option(at_least=-1)  # -1: auto; 0: logits, then loss; N: fused over N chunks.
  linear: str = option(choices=LINEAR_OPTIONS)  # How weight matmuls form their gradient.
  num_experts: int = option(at_least=0)  # E experts in each MoE layer; 0: every MLP dense.
  experts_per_token: int = option(at_least=1)  # k: experts each token is routed to.
  moe_every: int = option(at_least=1)  # Block i is MoE when (i + 1) % N == 0 (Qwen2-MoE's sparse step).
  dense_layers: tuple[int, ...] = option()  # Blocks kept dense whatever moe_every says (mlp_only_layers).
  expert_mlp_dim: int = option(at_least=0)  # F of each expert; 0: mlp_dim.
  shared_expert_dim: int = option(at_least=0)  # Width of an expert every token takes; 0: none.
  shared_expert_gate: bool = option()  # Qwen2-MoE: the shared expert scaled by a sigmoid gate (DeepSeek not).
  capacity_factor: float = option(at_least=0)  # Slots per expert: factor * L * k / E; 0: dropless.
  # Dropless experts' matmul: 'ragged_dot' (TPU), 'tiles' (tiles of moe_tile rows; CPU, GPU),
  # 'mosaic_gpu' (JAX's Mosaic GPU grouped matmuls: Hopper GPUs, bfloat16), 'auto' (by platform) or 'off'
  # (every expert gets all L slots: E / k times the work).
  grouped_matmul: str = option(choices=GROUPED_MATMUL_OPTIONS)
  moe_tile: int = option(at_least=0)  # Rows of a 'tiles' tile; 0: by the rows and experts.
  # Dropless with experts split: choices a device sends each peer, times the even share; 0: all (exact).
  expert_exchange_factor: float = option(at_least=0)
  # How they travel: 'ragged' (each peer sent exactly its choices; GPU, TPU), 'padded' (each peer sent room
  # for the bound) or 'auto' (ragged where the platform has it).
  expert_exchange: str = option(choices=EXPERT_EXCHANGE_OPTIONS)
  router_norm_topk: bool = option()  # Renormalise the top-k probabilities to sum to 1 (Mixtral).
  # 'softmax' (Mixtral, Qwen) or 'sigmoid' scores (DeepSeek-V3: chosen by score + a balancing bias that
  # takes no gradient and moves by router_bias_rate per step, weighted by the score alone).
  router_score: str = option(choices=ROUTER_SCORES)
  router_groups: int = option(at_least=1)  # DeepSeek-V3: experts in groups; tokens pick from the best...
  router_group_topk: int = option(at_least=1)  # ... this many groups (by the sum of each one's top two).
  routed_scaling_factor: float = option(above=0)  # The routed experts' weights times this.
  router_bias_rate: float = option(at_least=0)  # Bias += rate * sign(mean load - load) per step; 0: fixed.
  router_z_loss_weight: float = option(at_least=0)  # Of mean(logsumexp(router logits)^2) in the objective.
  load_balance_loss_weight: float = option(at_least=0)  # Of E * sum_e f_e * p_e in the objective.
  # DeepSeek-V3's multi-token prediction: N more blocks in training, depth k predicting the token k + 1
  # ahead; their mean loss, times mtp_loss_weight, joins the objective. 0: none.
  mtp_layers: int = option(at_least=0)
  mtp_loss_weight: float = option(at_least=0)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def grouped(self) -> bool:
    return self.kv_heads != self.num_heads

  @property
  def yarn_attention_factor(self) -> float:
    """YaRN's scale of cos and sin: rope_attention_factor, or by default 0.1 ln(factor) + 1."""
    factor = self.rope_scaling_factor
    return self.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

  @property
  def score_scale(self) -> float:
    return (self.query_scale or self.head_dim) ** -0.5

  def attention_block_rows(self, seq_len: int) -> int:
    """Query rows per block of the einsum path's causal self-attention: `attention_block`, or (0) an
    eighth of the sequence and at least 64 rows, the fastest measured on the CPU (BENCHMARKS.md)."""
    return min(self.attention_block or max(64, seq_len // 8), seq_len)

  def window(self, layer: int) -> int:
    """Layer `layer`'s attention window: sliding_window on a local layer, 0 (none) on a global one."""
    is_global = self.global_every and (layer + 1) % self.global_every == 0
    return 0 if is_global else self.sliding_window

  @property
  def mixed_windows(self) -> bool:
    return len({self.window(i) for i in range(self.num_layers)}) > 1

  @property
  def mla(self) -> bool:
    return self.kv_lora_rank > 0

  @property
  def mla_softmax_scale(self) -> float:
    """MLA's softmax scale: 1 / sqrt(N + P), times YaRN's mscale squared (as `yarn_apply_mscale`)."""
    scale, factor = (self.qk_nope_head_dim + self.head_dim) ** -0.5, self.rope_scaling_factor
    if self.rope_scaling != 'none' and self.mla_mscale_all_dim and factor > 1:
      scale *= (0.1 * self.mla_mscale_all_dim * math.log(factor) + 1.0) ** 2
    return scale

  @property
  def value_dim(self) -> int:
    return self.v_head_dim or self.head_dim

  @property
  def expert_dim(self) -> int:
    return self.expert_mlp_dim or self.mlp_dim

  def is_moe(self, layer: int) -> bool:
    return self.num_experts > 0 and (layer + 1) % self.moe_every == 0 and layer not in self.dense_layers

  @property
  def moe_layers(self) -> int:
    return sum(self.is_moe(i) for i in range(self.num_layers))

  def kv_heads_axis(self, placement: Placement) -> str | None:
    """The logical axis of the key/value heads: `heads` when they are the query heads (multi-head),
    `kv_heads` when grouped, None when grouped but too few for the mesh's split (replicated)."""
    if not self.grouped:
      return 'heads'
    return 'kv_heads' if self.kv_heads % placement.ways('kv_heads') == 0 else None

  def for_tokenizer(self, num_ids: Callable[[], int]) -> TransformerConfig:
    """model.vocab_size=0 takes the tokenizer's ids, padded to a multiple of 128 so `vocab` splits."""
    if self.vocab_size:
      return self
    return dataclasses.replace(self, vocab_size=tokenizer.padded_vocab_size(num_ids()))

  def check(self, seq_len: int) -> None:
    if self.rope_scaling == 'llama3' and self.rope_high_freq_factor <= self.rope_low_freq_factor:
      raise ConfigError(f'model.rope_high_freq_factor={self.rope_high_freq_factor} must be above '
                        f'model.rope_low_freq_factor={self.rope_low_freq_factor} (Llama 3 RoPE scaling).')
    if self.rope_scaling == 'dynamic' and self.head_dim == 2:
      raise ConfigError('model.rope_scaling=dynamic needs model.head_dim > 2 (NTK scales the base by a power '
                        'of head_dim / (head_dim - 2)).')
    if self.num_heads % self.kv_heads:
      raise ConfigError(f'model.num_kv_heads={self.num_kv_heads} must divide model.num_heads='
                        f'{self.num_heads} (each key/value head serves the same number of query heads), or '
                        'be 0 (as many as num_heads).')
    if self.scan_layers and self.mixed_windows:
      raise ConfigError('model.scan_layers needs identical blocks; with model.global_every='
                        f'{self.global_every} some layers are local (sliding window) and some global. Set '
                        'model.scan_layers=False.')
    if self.attention == 'dot_product' and self.attn_softcap:
      raise ConfigError(f'model.attn_softcap={self.attn_softcap} is not in jax.nn.dot_product_attention; use '
                        "model.attention='einsum'.")
    if self.final_softcap and self.loss_chunks > 0:
      raise ConfigError(f'model.final_softcap={self.final_softcap} is not in the fused loss; set '
                        'model.loss_chunks=0 (or -1).')
    if self.num_experts and self.experts_per_token > self.num_experts:
      raise ConfigError(f'model.experts_per_token={self.experts_per_token} must be at most model.num_experts='
                        f'{self.num_experts}.')
    if self.num_experts and self.scan_layers and 0 < self.moe_layers < self.num_layers:
      raise ConfigError(f'model.scan_layers needs identical blocks; with model.moe_every={self.moe_every} '
                        f'and model.dense_layers={self.dense_layers} some are dense and some MoE. Set '
                        'model.scan_layers=False.')
    outside = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
    if outside:
      raise ConfigError(f'model.dense_layers={self.dense_layers} names blocks {outside} of a model with '
                        f'model.num_layers={self.num_layers} (blocks 0..{self.num_layers - 1}).')
    if self.mla and (self.attention != 'einsum' or self.context_attention != 'all_gather' or self.grouped
                     or self.qkv_bias or self.qk_norm or self.sliding_window):
      raise ConfigError('model.kv_lora_rank > 0 (latent attention) runs with model.attention=einsum and '
                        'model.context_attention=all_gather, without num_kv_heads, qkv_bias, qk_norm or '
                        'sliding_window.')
    if not self.mla and (self.q_lora_rank or self.qk_nope_head_dim or self.v_head_dim):
      raise ConfigError('model.q_lora_rank, qk_nope_head_dim and v_head_dim are latent attention\'s; set '
                        'model.kv_lora_rank > 0 to use them, or leave them 0.')
    if self.num_experts and self.num_experts % self.router_groups:
      raise ConfigError(f'model.router_groups={self.router_groups} must divide model.num_experts='
                        f'{self.num_experts}.')
    group = self.num_experts // self.router_groups
    if self.router_groups > 1 and not (self.router_group_topk <= self.router_groups and group >= 2
                                       and self.experts_per_token <= self.router_group_topk * group):
      raise ConfigError(f'model.router_group_topk={self.router_group_topk} of model.router_groups='
                        f'{self.router_groups} groups of at least 2 experts must hold '
                        f'model.experts_per_token={self.experts_per_token} experts.')
    if self.mtp_layers and (self.context_attention == 'ring' or self.embed_scale or self.scan_layers):
      raise ConfigError('model.mtp_layers needs model.context_attention=all_gather, no embed_scale and '
                        'scan_layers=False.')
    if self.num_experts and self.mlp_overlap:
      raise ConfigError('model.mlp_overlap is for dense MLPs; set it False with model.num_experts > 0.')
    if self.loss_chunks > 0 and seq_len % self.loss_chunks:
      raise ConfigError(f'model.loss_chunks={self.loss_chunks} must be 0 (logits, then the loss), a positive '
                        f'divisor of train.seq_len={seq_len} (the fused loss over that many chunks), '
                        'or -1 (auto).')

  def for_platform(self, platform: str) -> TransformerConfig:
    """The fused loss and `linear`'s custom VJP were measured to help on CPU only (BENCHMARKS.md), so
    elsewhere 'auto' leaves them off until measured there. `ragged_dot` is a grouped matmul on TPUs only:
    XLA lowers it on CPUs and CUDA GPUs to a dense product masked per group (BENCHMARKS.md: 7.5x the dense
    MLP at 8 experts on an H200, 64x at 64), so tiles run there. The ragged exchange needs the platform's
    ragged-all-to-all."""
    auto = 1 if platform == 'cpu' and not self.final_softcap else 0
    chunks = self.loss_chunks if self.loss_chunks >= 0 else auto
    grouped_matmul = self.grouped_matmul
    if grouped_matmul == 'auto':
      grouped_matmul = 'ragged_dot' if platform == 'tpu' else 'tiles'
    if grouped_matmul == 'mosaic_gpu' and self.num_experts:
      if platform not in MOSAIC_GPU_DTYPES:
        raise ConfigError(f"model.grouped_matmul=mosaic_gpu runs JAX's Mosaic GPU kernels (Hopper GPUs); "
                          f'this run is on {platform}: use model.grouped_matmul=auto.')
      if self.compute_dtype not in MOSAIC_GPU_DTYPES[platform]:
        raise ConfigError(f'model.grouped_matmul=mosaic_gpu multiplies in bfloat16 only, not '
                          f'model.compute_dtype={self.compute_dtype}: set model.compute_dtype=bfloat16, or '
                          'model.grouped_matmul=tiles.')
    ragged = platform in RAGGED_EXCHANGE_PLATFORMS
    if self.expert_exchange == 'ragged' and not ragged:
      raise ConfigError(f'model.expert_exchange=ragged needs jax.lax.ragged_all_to_all, which XLA does not '
                        f"implement on {platform}; use 'padded' or 'auto' (ragged on GPU and TPU only).")
    exchange = self.expert_exchange if self.expert_exchange != 'auto' else 'ragged' if ragged else 'padded'
    return dataclasses.replace(self, loss_chunks=chunks, linear=linear_for_platform(self.linear, platform),
                               grouped_matmul=grouped_matmul, expert_exchange=exchange)

  def placement_notes(self, placement: Placement, seq_len: int) -> list[str]:
    ways = placement.ways('length')
    self._check_pipeline(placement.pipeline, ways)
    if self.context_attention == 'ring' and ways > 1 and seq_len % (2 * ways):
      raise ConfigError(f'model.context_attention=ring splits train.seq_len={seq_len} into 2 x {ways} chunks '
                        f'(two per device of the {ways}-way `length` split, for causal balance); use a '
                        f'multiple of {2 * ways}, or model.context_attention=all_gather.')
    chunk = seq_len // self.loss_chunks if self.loss_chunks > 0 else ways
    if chunk % ways:
      raise ConfigError(f'model.loss_chunks={self.loss_chunks} leaves chunks of {chunk} tokens, which the '
                        f'{ways}-way `length` split (mesh.context) does not divide; use fewer chunks.')
    notes = []
    if self.kv_heads_axis(placement) is None:
      notes.append(f'model.num_kv_heads={self.kv_heads} key/value heads do not split '
                   f'{placement.ways("kv_heads")} ways (the rules for `kv_heads`); they are replicated on '
                   'every device of that split.')
    return notes

  def _check_pipeline(self, schedule: Schedule, length_ways: int) -> None:
    """What the pipeline over mesh.stage (`models.pipeline`) needs of the model."""
    stages, repeats = schedule.stages, schedule.repeats
    if stages == 1:
      return
    if not self.scan_layers:
      raise ConfigError(f'mesh.stage={stages} pipelines the stacked layers; set model.scan_layers=True.')
    if self.num_layers % (stages * repeats):
      raise ConfigError(f'model.num_layers={self.num_layers} does not split into mesh.stage={stages} x '
                        f'pipeline.repeats={repeats} blocks; use a multiple of {stages * repeats} layers.')
    if self.num_experts or self.mtp_layers:
      raise ConfigError(f'mesh.stage={stages} does not run mixture-of-experts or multi-token prediction '
                        'models yet (their statistics are per batch, not per microbatch); set mesh.stage=1.')
    if self.dropout_rate and schedule.microbatches > 1:
      raise ConfigError(f'mesh.stage={stages} with pipeline.microbatches={schedule.microbatches} would draw '
                        'other dropout masks than one batch does; set model.dropout_rate=0 or '
                        'pipeline.microbatches=1.')
    if length_ways > 1:
      raise ConfigError(f'mesh.stage={stages} does not combine with a split `length` (mesh.context) yet; '
                        'set mesh.context=1 or mesh.stage=1.')
    if self.mlp_overlap:
      raise ConfigError(f'mesh.stage={stages} does not run the overlapped MLP (model.mlp_overlap) inside its '
                        'stages yet; set model.mlp_overlap=False or mesh.stage=1.')
    if repeats > 1 and schedule.microbatches < stages:
      raise ConfigError(f'pipeline.repeats={repeats} sends each microbatch round the {stages} stages again; '
                        f'it needs pipeline.microbatches >= mesh.stage={stages}.')

  def synthetic_rows(self, seed: int, step: int, rows, seq_len: int):
    return synthetic.token_rows(seed, step, rows, seq_len, self.vocab_size)

  def eval_metrics(self, loss: float) -> dict[str, float]:
    return {'eval_bits_per_token': loss / math.log(2)}
