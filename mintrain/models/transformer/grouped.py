"""The grouped matmul of dropless experts: each row times its group's matrix, for rows sorted by group.

Shape letters: R rows, G groups, D in, F out, N tiles, T rows of a tile, P padded rows (N x T).

Rows carry a group id; id G means none (padding, or a choice sent elsewhere) and gives a zero row. Two
kernels compute the same values:
- `ragged_dot`: `jax.lax.ragged_dot` on the sorted rows, the platform's grouped matmul (GPU, TPU). On the
  CPU it lowers to a dense product masked per group: G times the work.
- `tiles`: megablox's layout for the CPU. Each group's sorted rows are padded to whole tiles of T rows
  (at most R / T + G - 1 tiles for any split of R rows), and a loop multiplies the tiles in use, each by
  its group's matrix read in place, with a VJP of the same loops (the input's gradient tile by tile, the
  matrices' accumulated in place). No matrix is copied per tile and unused tiles cost nothing, so the
  work is the routed rows plus at most T - 1 rows of padding per group. XLA's cost analysis counts a
  loop's body once, so it cannot count this kernel's FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mintrain.models.layers import matmul, summed_as, varying_axes


def tile_rows(rows: int, groups: int, tile: int) -> int:
  """T: `tile`, or (0) the largest power of two in [8, 256] at most half a group's even share, so that
  the tiles' buffers hold at most 1.5 x the rows (tiles of 8 rows at least)."""
  if tile:
    return tile
  share = rows // (2 * groups)
  return min(256, max(8, 1 << max(share, 1).bit_length() - 1))


class Plan(NamedTuple):
  """Where the rows go: `order_R` sorts them by group, `sizes_G` counts each group's, and for `tiles`,
  `source_P` is the sorted row of each padded row (R: none), `group_N` each tile's group, `tiles` how many
  are in use and `padded_R` the padded row of each sorted one."""
  order_R: jax.Array
  sizes_G: jax.Array
  source_P: jax.Array | None = None
  group_N: jax.Array | None = None
  tiles: jax.Array | None = None
  padded_R: jax.Array | None = None


def plan(group_R: jax.Array, groups: int, kernel: str, tile: int = 0) -> Plan:
  """The rows of `group_R` (ids in [0, G]; G: none) sorted, counted and, for `tiles`, tiled."""
  rows = group_R.shape[0]
  order_R = jnp.argsort(group_R, stable=True)
  sizes_G = jnp.bincount(group_R, length=groups + 1)[:groups].astype(jnp.int32)
  if kernel == 'ragged_dot':
    return Plan(order_R, sizes_G)
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
  return Plan(order_R, sizes_G, source_P, group_N.astype(jnp.int32), tile_end_G[-1], padded_R)


def _zeros(shape: tuple[int, ...], dtype, *like: jax.Array) -> jax.Array:
  """Zeros for a loop's carry, varying over the mesh axes that `like` vary over."""
  axes = tuple(sorted(varying_axes(*like)))
  zeros = jnp.zeros(shape, dtype)
  return jax.lax.pcast(zeros, axes, to='varying') if axes else zeros


def _tiles_times(x_NTD: jax.Array, w_GDF: jax.Array, group_N: jax.Array, tiles: jax.Array) -> jax.Array:
  """Tile i (of the first `tiles`) times matrix group_N[i]; the tiles past them stay zeros."""
  def body(i, y_NTF):
    w_DF = jax.lax.dynamic_index_in_dim(w_GDF, group_N[i], keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(y_NTF, matmul('TD,DF->TF', x_NTD[i], w_DF), i, 0)
  y_NTF = _zeros((*x_NTD.shape[:2], w_GDF.shape[-1]), jnp.result_type(x_NTD, w_GDF), x_NTD, w_GDF)
  return jax.lax.fori_loop(0, tiles, body, y_NTF)


@jax.custom_vjp
def tiled_matmul(x_NTD: jax.Array, w_GDF: jax.Array, group_N: jax.Array, tiles: jax.Array) -> jax.Array:
  """`tiles`' grouped matmul of tiles (N, T, D) by their groups' matrices (G, D, F)."""
  return _tiles_times(x_NTD, w_GDF, group_N, tiles)


def _tiled_matmul_fwd(x_NTD, w_GDF, group_N, tiles):
  return _tiles_times(x_NTD, w_GDF, group_N, tiles), (x_NTD, w_GDF, group_N, tiles)


def _tiled_matmul_bwd(residuals, dy_NTF):
  x_NTD, w_GDF, group_N, tiles = residuals

  def body(i, grads):
    dx_NTD, dw_GDF = grads
    g = group_N[i]
    w_DF = jax.lax.dynamic_index_in_dim(w_GDF, g, keepdims=False)
    dx_TD = matmul('TF,DF->TD', dy_NTF[i], w_DF, dtype=dx_NTD.dtype)
    dx_NTD = jax.lax.dynamic_update_index_in_dim(dx_NTD, dx_TD, i, 0)
    dw_DF = (jax.lax.dynamic_index_in_dim(dw_GDF, g, keepdims=False)
             + matmul('TD,TF->DF', x_NTD[i], dy_NTF[i], dtype=jnp.float32))
    return dx_NTD, jax.lax.dynamic_update_index_in_dim(dw_GDF, dw_DF.astype(dw_GDF.dtype), g, 0)

  like = (x_NTD, w_GDF, dy_NTF)
  grads = (_zeros(x_NTD.shape, x_NTD.dtype, *like), _zeros(w_GDF.shape, w_GDF.dtype, *like))
  dx_NTD, dw_GDF = jax.lax.fori_loop(0, tiles, body, grads)
  return summed_as(dx_NTD, x_NTD), summed_as(dw_GDF, w_GDF), None, None


tiled_matmul.defvjp(_tiled_matmul_fwd, _tiled_matmul_bwd)


def _matmul(x, w_GDF: jax.Array, p: Plan) -> jax.Array:
  """x (sorted rows (R, D), or tiles (N, T, D) for `tiles`) times each row's group matrix."""
  if p.group_N is None:
    return jax.lax.ragged_dot(x, w_GDF, p.sizes_G)
  return tiled_matmul(x, w_GDF, p.group_N, p.tiles)


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
  # Gate and up as one grouped matmul: one pass over the rows' tiles and a product twice as wide.
  f = w_gate_GDF.shape[-1]
  gate_up = _matmul(x_RD, jnp.concatenate([w_gate_GDF, w_up_GDF], axis=-1), p)
  h = activation(gate_up[..., :f]) * gate_up[..., f:]
  y = _matmul(h, w_down_GFD, p)
  if p.group_N is not None:  # Back from the tiles; the rows of none (sorted last) are zeros.
    y = y.reshape(-1, y.shape[-1])[p.padded_R]
    y = jnp.where((jnp.arange(rows) < jnp.sum(p.sizes_G))[:, None], y, 0)
  return jnp.zeros_like(y).at[p.order_R].set(y, unique_indices=True)
