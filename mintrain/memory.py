"""Memory plan per device: what training will hold, known before anything is compiled.

Parameters, gradients and optimizer state are exact (their resolved layouts);
activations are an estimate of what the backward pass keeps for one
micro-batch: per layer, the inputs of every matmul, norm and nonlinearity, and
the attention probabilities; plus the float32 logits and their softmax (with the
fused loss, `model.loss_chunks`, only one chunk's at a time, and the hidden states'
gradient that it keeps instead). With `model.remat`, a
layer keeps only its input ('full') or its input and its matmul outputs
('save_matmuls'), and one layer's full activations are live again while its
backward pass recomputes them. XLA may keep less (it fuses) or more
(temporaries); the compiled step's own memory analysis is the final word, and
the benchmarks print it.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from mintrain.config import micro_batch_size
from mintrain.partitioning import AxisRules
from mintrain.train_state import ParamInfo, TrainState, state_bytes_per_device


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  params: int
  grads: int
  opt_state: int
  activations: int
  device_limit: int | None  # What the device reports it can hold; None where it reports nothing.

  @property
  def total(self) -> int:
    return self.params + self.grads + self.opt_state + self.activations

  @property
  def fits(self) -> bool:
    return self.device_limit is None or self.total <= self.device_limit


def activation_bytes(config: ml_collections.ConfigDict, rules: AxisRules, mesh: Mesh) -> int:
  """Estimated activations kept for the backward pass of one micro-batch, per device."""
  m = config.model
  c = np.dtype(m.compute_dtype).itemsize
  rows = micro_batch_size(config) // rules.ways('batch', mesh.shape)
  if m.name == 'mlp':
    widths = (m.input_dim, *m.hidden_dims, m.num_classes)
    return rows * sum(2 * w * c for w in widths)  # Each layer's input and its pre-activation.
  seq, d = config.train.seq_len, m.embed_dim
  heads = m.num_heads / rules.ways('heads', mesh.shape)
  mlp = m.mlp_dim / rules.ways('mlp', mesh.shape)
  per_token_layer = (c * (4 * d + 4 * heads * m.head_dim + 3 * mlp)  # Norms, q/k/v/out, gate/up/product.
                     + heads * seq * (4 + c))  # Attention scores (float32) and probabilities.
  remat = m.get('remat', 'none')
  if remat == 'none':
    layers = m.num_layers * per_token_layer
  else:
    # Input; plus, when saving matmuls, q/k/v, the attention projection, gate, up and down outputs.
    kept = c * d if remat == 'full' else c * (3 * d + 3 * heads * m.head_dim + 2 * mlp)
    layers = m.num_layers * kept + per_token_layer  # One layer's activations, recomputed for its backward.
  chunks = m.get('loss_chunks', 1)
  logits = 2 * 4 * m.vocab_size / rules.ways('vocab', mesh.shape) / max(chunks, 1)  # Float32, and softmax.
  loss_grad = c * d if chunks else 0  # The fused loss keeps d loss / d hidden states, formed in its forward.
  return int(rows * seq * (layers + logits + loss_grad + c * d))


def device_memory_limit(device: jax.Device) -> int | None:
  try:
    stats = device.memory_stats()
  except Exception:  # Some backends (CPU) do not implement it.
    return None
  return int(stats['bytes_limit']) if stats and 'bytes_limit' in stats else None


def plan(config: ml_collections.ConfigDict, rules: AxisRules, mesh: Mesh, layout: list[ParamInfo],
         abstract_state: TrainState) -> MemoryPlan:
  params = sum(p.bytes_per_device for p in layout)
  grads = params * (2 if config.train.grad_accum_steps > 1 else 1)  # Plus the accumulation buffer.
  return MemoryPlan(params=params, grads=grads,
                    opt_state=state_bytes_per_device(abstract_state.opt_state),
                    activations=activation_bytes(config, rules, mesh),
                    device_limit=device_memory_limit(mesh.devices.flat[0]))
