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
import numpy as np
from flax import nnx

from mintrain.data import synthetic
from mintrain.errors import ConfigError
from mintrain.fields import option
from mintrain.models.family import ModelConfig, Placement, Ways
from mintrain.models.layers import dropout, gather, matmul, param
from mintrain.models.loss import cross_entropy
from mintrain.partitioning import AxisRules

DTYPES = ('float32', 'bfloat16')


def _positive(dims: tuple[int, ...]) -> str | None:
  return None if dims and all(d >= 1 for d in dims) else 'must be one or more positive widths'


@dataclasses.dataclass(frozen=True)
class MLPConfig(ModelConfig):
  """The `model` section of an MLP run (mintrain/configs/mlp_dp4_tp2.py)."""

  input_dim: int = option(at_least=1)
  hidden_dims: tuple[int, ...] = option(check=_positive)
  num_classes: int = option(at_least=1)
  dropout_rate: float = option(at_least=0, below=1)
  param_dtype: str = option(choices=DTYPES)
  compute_dtype: str = option(choices=DTYPES)

  @property
  def dims(self) -> tuple[int, ...]:
    return (self.input_dim, *self.hidden_dims, self.num_classes)

  def param_count(self) -> int:
    return sum(a * b + b for a, b in zip(self.dims[:-1], self.dims[1:]))

  def train_flops_per_row(self, seq_len: int, causal_half: bool = True) -> float:
    """Training FLOPs per example (3x forward, as for the transformer).

    The first layer needs no input gradient, so XLA does 2 * in * out fewer FLOPs
    there than this count; the convention counts every matmul the same way.
    """
    return 3 * sum(2 * a * b for a, b in zip(self.dims[:-1], self.dims[1:]))

  def tokens_per_row(self, seq_len: int) -> int:
    return 1  # Examples, not tokens.

  def activation_bytes(self, rows: int, seq_len: int, ways: Ways) -> int:
    """Each layer's input and its pre-activation, per example."""
    return rows * sum(2 * w * np.dtype(self.compute_dtype).itemsize for w in self.dims)

  def placement_notes(self, placement: Placement, seq_len: int) -> list[str]:
    if placement.pipeline.stages > 1:
      raise ConfigError(f'The MLP has no stacked layers to pipeline over mesh.stage='
                        f'{placement.pipeline.stages}; set mesh.stage=1.')
    return []

  def synthetic_rows(self, seed: int, step: int, rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    return synthetic.classification_rows(seed, step, rows, self.input_dim, self.num_classes)


class MLP(nnx.Module):
  """inputs_BD -> logits_BC (float32)."""

  def __init__(self, cfg: MLPConfig, *, rules: AxisRules, rngs: nnx.Rngs):
    dims = cfg.dims
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
      x = matmul('BD,DF->BF', x, gather(w, rules, dtype), out_spec)
      x = x + gather(b, rules, dtype)
      if i < last:
        key = jax.random.fold_in(dropout_key, i) if dropout_key is not None else None
        x = dropout(jax.nn.relu(x), self.cfg.dropout_rate, key)
    return x.astype(jnp.float32)

  def loss(self, batch: dict[str, jax.Array], *,
           dropout_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(mean cross-entropy of the class predictions against the labels 'targets', the examples' count, no
    statistics)."""
    labels_B = batch['targets']
    logits_BC = self(batch['inputs'], dropout_key=dropout_key)
    return cross_entropy(logits_BC, labels_B), jnp.float32(labels_B.size), {}
