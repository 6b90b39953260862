"""QLoRA's frozen base at rest: int8 (absmax per output channel) or NF4 (the QLoRA paper's 4-bit NormalFloat,
block-wise absmax), dequantized where the layer gathers the weight. NF4 codes are packed two per byte, each
byte two neighbours along the weight's last axis (low nibble first): the packed array shards by the weight's
own logical axes, its last one half as long, and every device unpacks its own slice. Blocks run along the
last axis too."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The 16 NF4 values (Dettmers et al. 2023, appendix E; bitsandbytes' `get_4bit_type('nf4')`).
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)
INT8_MAX = 127.0


def quantize_int8(w: jax.Array, inputs: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(int8 codes, float32 scales): each output channel's absmax over the `inputs` axes maps to 127."""
  w = w.astype(jnp.float32)
  scale = jnp.max(jnp.abs(w), axis=inputs) / INT8_MAX
  safe = jnp.where(scale == 0, 1.0, scale)
  codes = jnp.clip(jnp.round(w / jnp.expand_dims(safe, inputs)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return codes, scale


def dequantize_int8(codes: jax.Array, scale: jax.Array, inputs: tuple[int, ...], dtype) -> jax.Array:
  return (codes.astype(jnp.float32) * jnp.expand_dims(scale, inputs)).astype(dtype)


def _blocks(x: jax.Array, block: int) -> jax.Array:
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def quantize_nf4(w: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """(uint8 codes 0..15 packed two per byte (`pack_nf4`), float32 absmax per block of `block` along the last
  axis, which must not be split): each value is the nearest NF4 value of its block's normalised weights."""
  w_blocks = _blocks(w.astype(jnp.float32), block)
  scale = jnp.max(jnp.abs(w_blocks), axis=-1)
  normed = w_blocks / jnp.where(scale == 0, 1.0, scale)[..., None]
  table = jnp.asarray(NF4, jnp.float32)
  codes = jnp.argmin(jnp.abs(normed[..., None] - table), axis=-1).astype(jnp.uint8)
  return pack_nf4(codes.reshape(w.shape)), scale


def pack_nf4(codes: jax.Array) -> jax.Array:
  """Codes (..., N), N even, as bytes (..., N / 2): element 2j in byte j's low nibble, 2j + 1 in its high."""
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nf4(packed: jax.Array) -> jax.Array:
  """The codes (..., 2 * N) of bytes (..., N), laid out as the bytes are: a split last axis stays split."""
  pairs = jnp.stack([packed & 15, packed >> 4], axis=-1)
  return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1], out_sharding=jax.typeof(packed).sharding)


def dequantize_nf4(packed: jax.Array, scale: jax.Array, block: int, dtype) -> jax.Array:
  """The weights of the packed codes; the block scales (whose last axis must not be split) are repeated
  rather than the codes reshaped into blocks, so the codes' last axis may split any number of ways."""
  codes = unpack_nf4(packed)
  # A select per code rather than a gather, which keeps the codes' sharding (and fuses).
  values = jnp.zeros(codes.shape, jnp.float32, out_sharding=jax.typeof(codes).sharding)
  for i, value in enumerate(NF4):
    values = jnp.where(codes == i, jnp.float32(value), values)
  return (values * jnp.repeat(scale, block, axis=-1)).astype(dtype)
