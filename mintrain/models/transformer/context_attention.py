"""Attention over a sequence split across devices (context parallelism, `mesh.context`).

Shape letters: B batch, L query length (C: one device's chunk of it), M key length, H heads, K head dim.

Which key a query sees is a function of their positions and segment ids (`visible`), never of where they
sit in the arrays, so the sequence may be stored in any order. 'all_gather' gathers keys and values whole
before attention; the ring (`ring_attention`) passes them one hop round the n devices n - 1 times,
overlapped with an online-softmax attention to each block. For causal load balance the ring stores the
sequence in `zigzag_order` (device i holds chunks i and 2n-1-i of 2n), so every device does the same work.
A local layer's sliding window is part of `visible`; the ring skips the blocks of keys wholly outside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mintrain.models.layers import matmul

NEG = float(jnp.finfo(jnp.float32).min)  # A masked score: exp(NEG - m) is 0 for any real m.


def visible(q_pos: jax.Array, k_pos: jax.Array, q_seg: jax.Array | None = None,
            k_seg: jax.Array | None = None, window: int = 0) -> jax.Array:
  """bool (..., L, M): query l may see key m, causally by position, within its segment (document) and,
  with a `window`, only the `window` positions up to its own (transformers' sliding window).

  Positions are (L,) and (M,), or (B, L) and (B, M) per row; segment ids, if given, are (B, L), (B, M).
  """
  mask = k_pos[..., None, :] <= q_pos[..., :, None]
  if window:
    mask = mask & (q_pos[..., :, None] - k_pos[..., None, :] < window)
  if q_seg is not None:
    mask = mask & (q_seg[..., :, None] == k_seg[..., None, :])
  return mask


def scores(q_BLHK: jax.Array, k_BMHK: jax.Array, scale: float, softcap: float) -> jax.Array:
  """float32 (B, H, L, M) attention scores, soft-capped to softcap * tanh(s / softcap) when softcap > 0."""
  scores_BHLM = matmul('BLHK,BMHK->BHLM', q_BLHK, k_BMHK, dtype=jnp.float32) * scale
  if softcap:
    scores_BHLM = softcap * jnp.tanh(scores_BHLM / softcap)
  return scores_BHLM


def zigzag_order(seq_len: int, ways: int) -> np.ndarray:
  """int32 (L,): the positions in storage order for a sequence split `ways` ways, device i holding
  chunks i and 2*ways-1-i of 2*ways equal chunks (`seq_len` must divide by 2 * ways)."""
  chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * ways, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * ways - 1 - i]]) for i in range(ways)])


def _update(acc: tuple[jax.Array, jax.Array, jax.Array], q_BCHK: jax.Array, k_BMHK: jax.Array,
            v_BMHK: jax.Array, mask_BCM: jax.Array, scale: float,
            softcap: float, window: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One block of the online softmax: the running (output sum o_BCHK, max m_BHC, normaliser l_BHC), all
  float32, updated with keys k and values v; with a window, skipped when the mask hides the whole block
  (keys wholly before the window). The max is a constant to autodiff: the output o / l does not depend
  on it."""
  block = functools.partial(_block, scale=scale, softcap=softcap)
  if not window:
    return block(acc, q_BCHK, k_BMHK, v_BMHK, mask_BCM)
  return jax.lax.cond(jnp.any(mask_BCM), block, lambda acc, *_: acc, acc, q_BCHK, k_BMHK, v_BMHK, mask_BCM)


def _block(acc: tuple[jax.Array, jax.Array, jax.Array], q_BCHK: jax.Array, k_BMHK: jax.Array,
           v_BMHK: jax.Array, mask_BCM: jax.Array, *, scale: float,
           softcap: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  o_BCHK, m_BHC, l_BHC = acc
  scores_BHCM = scores(q_BCHK, k_BMHK, scale, softcap)
  mask_B1CM = mask_BCM[:, None]
  scores_BHCM = jnp.where(mask_B1CM, scores_BHCM, NEG)
  m_new_BHC = jax.lax.stop_gradient(jnp.maximum(m_BHC, jnp.max(scores_BHCM, axis=-1)))
  p_BHCM = jnp.where(mask_B1CM, jnp.exp(scores_BHCM - m_new_BHC[..., None]), 0.0)
  correction_BHC = jnp.exp(m_BHC - m_new_BHC)
  l_BHC = l_BHC * correction_BHC + jnp.sum(p_BHCM, axis=-1)
  pv_BCHK = matmul('BHCM,BMHK->BCHK', p_BHCM.astype(v_BMHK.dtype), v_BMHK, dtype=jnp.float32)
  o_BCHK = o_BCHK * jnp.moveaxis(correction_BHC, 1, 2)[..., None] + pv_BCHK
  return o_BCHK, m_new_BHC, l_BHC


def _halves(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """The two chunks a device holds (`zigzag_order`), along `axis`."""
  half = x.shape[axis] // 2
  return jax.lax.slice_in_dim(x, 0, half, axis=axis), jax.lax.slice_in_dim(x, half, None, axis=axis)


def _mask(q_pos: jax.Array, k_pos: jax.Array, q_seg: jax.Array | None, k_seg: jax.Array | None,
          batch: int, window: int) -> jax.Array:
  """`visible` as (B, C, M), broadcast over the batch when there are no segment ids."""
  mask = visible(q_pos, k_pos, q_seg, k_seg, window)
  return jnp.broadcast_to(mask, (batch, *mask.shape[-2:]))


def _ring(q_BCHK: jax.Array, k_BCHK: jax.Array, v_BCHK: jax.Array, q_pos: jax.Array,
          k_pos: jax.Array, q_seg_BC: jax.Array | None, k_seg_BC: jax.Array | None, *,
          axes: tuple[str, ...], n: int, scale: float, softcap: float, window: int) -> jax.Array:
  """One device's part: its (zigzag) chunk of queries against every device's keys, n - 1 hops."""
  b, c, h, k = q_BCHK.shape
  acc = (jnp.zeros((b, c, h, k), jnp.float32), jnp.full((b, h, c), NEG, jnp.float32),
         jnp.zeros((b, h, c), jnp.float32))
  segs = q_seg_BC is not None
  # The diagonal block: causal within the two chunks (the mask does it).
  acc = _update(acc, q_BCHK, k_BCHK, v_BCHK, _mask(q_pos, k_pos, q_seg_BC, k_seg_BC, b, window), scale,
                softcap, window=0)  # Never skipped: each query sees itself.
  me = jax.lax.axis_index(axes)
  ring = [(j, (j + 1) % n) for j in range(n)]  # After s hops, a device holds the keys of device me - s.
  kv = (k_BCHK, v_BCHK, k_pos, *((k_seg_BC,) if segs else ()))
  q_seg_halves = _halves(q_seg_BC, 1) if segs else (None, None)
  q_halves, q_pos_halves = _halves(q_BCHK, 1), _halves(q_pos, 1)

  def earlier(acc, kv):
    """Keys of a device before this one: all queries see their first chunk only."""
    k, v, pos, *seg = (_halves(x, 1)[0] for x in kv)
    mask = _mask(q_pos, pos, q_seg_BC, seg[0] if seg else None, b, window)
    return _update(acc, q_BCHK, k, v, mask, scale, softcap, window)

  def later(acc, kv):
    """Keys of a device after this one: only the queries' second chunk sees them, all of them."""
    k, v, pos, *seg = kv
    (o0, o1), (m0, m1), (norm0, norm1) = _halves(acc[0], 1), _halves(acc[1], 2), _halves(acc[2], 2)
    mask = _mask(q_pos_halves[1], pos, q_seg_halves[1], seg[0] if seg else None, b, window)
    o1, m1, norm1 = _update((o1, m1, norm1), q_halves[1], k, v, mask, scale, softcap, window)
    return jnp.concatenate([o0, o1], 1), jnp.concatenate([m0, m1], 2), jnp.concatenate([norm0, norm1], 2)

  for step in range(1, n):
    kv = tuple(jax.lax.ppermute(x, axes, ring) for x in kv)
    source = (me - step) % n
    acc = jax.lax.cond(source < me, earlier, later, acc, kv)
  o_BCHK, _, l_BHC = acc
  return (o_BCHK / jnp.moveaxis(l_BHC, 1, 2)[..., None]).astype(q_BCHK.dtype)


def ring_attention(q_BLHK: jax.Array, k_BLHK: jax.Array, v_BLHK: jax.Array, positions: jax.Array,
                   segments_BL: jax.Array | None, *, spec: P, scale: float, softcap: float = 0.0,
                   window: int = 0) -> jax.Array:
  """Softmax attention (BLHK) of the queries over the keys they may see (`visible`), with the length
  split over the ring of mesh axes `spec[1]` and stored in `zigzag_order`.

  `spec` is the layout of q, k and v (batch, length, heads, head dim), k and v already with as many
  heads as q. The output has that layout too. `positions` are (1, L) when every row has the same, or
  (B, L) where they differ by row (packed documents, each from 0), and `segments_BL` the documents'
  ids, or None for one per row; both in the same (zigzag) order as the tokens. `softcap` and `window`
  as in `scores` and `visible`.
  """
  axes = (spec[1],) if isinstance(spec[1], str) else tuple(spec[1])
  mesh = jax.sharding.get_abstract_mesh()
  n = int(np.prod([mesh.shape[a] for a in axes]))
  seg_spec = P(spec[0], spec[1])
  pos_spec = seg_spec if positions.shape[0] > 1 else P(None, spec[1])
  segs = () if segments_BL is None else (segments_BL, segments_BL)

  def body(q, k, v, q_pos, k_pos, *seg):
    q_seg, k_seg = seg if seg else (None, None)
    return _ring(q, k, v, q_pos, k_pos, q_seg, k_seg, axes=axes, n=n, scale=scale, softcap=softcap,
                 window=window)

  ring = jax.shard_map(body, in_specs=(spec, spec, spec, pos_spec, pos_spec, *(seg_spec,) * len(segs)),
                       out_specs=spec)
  positions = jax.sharding.reshard(positions, pos_spec)
  segs = tuple(jax.sharding.reshard(s, seg_spec) for s in segs)
  return ring(q_BLHK, k_BLHK, v_BLHK, positions, positions, *segs)
