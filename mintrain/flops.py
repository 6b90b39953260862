"""Analytic FLOPs of a train step and parameter counts, MaxText convention.

Only matmuls count, each as 2*m*n*k FLOPs; the backward pass costs twice the
forward (gradients for the input and for the weight), so a train step is 3x
forward. The embedding lookup is a gather (0 FLOPs); the logits projection is a
matmul whether or not it is tied to the embedding. Attention scores and the
probability-value product are halved for the causal mask, as MaxText,
Megatron-LM and NeMo do, although the model computes the full score matrix.
Norms, softmax, RoPE, the loss and the optimizer are left out: they are small
next to the matmuls and depend on the implementation, not on the model.

Each model family counts its own (`Family.train_flops_per_row`); this module scales them to a step.
"""

from __future__ import annotations

from mintrain.config import Config


def tokens_per_step(config: Config) -> int:
  """Tokens (or examples, for a model whose rows are examples) per optimizer step, over all micro-batches."""
  return config.train.global_batch_size * config.family.tokens_per_row(config.model, config.train.seq_len)


def train_flops_per_step(config: Config, *, causal_half: bool = True) -> float:
  """Model FLOPs of one optimizer step over the whole global batch; divide by devices for per device.

  `causal_half=False` counts the full attention score matrix, which is what
  XLA computes (and what `cost_analysis()` reports).
  """
  per_row = config.family.train_flops_per_row(config.model, config.train.seq_len, causal_half)
  return per_row * config.train.global_batch_size


def param_count(config: Config) -> int:
  """Number of parameters of `config.model`, embedding (and unembedding) included."""
  return config.family.param_count(config.model)
