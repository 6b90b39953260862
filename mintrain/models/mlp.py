"""The classic tutorial MLP (784 -> 1024 -> 1024 -> 1024 -> 10), tensor-parallel Megatron style.

Hidden layers come in pairs: the first of a pair is column-parallel (output
dimension `mlp`, split over `model`), the second row-parallel (input dimension
`mlp`), so each pair needs one reduction and no gather of activations.
Shape letters: B batch, D features (`embed`), F hidden (`mlp`), C classes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.loss import cross_entropy
from mintrain.models.layers import dropout, gather, param
from mintrain.partitioning import AxisRules


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  input_dim: int = 784
  hidden_dims: tuple[int, ...] = (1024, 1024, 1024)
  num_classes: int = 10
  dropout_rate: float = 0.0
  param_dtype: str = 'float32'
  compute_dtype: str = 'float32'


class MLP(nnx.Module):
  """inputs_BD -> logits_BC (float32)."""

  def __init__(self, cfg: MLPConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    dims = (cfg.input_dim, *cfg.hidden_dims, cfg.num_classes)
    dtype, init = jnp.dtype(cfg.param_dtype), nnx.initializers.lecun_normal()
    # Alternate column-parallel (embed -> mlp) and row-parallel (mlp -> embed) layers;
    # the last layer maps to the (replicated) classes.
    axes = []
    for i in range(len(dims) - 1):
      in_axis = 'mlp' if i % 2 else 'embed'
      out_axis = 'classes' if i == len(dims) - 2 else ('embed' if i % 2 else 'mlp')
      axes.append((in_axis, out_axis))
    self.weights = nnx.List([param(rngs, init, (a, b), ax, dtype, rules)
                             for (a, b), ax in zip(zip(dims[:-1], dims[1:]), axes)])
    self.biases = nnx.List([param(rngs, nnx.initializers.zeros, (b,), ax[1:], dtype, rules)
                            for b, ax in zip(dims[1:], axes)])
    self.axes = tuple(axes)
    self.cfg, self.rules = cfg, rules

  def __call__(self, inputs_BD: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
    rules, dtype = self.rules, jnp.dtype(self.cfg.compute_dtype)
    x = rules.reshard(inputs_BD.astype(dtype), ('batch', 'embed'))
    last = len(self.axes) - 1
    for i, (w, b, (_, out_axis)) in enumerate(zip(self.weights, self.biases, self.axes)):
      out_spec = rules.activation_spec(('batch', out_axis))
      x = jnp.einsum('BD,DF->BF', x, gather(w, rules, dtype), out_sharding=out_spec)
      x = x + gather(b, rules, dtype)
      if i < last:
        key = jax.random.fold_in(dropout_key, i) if dropout_key is not None else None
        x = dropout(jax.nn.relu(x), self.cfg.dropout_rate, key)
    return x.astype(jnp.float32)

  def loss(self, inputs_BD: jax.Array, labels_B: jax.Array, *,
           dropout_key: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy of the class predictions against `labels_B`."""
    return cross_entropy(self(inputs_BD, dropout_key=dropout_key), labels_B)
