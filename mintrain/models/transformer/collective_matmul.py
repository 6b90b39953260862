"""The gated MLP as collective matmuls: tensor-parallel communication overlapped with partial matmuls.

Shape letters: B batch, L length, C one ring chunk of the length, D embed, F mlp (this device's part).

Instead of one blocking all-reduce after the row-parallel matmul, the n devices of the `mlp` ring work on
the sequence in chunks inside `jax.shard_map` (the JAX "collective matmul" tutorial): gate/up as an
all-gather-matmul, down as a matmul-reduce-scatter, each transfer independent of the matmul beside it so
the two overlap. The ring is bidirectional when a chunk has an even length (half of each chunk each way).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mintrain.models.layers import matmul
from mintrain.partitioning import AxisRules, spec_axes


def ring_axes(rules: AxisRules) -> tuple[tuple[str, ...], int]:
  """(mesh axes of `mlp`, their total size on the current mesh): the ring of the overlapped MLP."""
  axes = spec_axes(rules.activation_spec(('mlp',))[0])
  mesh = jax.sharding.get_abstract_mesh()
  return axes, rules.ways('mlp', mesh.shape) if not mesh.empty else 1


def _ring_mlp(x_BCD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array, *,
              axes: tuple[str, ...], n: int, bidirectional: bool,
              activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """One device's part: its chunk's output, summed over the ring, after n overlapped steps."""
  upstream_left = [(j, (j - 1) % n) for j in range(n)]  # Device j sends to j - 1.
  upstream_right = [(j, (j + 1) % n) for j in range(n)]
  if bidirectional:
    half = x_BCD.shape[1] // 2
    streams = [[x_BCD[:, :half], upstream_left], [x_BCD[:, half:], upstream_right]]
  else:
    streams = [[x_BCD, upstream_left]]

  # All-gather-matmul: after s steps a stream holds the chunk of the device s hops upstream.
  hidden = [[] for _ in streams]
  for step in range(n):
    for stream, h_list in zip(streams, hidden):
      x, perm = stream
      gate_BCF = matmul('BCD,DF->BCF', x, w_gate_DF)
      up_BCF = matmul('BCD,DF->BCF', x, w_up_DF)
      h_list.append(activation(gate_BCF) * up_BCF)
      if step < n - 1:
        stream[0] = jax.lax.ppermute(x, axes, perm)

  # Matmul-reduce-scatter: at step s, the partial sum for the chunk s + 1 hops upstream, which
  # arrives back home after the remaining n - 1 - s hops.
  outs = []
  for (_, perm), h_list in zip(streams, hidden):
    acc_BCD = None
    for step in range(n):
      part_BCD = matmul('BCF,FD->BCD', h_list[(step + 1) % n], w_down_FD)
      acc_BCD = part_BCD if acc_BCD is None else acc_BCD + part_BCD
      if step < n - 1:
        acc_BCD = jax.lax.ppermute(acc_BCD, axes, perm)
    outs.append(acc_BCD)
  return jnp.concatenate(outs, axis=1)


def gated_mlp(x_BLD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array,
              rules: AxisRules, activation: Callable[[jax.Array], jax.Array] = jax.nn.silu) -> jax.Array:
  """act(x @ w_gate) * (x @ w_up) @ w_down, with the length split over the ring of `mlp`'s mesh axes.

  The weights come in their compute layout (`mlp` split over the ring). Returns (B, L, D) with
  the length split over the ring; reshard it to the layout the caller needs.
  """
  axes, n = ring_axes(rules)
  batch, length, embed = rules.activation_spec(('batch', 'length', 'embed'))
  seq_len = x_BLD.shape[1]
  ring = ' x '.join(f'`{a}`' for a in axes)
  mesh_shape = jax.sharding.get_abstract_mesh().shape
  if rules.ways('length', mesh_shape) > 1 or rules.ways('embed', mesh_shape) > 1:
    raise ValueError('model.mlp_overlap needs `length` and `embed` whole on every device (they map to '
                     f'{length} and {embed}); set mesh.context=1 and map `embed` to None, or set '
                     'model.mlp_overlap=False.')
  if set(spec_axes(batch)) & set(axes):
    raise ValueError(f'model.mlp_overlap runs its ring over {ring}, which `batch` is split over too; '
                     'map `batch` and `mlp` to different mesh axes or set model.mlp_overlap=False.')
  if seq_len % n:
    raise ValueError(f'model.mlp_overlap splits the sequence (length {seq_len}) into {n} chunks over '
                     f'{ring}; {seq_len} % {n} != 0. Use a train.seq_len that is a multiple of {n} or '
                     'set model.mlp_overlap=False.')
  ring_entry = axes[0] if len(axes) == 1 else axes
  x_spec = P(batch, ring_entry, None)
  body = jax.shard_map(
      lambda *args: _ring_mlp(*args, axes=axes, n=n, bidirectional=(seq_len // n) % 2 == 0,
                              activation=activation),
      in_specs=(x_spec, P(None, ring_entry), P(None, ring_entry), P(ring_entry, None)),
      out_specs=x_spec)
  # Slicing replicated activations to their chunks is local; the weights are already in place.
  return body(jax.sharding.reshard(x_BLD, x_spec), w_gate_DF, w_up_DF, w_down_FD)
