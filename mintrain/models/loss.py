"""Token cross-entropy: the reference on logits, and the output layer fused with the loss, which never keeps
the (tokens x vocab) logits for the backward pass: per sequence chunk it forms the loss and, at once, the
gradients of the hidden states and output weights (exact; more chunks, less memory)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mintrain.models.layers import matmul
from mintrain.partitioning import AxisRules


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
  """Mean token cross-entropy in float32 over the targets that count: `weights` (the targets' shape)
  weigh each target's term, 0 leaving it out (padding); None counts every target. The vocab axis may
  be sharded."""
  losses = token_losses(logits, targets)
  if weights is None:
    return jnp.mean(losses)
  return jnp.sum(losses * weights) / counted(weights)


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Each target's cross-entropy (-log p) in float32, the shape of `targets`; vocab may be sharded."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
  return log_z - jnp.sum(logits * one_hot, axis=-1)


def counted(weights: jax.Array) -> jax.Array:
  """The sum of the weights, or 1 where none count (a micro-batch of chat prompts alone): the mean of
  nothing is then 0, with zero gradients, rather than NaN."""
  total = jnp.sum(weights)
  return jnp.where(total > 0, total, jnp.ones_like(total))


def _target_logits(x_BCD: jax.Array, w_DV: jax.Array, targets_BC: jax.Array) -> jax.Array:
  """The logit of each target: its output column dotted with the hidden state (no one-hot)."""
  w_BCD = w_DV.T.at[targets_BC].get(out_sharding=jax.typeof(x_BCD).sharding)
  return jnp.sum(x_BCD.astype(jnp.float32) * w_BCD.astype(jnp.float32), axis=-1)


def _loss_chunk(x_BCD: jax.Array, w_DV: jax.Array, targets_BC: jax.Array, weights_BC: jax.Array,
                rules: AxisRules, grads: bool, scale: jax.Array) -> tuple[jax.Array, jax.Array | None,
                                                                         jax.Array | None]:
  """(weighted summed loss, d loss/d x, d loss/d w) of one chunk; the gradients are of `scale` * the sum."""
  logits_BCV = rules.reshard(jnp.einsum('BCD,DV->BCV', x_BCD, w_DV, preferred_element_type=jnp.float32),
                             ('batch', 'length', 'vocab'))
  max_BC = jnp.max(logits_BCV, axis=-1)
  log_z_BC = max_BC + jnp.log(jnp.sum(jnp.exp(logits_BCV - max_BC[..., None]), axis=-1))
  loss = jnp.sum((log_z_BC - _target_logits(x_BCD, w_DV, targets_BC)) * weights_BC)
  if not grads:
    return loss, None, None
  # d(log_z)/d(logits) is the softmax, less 1 at the target: both matmuls below carry the targets' term,
  # formed in the same pass (a gather's gradient would be a scatter into a zeroed table, and its sum).
  vocab_BCV = jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, 2,
                                       out_sharding=jax.typeof(logits_BCV).sharding)
  softmax_BCV = jnp.exp(logits_BCV - log_z_BC[..., None])
  dlogits_BCV = ((softmax_BCV - (vocab_BCV == targets_BC[..., None])) * (weights_BC * scale)[..., None])
  dlogits_BCV = dlogits_BCV.astype(x_BCD.dtype)
  dx_BCD = matmul('BCV,DV->BCD', dlogits_BCV, w_DV, jax.typeof(x_BCD).sharding, x_BCD.dtype)
  dw_DV = matmul('BCD,BCV->DV', x_BCD, dlogits_BCV, jax.typeof(w_DV).sharding, w_DV.dtype)
  return loss, dx_BCD, dw_DV


def _chunked(x_BLD: jax.Array, w_DV: jax.Array, targets_BL: jax.Array, weights_BL: jax.Array,
             rules: AxisRules, chunks: int, grads: bool):
  """Runs `_loss_chunk` over `chunks` equal parts of the sequence; (mean loss, dx_BLD, dw_DV).

  Chunk n holds every `chunks`-th token from n on: a sum over tokens may take them in any order, and so
  a length split over devices (`mesh.context`) stays split within each chunk (while its C tokens divide),
  each device scanning its own tokens."""
  b, length, d = x_BLD.shape
  scale = 1.0 / counted(weights_BL)
  if chunks == 1:
    loss, dx, dw = _loss_chunk(x_BLD, w_DV, targets_BL, weights_BL, rules, grads, scale)
    return loss * scale, dx, dw
  c = length // chunks
  x_NBCD = jnp.moveaxis(x_BLD.reshape(b, c, chunks, d), 2, 0)
  targets_NBC, weights_NBC = (jnp.moveaxis(t.reshape(b, c, chunks), 2, 0) for t in (targets_BL, weights_BL))

  def body(carry, xs):
    loss_sum, dw_sum = carry
    x_BCD, targets_BC, weights_BC = xs
    loss, dx, dw = _loss_chunk(x_BCD, w_DV, targets_BC, weights_BC, rules, grads, scale)
    return (loss_sum + loss, dw_sum + dw if grads else None), dx

  zero_dw = jnp.zeros_like(w_DV) if grads else None
  (loss, dw), dx_NBCD = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zero_dw),
                                     (x_NBCD, targets_NBC, weights_NBC))
  if not grads:
    return loss * scale, None, None
  dx_BLD = jnp.moveaxis(dx_NBCD, 0, 2).reshape(b, length, d)
  return loss * scale, rules.reshard(dx_BLD, ('batch', 'length', 'embed')), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fused_cross_entropy(x_BLD: jax.Array, w_DV: jax.Array, targets_BL: jax.Array, weights_BL: jax.Array,
                        rules: AxisRules, chunks: int) -> jax.Array:
  """Mean cross-entropy of the logits `x_BLD @ w_DV` against `targets_BL` over the targets that count
  (`weights_BL`, as in `cross_entropy`), in float32.

  `chunks` must divide the length. Equals `cross_entropy(x @ w, targets, weights)`. The weights are
  data: they get no gradient.
  """
  return _chunked(x_BLD, w_DV, targets_BL, weights_BL, rules, chunks, grads=False)[0]


def _fwd(x_BLD, w_DV, targets_BL, weights_BL, rules, chunks):
  loss, dx, dw = _chunked(x_BLD, w_DV, targets_BL, weights_BL, rules, chunks, grads=True)
  return loss, (dx, dw)


def _bwd(rules, chunks, residuals, g):
  """The gradients were formed in the forward pass for a cotangent of 1; scale them by `g`."""
  dx, dw = residuals
  del rules, chunks
  return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None


fused_cross_entropy.defvjp(_fwd, _bwd)
