"""Analytic FLOPs of a train step and parameter counts, MaxText convention.

Only matmuls count, each as 2*m*n*k FLOPs; the backward pass costs twice the
forward (gradients for the input and for the weight), so a train step is 3x
forward. The embedding lookup is a gather (0 FLOPs); the logits projection is a
matmul whether or not it is tied to the embedding. Attention scores and the
probability-value product are halved for the causal mask, as MaxText,
Megatron-LM and NeMo do, although the model computes the full score matrix.
Norms, softmax, RoPE, the loss and the optimizer are left out: they are small
next to the matmuls and depend on the implementation, not on the model.

Shape letters: D embed, F mlp, H heads, K head dim, V vocab, L length.
"""

from __future__ import annotations

import ml_collections

from mintrain.models import model_config
from mintrain.models.mlp import MLPConfig
from mintrain.models.transformer import TransformerConfig


def transformer_forward_flops_per_token(cfg: TransformerConfig, seq_len: int, *,
                                        causal_half: bool = True) -> dict[str, float]:
  """Forward matmul FLOPs per token, by part (all layers summed)."""
  d, f, h, k = cfg.embed_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim
  attention = 4 * seq_len * h * k  # Scores (q.k) and probs @ v: 2*L*H*K each per query.
  if causal_half:
    attention /= 2
  return {
      'qkv': cfg.num_layers * 2 * d * 3 * h * k,
      'attention': cfg.num_layers * attention,
      'out_proj': cfg.num_layers * 2 * h * k * d,
      'mlp': cfg.num_layers * 2 * d * f * 3,  # Gate, up and down.
      'logits': 2 * d * cfg.vocab_size,
  }


def transformer_flops_per_token(cfg: TransformerConfig, seq_len: int, *, causal_half: bool = True) -> float:
  """Training (forward + backward) FLOPs per token."""
  return 3 * sum(transformer_forward_flops_per_token(cfg, seq_len, causal_half=causal_half).values())


def mlp_flops_per_example(cfg: MLPConfig) -> float:
  """Training FLOPs per example (3x forward, as for the transformer).

  The first layer needs no input gradient, so XLA does 2 * in * out fewer FLOPs
  there than this count; the convention counts every matmul the same way.
  """
  dims = (cfg.input_dim, *cfg.hidden_dims, cfg.num_classes)
  return 3 * sum(2 * a * b for a, b in zip(dims[:-1], dims[1:]))


def tokens_per_step(config: ml_collections.ConfigDict) -> int:
  """Tokens (transformer) or examples (mlp) per optimizer step, over all micro-batches."""
  per_row = config.train.seq_len if config.model.name == 'transformer' else 1
  return config.train.global_batch_size * per_row


def train_flops_per_step(config: ml_collections.ConfigDict, *, causal_half: bool = True) -> float:
  """Model FLOPs of one optimizer step over the whole global batch; divide by devices for per device.

  `causal_half=False` counts the full attention score matrix, which is what
  XLA computes (and what `cost_analysis()` reports).
  """
  cfg = model_config(config.model)
  if isinstance(cfg, TransformerConfig):
    per_token = transformer_flops_per_token(cfg, config.train.seq_len, causal_half=causal_half)
  else:
    per_token = mlp_flops_per_example(cfg)
  return per_token * tokens_per_step(config)


def param_count(config: ml_collections.ConfigDict) -> int:
  """Number of parameters of `config.model`, embedding (and unembedding) included."""
  cfg = model_config(config.model)
  if isinstance(cfg, TransformerConfig):
    d, f, h, k, v = cfg.embed_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim, cfg.vocab_size
    block = 4 * d * h * k + 3 * d * f + 2 * d  # q, k, v, out; gate, up, down; two norm scales.
    return v * d + cfg.num_layers * block + d + (0 if cfg.tie_embeddings else d * v)
  dims = (cfg.input_dim, *cfg.hidden_dims, cfg.num_classes)
  return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))
