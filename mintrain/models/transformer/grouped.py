"""The grouped matmul of dropless experts: each row times its group's matrix, for rows sorted by group.

Shape letters: R rows, G groups, D a row's width, F the MLP's (gate and up side by side: 2F), N tiles,
T rows of a tile, P padded rows (N x T).

Rows carry a group id; id G means none (padding, or a choice sent elsewhere) and gives a zero row. Two
kernels compute the same values:
- `ragged_dot`: `jax.lax.ragged_dot` on the sorted rows, the platform's grouped matmul (TPU). On the CPU,
  and on CUDA GPUs with XLA's defaults (jax 0.11), it lowers to a dense product masked per group: G times
  the work, and an (R, G, D) temporary that ran a 64-expert layer out of an H200's memory.
- `tiles`: megablox's layout for the CPU. Each group's sorted rows are padded to whole tiles of T rows
  (at most R / T + G - 1 tiles for any split of R rows), and one loop takes each tile in use through its
  group's whole gated MLP, with a VJP of the same loop: a loop over the groups reads each group's
  matrices once and sums their gradients over the group's tiles. Unused tiles cost nothing, not even an
  elementwise op, so the work is the routed rows plus at most T - 1 rows of padding per group. XLA's
  cost analysis counts a loop's body once, so it cannot count this kernel's FLOPs. On a GPU each tile is
  a loop iteration of several kernel launches, so its automatic tiles are larger (`tile_rows`).
A third, `mosaic_gpu`, runs the sorted rows through JAX's Mosaic GPU grouped matmuls for Hopper GPUs
(`ragged_dot_mgpu`, and `transposed_ragged_dot_mgpu` for the weight gradients) in a VJP of its own
(`sorted_gated_mlp`), since those kernels have no autodiff rules.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mintrain.errors import ConfigError
from mintrain.models.layers import matmul, summed_as, varying_axes


def tile_rows(rows: int, groups: int, tile: int, platform: str = 'cpu') -> int:
  """T: `tile`, or (0) the largest power of two of at least 8 rows and at most: on the CPU, where padding
  costs what it computes, 256 and half a group's even share (the buffers hold at most 1.5 x the rows);
  elsewhere (GPU), where each tile costs kernel launches and fewer, larger tiles won despite their padding
  (BENCHMARKS.md), 1024 and the whole share."""
  if tile:
    return tile
  most, share = (256, rows // (2 * groups)) if platform == 'cpu' else (1024, rows // groups)
  return min(most, max(8, 1 << max(share, 1).bit_length() - 1))


class Plan(NamedTuple):
  """Where the rows go: `order_R` sorts them by group and `sizes_G` counts each group's; for `tiles`,
  `source_P` is the row of each padded row (R: none), `tile_end_G` the end of each group's run of tiles
  (group g has tiles [tile_end_G[g - 1], tile_end_G[g])) and `padded_R` the padded row of each row. The
  tiles index the rows as given, so neither way passes through the sorted order."""
  order_R: jax.Array
  sizes_G: jax.Array
  source_P: jax.Array | None = None
  tile_end_G: jax.Array | None = None
  padded_R: jax.Array | None = None


def ranks(order_R: jax.Array) -> jax.Array:
  """The inverse of the permutation `order_R`: where each row went."""
  return jnp.zeros_like(order_R).at[order_R].set(jnp.arange(order_R.shape[0], dtype=order_R.dtype),
                                                 unique_indices=True)


def plan(group_R: jax.Array, groups: int, kernel: str, tile: int = 0) -> Plan:
  """The rows of `group_R` (ids in [0, G]; G: none) sorted, counted and, for `tiles`, tiled (`tile` rows
  a tile; 0: the CPU's automatic size)."""
  rows = group_R.shape[0]
  order_R = jnp.argsort(group_R, stable=True)
  sizes_G = jnp.bincount(group_R, length=groups + 1)[:groups].astype(jnp.int32)
  if kernel in ('ragged_dot', 'mosaic_gpu'):
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
  sorted_P = jnp.minimum(row_start_G[group_N][:, None] + offset_P, rows - 1)
  source_P = jnp.where(valid_P, order_R[sorted_P], rows).reshape(-1)
  g_R = jnp.minimum(group_R, groups - 1)
  padded_R = tile_start_G[g_R] * t + ranks(order_R) - row_start_G[g_R]
  padded_R = jnp.clip(padded_R, 0, tiles * t - 1)  # The rows of none (masked by the caller).
  return Plan(order_R, sizes_G, source_P, tile_end_G.astype(jnp.int32), padded_R)


def per_row_mlp(x_RD: jax.Array, group_R: jax.Array, w_gate_GDF: jax.Array, w_up_GDF: jax.Array,
                w_down_GFD: jax.Array, activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """What both kernels compute, by definition: each row times its own group's matrices, gathered (R
  copies of them: for checks, not training); rows of no group give zeros."""
  groups = w_gate_GDF.shape[0]
  g_R = jnp.minimum(group_R, groups - 1)
  h_RF = (activation(jnp.einsum('RD,RDF->RF', x_RD, w_gate_GDF[g_R]))
          * jnp.einsum('RD,RDF->RF', x_RD, w_up_GDF[g_R]))
  return jnp.where((group_R < groups)[:, None], jnp.einsum('RF,RFD->RD', h_RF, w_down_GFD[g_R]), 0)


def _zeros(shape: tuple[int, ...], dtype, *like: jax.Array) -> jax.Array:
  """Zeros for a loop's carry, varying over the mesh axes that `like` vary over."""
  axes = tuple(sorted(varying_axes(*like)))
  zeros = jnp.zeros(shape, dtype)
  return jax.lax.pcast(zeros, axes, to='varying') if axes else zeros


def _each_tile(tile_end_G: jax.Array, weights: tuple[jax.Array, ...],
               loop: tuple[Callable, Callable, Callable], carry):
  """The tiles in use, group by group: the outer loop reads a group's matrices `w_g` once for all its
  tiles. `loop` is (start, step, end): a group's own carry (its weights' gradients, summed over its
  tiles) is `start(*w_g)`, each tile i does `carry, group = step(i, carry, group, *w_g)`, and
  `carry = end(carry, group, g)` closes the group."""
  start, step, end = loop

  def each_group(g, carry):
    w_g = tuple(jax.lax.dynamic_index_in_dim(w, g, keepdims=False) for w in weights)
    first = jnp.where(g > 0, tile_end_G[jnp.maximum(g - 1, 0)], 0)
    carry, group = jax.lax.fori_loop(first, tile_end_G[g], lambda i, c: step(i, *c, *w_g),
                                     (carry, start(*w_g)))
    return end(carry, group, g)
  return jax.lax.fori_loop(0, tile_end_G.shape[0], each_group, carry)


def _gate_up(gate_up_TF: jax.Array, activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
  gate_TF, up_TF = jnp.split(gate_up_TF, 2, axis=-1)
  return activation(gate_TF) * up_TF


def _tiles_mlp(x_NTD, w_gate_up_GDF, w_down_GFD, tile_end_G, activation, *, keep: bool):
  """y_NTD of the tiles in use (the rest stay zeros), and (`keep`) their gate/up products for the VJP."""
  like = (x_NTD, w_gate_up_GDF, w_down_GFD)
  dtype = jnp.result_type(x_NTD, w_down_GFD)
  y_NTD = _zeros((*x_NTD.shape[:2], w_down_GFD.shape[-1]), dtype, *like)
  gate_up_NTF = _zeros((*x_NTD.shape[:2], w_gate_up_GDF.shape[-1]), dtype, *like) if keep else None

  def step(i, carry, group, w_gate_up_DF, w_down_FD):
    y_NTD, gate_up_NTF = carry
    gate_up_TF = matmul('TD,DF->TF', x_NTD[i], w_gate_up_DF)
    y_TD = matmul('TF,FD->TD', _gate_up(gate_up_TF, activation), w_down_FD)
    y_NTD = jax.lax.dynamic_update_index_in_dim(y_NTD, y_TD, i, 0)
    if gate_up_NTF is not None:
      gate_up_NTF = jax.lax.dynamic_update_index_in_dim(gate_up_NTF, gate_up_TF, i, 0)
    return (y_NTD, gate_up_NTF), group

  loop = (lambda *w_g: (), step, lambda carry, group, g: carry)  # No gradients to sum.
  return _each_tile(tile_end_G, (w_gate_up_GDF, w_down_GFD), loop, (y_NTD, gate_up_NTF))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def tiled_gated_mlp(x_NTD: jax.Array, w_gate_up_GDF: jax.Array, w_down_GFD: jax.Array, tile_end_G: jax.Array,
                    activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """`tiles`' gated MLP of tiles (N, T, D) by their groups' gate and up matrices side by side (G, D, 2F)
  and down matrices (G, F, D): each tile in use through its group's MLP inside one loop, so that no
  elementwise op runs over the tiles out of use."""
  return _tiles_mlp(x_NTD, w_gate_up_GDF, w_down_GFD, tile_end_G, activation, keep=False)[0]


def _tiled_gated_mlp_fwd(x_NTD, w_gate_up_GDF, w_down_GFD, tile_end_G, activation):
  y_NTD, gate_up_NTF = _tiles_mlp(x_NTD, w_gate_up_GDF, w_down_GFD, tile_end_G, activation, keep=True)
  return y_NTD, (x_NTD, w_gate_up_GDF, w_down_GFD, tile_end_G, gate_up_NTF)


def _tiled_gated_mlp_bwd(activation, residuals, dy_NTD):
  x_NTD, w_gate_up_GDF, w_down_GFD, tile_end_G, gate_up_NTF = residuals
  like = (x_NTD, w_gate_up_GDF, w_down_GFD, dy_NTD)

  def start(w_gate_up_DF, w_down_FD):  # A group's weight gradients, summed in float32 over its tiles.
    return _zeros(w_gate_up_DF.shape, jnp.float32, *like), _zeros(w_down_FD.shape[::-1], jnp.float32, *like)

  # A tile's weight gradients contract its rows, the first axis of both operands. XLA:CPU left such
  # products in this loop to Eigen, slower than its XNNPACK fusions and allocating at every call; with
  # the first operand contracting its last axis they are fusions (BENCHMARKS.md). So the loop reads x and
  # dy transposed, made once before it, and sums the down matrix's gradient transposed.
  x_NDT, dy_NDT = (jnp.swapaxes(a, 1, 2) for a in (x_NTD, dy_NTD))

  def step(i, carry, group, w_gate_up_DF, w_down_FD):
    dx_NTD, dw_gate_up_GDF, dw_down_GFD = carry
    dw_gate_up_DF, dw_down_DF = group
    dy_TD = dy_NTD[i]
    gate_TF, up_TF = jnp.split(gate_up_NTF[i], 2, axis=-1)
    act_TF, act_vjp = jax.vjp(activation, gate_TF)
    dw_down_DF = dw_down_DF + matmul('DT,TF->DF', dy_NDT[i], act_TF * up_TF, dtype=jnp.float32)
    dh_TF = matmul('TD,FD->TF', dy_TD, w_down_FD)
    dgate_up_TF = jnp.concatenate([act_vjp(dh_TF * up_TF)[0], dh_TF * act_TF], axis=-1)
    dx_TD = matmul('TF,DF->TD', dgate_up_TF, w_gate_up_DF, dtype=dx_NTD.dtype)
    dx_NTD = jax.lax.dynamic_update_index_in_dim(dx_NTD, dx_TD, i, 0)
    dw_gate_up_DF = dw_gate_up_DF + matmul('DT,TF->DF', x_NDT[i], dgate_up_TF, dtype=jnp.float32)
    return (dx_NTD, dw_gate_up_GDF, dw_down_GFD), (dw_gate_up_DF, dw_down_DF)

  def end(carry, group, g):  # The group's gradients stored in place, once.
    dx_NTD, *dw_G = carry
    dw_gate_up_DF, dw_down_DF = group
    return (dx_NTD, *(jax.lax.dynamic_update_index_in_dim(w, w_g.astype(w.dtype), g, 0)
                      for w, w_g in zip(dw_G, (dw_gate_up_DF, dw_down_DF.T))))

  grads = tuple(_zeros(a.shape, a.dtype, *like) for a in (x_NTD, w_gate_up_GDF, w_down_GFD))
  dx_NTD, dw_gate_up_GDF, dw_down_GFD = _each_tile(tile_end_G, (w_gate_up_GDF, w_down_GFD),
                                                   (start, step, end), grads)
  return (summed_as(dx_NTD, x_NTD), summed_as(dw_gate_up_GDF, w_gate_up_GDF),
          summed_as(dw_down_GFD, w_down_GFD), None)


tiled_gated_mlp.defvjp(_tiled_gated_mlp_fwd, _tiled_gated_mlp_bwd)


class GroupedDots(NamedTuple):
  """The two grouped products of an MLP over rows sorted by group, and of its VJP. `dot(x_RK, w_GKN,
  sizes_G, transposed)`: each row times its group's matrix (`transposed`: w given as (G, N, K)), zeros
  for the rows past the groups; `dot_t(x_RM, y_RN, sizes_G)`: each group's x^T y over its rows, (G, M, N)."""
  dot: Callable[..., jax.Array]
  dot_t: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _xla_dot(x_RK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array, transposed: bool = False) -> jax.Array:
  return jax.lax.ragged_dot(x_RK, jnp.swapaxes(w_GKN, 1, 2) if transposed else w_GKN, sizes_G)


def _xla_dot_t(x_RM: jax.Array, y_RN: jax.Array, sizes_G: jax.Array) -> jax.Array:
  numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(x_RM, y_RN, sizes_G, ragged_dot_dimension_numbers=numbers)


# XLA's ragged products: what the Mosaic GPU kernels compute, and where they cannot run (the CPU's tests
# of `sorted_gated_mlp`) their stand-in.
XLA = GroupedDots(_xla_dot, _xla_dot_t)

# The Mosaic GPU kernels' blocks: 128 x 128 outputs, 4 stages and grid_block_n 4 as the H200 probe ran
# them (BENCHMARKS.md); its block_k was not recorded, 64 is 128 bytes of bfloat16. A product's K (and the
# weight gradients' M and N: D, F, 2F) must be a multiple of 128.
MOSAIC_BLOCK = 128
MOSAIC_TILING = dict(block_m=MOSAIC_BLOCK, block_n=MOSAIC_BLOCK, block_k=64, max_concurrent_steps=4,
                     grid_block_n=4)


@functools.cache
def mosaic_kernels() -> tuple:
  """JAX's `ragged_dot_mgpu` and `transposed_ragged_dot_mgpu` modules, imported when first traced: they
  import JAX's test utilities, which install absl's failure signal handler over SIGTERM (a preempted run
  then died with SIGABRT after saving). The run's own SIGTERM handler is put back. Not a lazy module in
  `sys.modules`: any scan of the modules (torch's import does one) would load it."""
  term = signal.getsignal(signal.SIGTERM)
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  if term is not None and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, term)
  return ragged_dot_mgpu, transposed_ragged_dot_mgpu


def _padded_rows(x_RK: jax.Array) -> jax.Array:
  """Rows padded with zeros to whole blocks (the kernels read rows a block at a time)."""
  return jnp.pad(x_RK, ((0, -x_RK.shape[0] % MOSAIC_BLOCK), (0, 0)))


def _check_mosaic(*sizes: int) -> None:
  if bad := [n for n in sizes if n % MOSAIC_BLOCK]:
    raise ConfigError(f"model.grouped_matmul=mosaic_gpu needs the experts' widths per device (embed_dim, "
                      f'expert_mlp_dim over the model axis) in multiples of {MOSAIC_BLOCK}; got {bad}. '
                      "Use model.grouped_matmul=tiles.")


def _mosaic_dot(x_RK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array, transposed: bool = False) -> jax.Array:
  rows = x_RK.shape[0]
  _check_mosaic(*w_GKN.shape[1:])
  y_RN = mosaic_kernels()[0].ragged_dot(_padded_rows(x_RK), w_GKN.astype(x_RK.dtype), group_sizes=sizes_G,
                                        transpose_rhs=transposed, **MOSAIC_TILING)[:rows]
  # Zeros past the groups, as XLA's ragged_dot gives: the kernel need not write those rows.
  return jnp.where((jnp.arange(rows) < jnp.sum(sizes_G))[:, None], y_RN, 0)


def _mosaic_dot_t(x_RM: jax.Array, y_RN: jax.Array, sizes_G: jax.Array) -> jax.Array:
  _check_mosaic(x_RM.shape[1], y_RN.shape[1])
  return mosaic_kernels()[1].transposed_ragged_dot(
      _padded_rows(x_RM), _padded_rows(y_RN.astype(x_RM.dtype)), group_sizes=sizes_G, **MOSAIC_TILING)


MOSAIC_GPU = GroupedDots(_mosaic_dot, _mosaic_dot_t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def sorted_gated_mlp(x_RD: jax.Array, w_gate_up_GDF: jax.Array, w_down_GFD: jax.Array, sizes_G: jax.Array,
                     activation: Callable[[jax.Array], jax.Array], dots: GroupedDots) -> jax.Array:
  """Rows sorted by group (`sizes_G` rows each, then rows of none, which give zeros) through their
  groups' gated MLPs (gate and up side by side, (G, D, 2F)) by the grouped products `dots`, with a VJP
  of five of them: the kernels behind `dots` need not have autodiff rules."""
  return _sorted_forward(x_RD, w_gate_up_GDF, w_down_GFD, sizes_G, activation, dots)[0]


def _sorted_forward(x_RD, w_gate_up_GDF, w_down_GFD, sizes_G, activation, dots):
  """(y_RD, its gate/up products) of sorted rows through their groups' gated MLPs by `dots`."""
  gate_up_RF = dots.dot(x_RD, w_gate_up_GDF, sizes_G)
  return dots.dot(_gate_up(gate_up_RF, activation), w_down_GFD, sizes_G), gate_up_RF


def _sorted_gated_mlp_fwd(x_RD, w_gate_up_GDF, w_down_GFD, sizes_G, activation, dots):
  y_RD, gate_up_RF = _sorted_forward(x_RD, w_gate_up_GDF, w_down_GFD, sizes_G, activation, dots)
  return y_RD, (x_RD, w_gate_up_GDF, w_down_GFD, sizes_G, gate_up_RF)


def _sorted_gated_mlp_bwd(activation, dots, residuals, dy_RD):
  x_RD, w_gate_up_GDF, w_down_GFD, sizes_G, gate_up_RF = residuals
  gate_RF, up_RF = jnp.split(gate_up_RF, 2, axis=-1)
  act_RF, act_vjp = jax.vjp(activation, gate_RF)
  dw_down_GFD = dots.dot_t(act_RF * up_RF, dy_RD, sizes_G)
  dh_RF = dots.dot(dy_RD, w_down_GFD, sizes_G, True)
  dgate_up_RF = jnp.concatenate([act_vjp(dh_RF * up_RF)[0], dh_RF * act_RF], axis=-1)
  dx_RD = dots.dot(dgate_up_RF, w_gate_up_GDF, sizes_G, True)
  dw_gate_up_GDF = dots.dot_t(x_RD, dgate_up_RF, sizes_G)
  return (summed_as(dx_RD.astype(x_RD.dtype), x_RD),
          summed_as(dw_gate_up_GDF.astype(w_gate_up_GDF.dtype), w_gate_up_GDF),
          summed_as(dw_down_GFD.astype(w_down_GFD.dtype), w_down_GFD), None)


sorted_gated_mlp.defvjp(_sorted_gated_mlp_fwd, _sorted_gated_mlp_bwd)


def gated_mlp(x_RD: jax.Array, group_R: jax.Array, w_gate_GDF: jax.Array, w_up_GDF: jax.Array,
              w_down_GFD: jax.Array, activation: Callable[[jax.Array], jax.Array], *, kernel: str,
              tile: int = 0) -> jax.Array:
  """Each row through its group's gated MLP, down(act(x gate) * x up); rows of no group give zeros."""
  rows, groups = x_RD.shape[0], w_gate_GDF.shape[0]
  p = plan(group_R, groups, kernel, tile)
  # Gate and up side by side: one product twice as wide per row, or per tile.
  w_gate_up_GDF = jnp.concatenate([w_gate_GDF, w_up_GDF], axis=-1)
  if p.tile_end_G is None:  # Sorted by group, the rows of none last (and their outputs zeros).
    args = (x_RD[p.order_R], w_gate_up_GDF, w_down_GFD, p.sizes_G, activation)
    if kernel == 'mosaic_gpu':
      y_RD = sorted_gated_mlp(*args, MOSAIC_GPU)
    else:  # XLA's ragged_dot, which autodiff differentiates.
      y_RD = _sorted_forward(*args, XLA)[0]
    return jnp.zeros_like(y_RD).at[p.order_R].set(y_RD, unique_indices=True)
  x_NTD = jnp.take(x_RD, p.source_P, axis=0, mode='fill', fill_value=0)
  x_NTD = x_NTD.reshape(-1, tile_rows(rows, groups, tile), x_RD.shape[-1])
  y_NTD = tiled_gated_mlp(x_NTD, w_gate_up_GDF, w_down_GFD, p.tile_end_G, activation)
  return jnp.where((group_R < groups)[:, None], y_NTD.reshape(-1, y_NTD.shape[-1])[p.padded_R], 0)
