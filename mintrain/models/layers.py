"""Building blocks shared by the models.

Shape letters: B batch, L length, D embed, F mlp, H heads, K head dim, V vocab.

Every parameter is created with its logical axes as `out_sharding` metadata.
Parameters are stored in their storage layout (e.g. FSDP-sharded on `embed`);
`gather` brings one to its compute layout and dtype right before use, so the
all-gather (and, in the backward pass, the reduce-scatter) happens inside the
layer that needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.partitioning import AxisRules

Initializer = Callable[..., jax.Array]


def param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str | None],
          dtype: jnp.dtype, rules: AxisRules) -> nnx.Param:
  """A parameter with its logical axes declared next to it.

  Under a mesh it is drawn directly in its storage sharding, so no device ever
  holds the whole of a sharded parameter. Without one (shape discovery before
  validation) it is created unsharded.
  """
  axes = tuple(axes)
  spec = None if jax.sharding.get_abstract_mesh().empty else rules.param_spec(axes)
  value = init(rngs.params(), tuple(shape), dtype, out_sharding=spec)
  # The logical names are metadata only: Flax must not map them to mesh axes itself.
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def gather(p: nnx.Param, rules: AxisRules, dtype: jnp.dtype) -> jax.Array:
  """The parameter in its compute layout and dtype."""
  return rules.reshard(p[...].astype(dtype), p.get_metadata()['out_sharding'])


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout with a mask drawn in `x`'s sharding, so it is the same on every mesh."""
  if rate == 0.0 or key is None:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape, out_sharding=jax.typeof(x).sharding)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class RMSNorm(nnx.Module):
  """Root-mean-square norm over `embed`, computed in float32."""

  def __init__(self, dim: int, *, rules: AxisRules, param_dtype: jnp.dtype, rngs: nnx.Rngs,
               eps: float = 1e-6):
    self.scale = param(rngs, nnx.initializers.ones, (dim,), ('embed',), param_dtype, rules)
    self.rules = rules
    self.eps = eps

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * gather(self.scale, self.rules, jnp.float32)).astype(x_BLD.dtype)
