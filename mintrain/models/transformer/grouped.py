"""The grouped matmul of dropless experts: each row times its group's matrix, for rows sorted by group.

Shape letters: R rows, G groups, D in, F out, N tiles, T rows of a tile, P padded rows (N x T).

Rows carry a group id; id G means none (padding, or a choice sent elsewhere) and gives a zero row. Two
kernels compute the same values:
- `ragged_dot`: `jax.lax.ragged_dot` on the sorted rows, the platform's grouped matmul (GPU, TPU). On the
  CPU it lowers to a dense product masked per group: G times the work.
- `blocks`: megablox's layout done with XLA's batched matmul, for the CPU. Each group's sorted rows are
  padded to whole tiles of T rows, every tile is multiplied by its group's matrix, and the tile count is
  the bound for any split of R rows over G groups (R / T + G - 1), so the work is at most (G - 1) x T
  rows more than the routed rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


def tile_rows(rows: int, groups: int, tile: int) -> int:
  """T: `tile`, or (0) the largest power of two in [8, 512] that pads at most an eighth of the rows."""
  if tile:
    return tile
  share = rows // (8 * groups)
  return min(512, max(8, 1 << max(share, 1).bit_length() - 1))


class Plan(NamedTuple):
  """Where the rows go: `order_R` sorts them by group, `sizes_G` counts each group's, and for `blocks`,
  `source_P` is the sorted row of each padded row (R: none), `group_N` each tile's group and `padded_R`
  the padded row of each sorted one."""
  order_R: jax.Array
  sizes_G: jax.Array
  source_P: jax.Array | None
  group_N: jax.Array | None
  padded_R: jax.Array | None


def plan(group_R: jax.Array, groups: int, kernel: str, tile: int = 0) -> Plan:
  """The rows of `group_R` (ids in [0, G]; G: none) sorted, counted and, for `blocks`, tiled."""
  rows = group_R.shape[0]
  order_R = jnp.argsort(group_R, stable=True)
  sizes_G = jnp.bincount(group_R, length=groups + 1)[:groups].astype(jnp.int32)
  if kernel == 'ragged_dot':
    return Plan(order_R, sizes_G, None, None, None)
  t = tile_rows(rows, groups, tile)
  tiles = -(-rows // t) + groups - 1
  tiles_G = -(-sizes_G // t)
  tile_end_G = jnp.cumsum(tiles_G)
  tile_start_G = tile_end_G - tiles_G
  row_start_G = jnp.cumsum(sizes_G) - sizes_G
  group_N = jnp.minimum(jnp.searchsorted(tile_end_G, jnp.arange(tiles), side='right'), groups - 1)
  offset_P = (jnp.arange(tiles)[:, None] - tile_start_G[group_N][:, None]) * t + jnp.arange(t)[None, :]
  valid_P = (offset_P >= 0) & (offset_P < sizes_G[group_N][:, None])
  source_P = jnp.where(valid_P, row_start_G[group_N][:, None] + offset_P, rows).reshape(-1)
  sorted_group_R = jnp.minimum(group_R[order_R], groups - 1)
  padded_R = tile_start_G[sorted_group_R] * t + jnp.arange(rows) - row_start_G[sorted_group_R]
  padded_R = jnp.minimum(padded_R, tiles * t - 1)  # The rows of none (masked by the caller).
  return Plan(order_R, sizes_G, source_P, group_N, padded_R)


def _matmul(x, w_GDF: jax.Array, p: Plan) -> jax.Array:
  """x (sorted rows (R, D), or tiles (N, T, D) for `blocks`) times each row's group matrix."""
  if p.group_N is None:
    return jax.lax.ragged_dot(x, w_GDF, p.sizes_G)
  return jnp.einsum('NTD,NDF->NTF', x, w_GDF[p.group_N])


def gated_mlp(x_RD: jax.Array, group_R: jax.Array, w_gate_GDF: jax.Array, w_up_GDF: jax.Array,
              w_down_GFD: jax.Array, activation: Callable[[jax.Array], jax.Array], *, kernel: str,
              tile: int = 0) -> jax.Array:
  """Each row through its group's gated MLP, down(act(x gate) * x up); rows of no group give zeros."""
  rows, groups = x_RD.shape[0], w_gate_GDF.shape[0]
  p = plan(group_R, groups, kernel, tile)
  x_RD = x_RD[p.order_R]  # Sorted by group, the rows of none last.
  if p.group_N is not None:
    x_RD = jnp.take(x_RD, p.source_P, axis=0, mode='fill', fill_value=0)
    x_RD = x_RD.reshape(p.group_N.shape[0], -1, x_RD.shape[-1])
  h = activation(_matmul(x_RD, w_gate_GDF, p)) * _matmul(x_RD, w_up_GDF, p)
  y = _matmul(h, w_down_GFD, p)
  if p.group_N is not None:  # Back from the tiles; the rows of no group (sorted last) are zeros.
    y = y.reshape(-1, y.shape[-1])[p.padded_R]
    y = jnp.where((jnp.arange(rows) < jnp.sum(p.sizes_G))[:, None], y, 0)
  return jnp.zeros_like(y).at[p.order_R].set(y, unique_indices=True)


def padded_rows(rows: int, groups: int, tile: int = 0) -> int:
  """The rows `blocks` multiplies for `rows` rows over `groups` groups (the FLOP count's)."""
  t = tile_rows(rows, groups, tile)
  return (math.ceil(rows / t) + groups - 1) * t
