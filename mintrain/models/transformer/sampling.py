"""Autoregressive sampling from a language model with a KV cache (`decode` and `init_cache`).

Shape letters: B batch, P prompt length, N new tokens, S cache length (P + N), V vocab.

`generate` runs the prompt through the model once (prefill), then one decode step per
new token inside a single jitted `scan`: each step attends over the cached keys and
values instead of re-running the prefix. `generate_without_cache` is the reference it
must agree with: the training forward pass over the whole sequence at every step.
Call both under the mesh the model's parameters live on (`jax.set_mesh`).

Token i of the result is drawn with `fold_in(key, i)` from logits replicated on every
device, so a seed gives the same draws on every mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mintrain.models.layers import on_params_mesh
from mintrain.models.transformer.attention import KVCache
from mintrain.models.transformer.model import Transformer, at_position

# RoPE angles come from float32 positions, which are exact integers only up to 2**24.
MAX_POSITIONS = 2**24


def sample_token(logits_BV: jax.Array, key: jax.Array, *, temperature: float, top_k: int,
                 top_p: float = 1.0) -> jax.Array:
  """int32 (B,) next tokens: argmax at temperature 0, else a draw from softmax(logits / temperature).

  `top_k` > 0 keeps only the k largest logits of each row (ties with the k-th are kept too); `top_p` < 1
  only the most likely tokens whose probabilities sum to top_p (nucleus). `key` is one key, or one per row.
  """
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_k:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if top_p < 1:
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    kept_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < top_p  # The mass before a token is below top_p.
    last_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < last_B1, -jnp.inf, logits_BV)
  if key.ndim:
    return jax.vmap(jax.random.categorical)(key, logits_BV).astype(jnp.int32)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def _check(model: Transformer, prompt_BP: jax.Array, max_new_tokens: int, temperature: float,
           top_k: int) -> None:
  """Argument errors before tracing, each naming the fix."""
  shape = np.shape(prompt_BP)
  if len(shape) != 2 or shape[1] < 1:
    raise ValueError(f'prompt tokens must be (batch, length) with length >= 1 (e.g. just BOS); '
                     f'got shape {shape}.')
  if max_new_tokens < 1:
    raise ValueError(f'max_new_tokens={max_new_tokens} must be at least 1.')
  if shape[1] + max_new_tokens > MAX_POSITIONS:
    raise ValueError(f'prompt length {shape[1]} + max_new_tokens {max_new_tokens} exceeds '
                     f'{MAX_POSITIONS} positions, beyond which float32 RoPE angles are inexact.')
  if temperature < 0:
    raise ValueError(f'temperature={temperature} must be >= 0 (0 means greedy).')
  if not 0 <= top_k <= model.cfg.vocab_size:
    raise ValueError(f'top_k={top_k} must be in [0, vocab_size={model.cfg.vocab_size}] (0 means no limit).')


def _replicated(prompt_BP: jax.Array) -> jax.Array:
  """The prompt as int32 on every device of the current mesh, where the model's arrays live."""
  return jax.sharding.reshard(jnp.asarray(prompt_BP, jnp.int32), jax.P())


def _by_rows(logits_BV: jax.Array) -> jax.Array:
  """The logits with each device's rows whole over the vocabulary, which top-k, top-p and the draw
  compare across; the rows stay split as the model's are (the draws are the same bits however the rows
  split), so no device gathers and samples the whole batch's."""
  spec = jax.typeof(logits_BV).sharding.spec
  return jax.sharding.reshard(logits_BV, jax.P(spec[0] if spec else None, None))


def _next_token(logits_BV: jax.Array, key: jax.Array, i: jax.Array | int, temperature: float,
                top_k: int) -> jax.Array:
  """Token i from the logits of the position before it, replicated (the next step's input)."""
  drawn_B = sample_token(_by_rows(logits_BV), jax.random.fold_in(key, i), temperature=temperature,
                         top_k=top_k)
  return jax.sharding.reshard(drawn_B, jax.P())


@on_params_mesh
def generate(model: Transformer, prompt_BP: jax.Array, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, key: jax.Array | None = None) -> jax.Array:
  """int32 (B, N) tokens that follow each prompt row: one prefill, then one cached step per token."""
  return _generate(*_prepare(model, prompt_BP, max_new_tokens, temperature, top_k, key),
                   max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=int(top_k))


def _prepare(model: Transformer, prompt_BP: jax.Array, max_new_tokens: int, temperature: float, top_k: int,
             key: jax.Array | None) -> tuple[nnx.GraphDef, nnx.State, jax.Array, jax.Array]:
  """Checked arguments of the jitted generators: (graphdef, params, replicated prompt, key)."""
  _check(model, prompt_BP, max_new_tokens, temperature, top_k)
  graphdef, params = nnx.split(model)
  return graphdef, params, _replicated(prompt_BP), jax.random.key(0) if key is None else key


@functools.partial(jax.jit, static_argnames=('graphdef', 'max_new_tokens', 'temperature', 'top_k'))
def _generate(graphdef: nnx.GraphDef, params: nnx.State, prompt_BP: jax.Array, key: jax.Array, *,
              max_new_tokens: int, temperature: float, top_k: int) -> jax.Array:
  model = nnx.merge(graphdef, params)
  batch, prompt_len = prompt_BP.shape
  cache = model.init_cache(batch, prompt_len + max_new_tokens, jnp.dtype(model.cfg.compute_dtype))
  # The prefill splits the prompt over `context` (mesh.context); the tokens beyond the split's last
  # multiple follow one at a time, as decode steps.
  split = prompt_len - prompt_len % model.length_ways
  if split:
    logits_B1V, cache = model.decode(prompt_BP[:, :split], cache, 0, last=split - 1)
    last_BV = logits_B1V[:, 0]
  for position in range(split, prompt_len):
    logits_B1V, cache = model.decode(prompt_BP[:, position:position + 1], cache, position)
    last_BV = logits_B1V[:, 0]
  first_B = _next_token(last_BV, key, 0, temperature, top_k)

  def step(carry: tuple[jax.Array, KVCache], i: jax.Array) -> tuple[tuple[jax.Array, KVCache], jax.Array]:
    token_B, cache = carry  # Token i - 1, at position prompt_len + i - 1.
    logits_B1V, cache = model.decode(token_B[:, None], cache, prompt_len + i - 1)
    next_B = _next_token(logits_B1V[:, 0], key, i, temperature, top_k)
    return (next_B, cache), next_B

  _, rest_NB = jax.lax.scan(step, (first_B, cache), jnp.arange(1, max_new_tokens))
  return jnp.concatenate([first_B[None], rest_NB], axis=0).T


@on_params_mesh
def generate_without_cache(model: Transformer, prompt_BP: jax.Array, max_new_tokens: int, *,
                           temperature: float = 0.0, top_k: int = 0,
                           key: jax.Array | None = None) -> jax.Array:
  """What `generate` must return, by the training forward pass over the whole sequence at every step.

  The sequence lives in a (B, P + N) buffer whose not-yet-sampled tail is zeros; the causal
  mask keeps those from the logits of the positions read, so one compiled step serves all N.
  """
  return _generate_without_cache(*_prepare(model, prompt_BP, max_new_tokens, temperature, top_k, key),
                                 max_new_tokens=max_new_tokens, temperature=float(temperature),
                                 top_k=int(top_k))


@functools.partial(jax.jit, static_argnames=('graphdef', 'max_new_tokens', 'temperature', 'top_k'))
def _generate_without_cache(graphdef: nnx.GraphDef, params: nnx.State, prompt_BP: jax.Array, key: jax.Array,
                            *, max_new_tokens: int, temperature: float, top_k: int) -> jax.Array:
  model = nnx.merge(graphdef, params)
  batch, prompt_len = prompt_BP.shape
  tokens_BS = jnp.zeros((batch, prompt_len + max_new_tokens), jnp.int32)
  tokens_BS = jax.lax.dynamic_update_slice(tokens_BS, prompt_BP, (0, 0))

  def step(tokens_BS: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits_BSV = model(tokens_BS)
    next_B = _next_token(at_position(logits_BSV, prompt_len + i - 1), key, i, temperature, top_k)
    return jax.lax.dynamic_update_slice(tokens_BS, next_B[:, None], (0, prompt_len + i)), next_B

  _, tokens_NB = jax.lax.scan(step, tokens_BS, jnp.arange(max_new_tokens))
  return tokens_NB.T


@on_params_mesh
def complete(model: Transformer, prompt_BP: np.ndarray, lengths_B: np.ndarray, max_new_tokens: int, *,
             temperature: float, top_p: float, keys_B: jax.Array) -> jax.Array:
  """int32 (B, N) tokens that follow the first lengths_B[b] tokens of each prompt row (prompts of several
  lengths, padded on the right): token i of row b is drawn with fold_in(keys_B[b], i), so a row's draws
  depend on neither the mesh nor the rows beside it. Every prompt is one prefill (one program for every
  batch of a width), then each row takes one cached step per new token at its own position."""
  lengths_B = np.asarray(lengths_B)
  _check(model, prompt_BP, max_new_tokens, temperature, 0)
  if not 0 < top_p <= 1 or lengths_B.min() < 1 or lengths_B.max() > np.shape(prompt_BP)[1]:
    raise ValueError(f'top_p={top_p} must be in (0, 1] and prompt lengths in [1, {np.shape(prompt_BP)[1]}].')
  # The prefill splits over `context`: the width rounded up to its multiple, the rest padding.
  prompt_BP = np.pad(prompt_BP, ((0, 0), (0, -np.shape(prompt_BP)[1] % model.length_ways)))
  graphdef, params = nnx.split(model)
  return _complete(graphdef, params, _replicated(prompt_BP), _replicated(lengths_B), keys_B,
                   max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p))


@functools.partial(jax.jit, static_argnames=('graphdef', 'max_new_tokens', 'temperature', 'top_p'))
def _complete(graphdef: nnx.GraphDef, params: nnx.State, prompt_BP: jax.Array, lengths_B: jax.Array,
              keys_B: jax.Array, *, max_new_tokens: int, temperature: float, top_p: float) -> jax.Array:
  model = nnx.merge(graphdef, params)
  batch, prompt_len = prompt_BP.shape
  keys_B = jax.sharding.reshard(keys_B, jax.P())
  cache = model.init_cache(batch, prompt_len + max_new_tokens, jnp.dtype(model.cfg.compute_dtype))

  def draw(logits_BV: jax.Array, i: jax.Array | int) -> jax.Array:
    """Each row's new token i, replicated (the next step's input)."""
    logits_BV = _by_rows(logits_BV)
    row_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, i)
    row_keys_B = jax.sharding.reshard(row_keys_B, jax.P(jax.typeof(logits_BV).sharding.spec[0]))
    return jax.sharding.reshard(sample_token(logits_BV, row_keys_B, temperature=temperature, top_k=0,
                                             top_p=top_p), jax.P())

  # A row's slots past its prompt hold its padding's keys until its own tokens overwrite them, each
  # before any token reads it.
  logits_B1V, cache = model.decode(prompt_BP, cache, 0, last=lengths_B - 1)
  first_B = draw(logits_B1V[:, 0], 0)

  def step(carry: tuple[jax.Array, KVCache], i: jax.Array) -> tuple[tuple[jax.Array, KVCache], jax.Array]:
    token_B, cache = carry  # Token i - 1 of each row, at position lengths_B + i - 1.
    logits_B1V, cache = model.decode(token_B[:, None], cache, lengths_B + i - 1)
    next_B = draw(logits_B1V[:, 0], i)
    return (next_B, cache), next_B

  _, rest_NB = jax.lax.scan(step, (first_B, cache), jnp.arange(1, max_new_tokens))
  return jnp.concatenate([first_B[None], rest_NB], axis=0).T
