#!/usr/bin/env python
"""What the framework costs: the mintrain train step against a hand-written JAX step of the same model.

The hand-written step below imports nothing from mintrain. It is the same transformer (pre-norm RMSNorm,
RoPE, causal multi-head attention, SwiGLU MLP, tied or untied output), the same loss formula and the same
optimizer (AdamW with warmup-cosine schedule, global-norm clipping, decay on matrices but not on the
embedding), on the same devices in the same mesh shape, written the plain way: a dict of arrays, one
PartitionSpec per weight, Auto mesh axes and `jax.jit`, activations constrained only at block boundaries.

Both start from the same parameters (mintrain's initial ones, copied) and see the same batches, so their
losses must agree step by step; that checks the hand-written model is the same math. Steps of the two
alternate, so load from other processes on a shared machine slows both alike.

  python benchmarks/overhead.py                     # mintrain/configs/bench_tiny.py (~1.5 min on 2 CPU cores)
  python benchmarks/overhead.py --config mintrain/configs/fsdp8.py --override model.tie_embeddings=False
  python benchmarks/overhead.py --smoke             # a tiny model, one step: checks that it still runs
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

import harness
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# ---------------------------------------------------------------------------------------------------------
# The hand-written step: plain JAX and optax. Shape letters: B batch, L length, D embed, F mlp, H heads,
# K head dim, V vocab. `hp` is a plain dict of the model and optimizer hyperparameters.
# ---------------------------------------------------------------------------------------------------------
MESH_AXES = ('stage', 'data', 'fsdp', 'expert', 'context', 'model')
BATCH = ('data', 'fsdp', 'expert')
BLOCK_SPECS = {  # Megatron column/row pairs on `model`; FSDP splits the embed dimension at rest.
    'attn_norm': P('fsdp'), 'wq_DHK': P('fsdp', 'model', None), 'wk_DHK': P('fsdp', 'model', None),
    'wv_DHK': P('fsdp', 'model', None), 'wo_HKD': P('model', None, 'fsdp'), 'mlp_norm': P('fsdp'),
    'wi_gate_DF': P('fsdp', 'model'), 'wi_up_DF': P('fsdp', 'model'), 'wo_FD': P('model', 'fsdp'),
}


def hand_specs(hp: dict) -> dict:
  specs = {'embedding_VD': P('model', 'fsdp'), 'final_norm': P('fsdp'),
           'blocks': [dict(BLOCK_SPECS) for _ in range(hp['num_layers'])]}
  if not hp['tie_embeddings']:
    specs['unembed_DV'] = P('fsdp', 'model')
  return specs


def rms_norm(x_BLD: jax.Array, scale_D: jax.Array) -> jax.Array:
  x = x_BLD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  return (x * scale_D.astype(jnp.float32)).astype(x_BLD.dtype)


def rotate(x_BLHK: jax.Array, base: float) -> jax.Array:
  """Rotary embedding, split-half convention."""
  seq_len, half = x_BLHK.shape[1], x_BLHK.shape[-1] // 2
  angle_LK = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * base ** (-jnp.arange(half) / half)[None, :]
  sin, cos = jnp.sin(angle_LK)[None, :, None, :], jnp.cos(angle_LK)[None, :, None, :]
  x = x_BLHK.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


def block(p: dict, x_BLD: jax.Array, hp: dict) -> jax.Array:
  dt = x_BLD.dtype
  h_BLD = rms_norm(x_BLD, p['attn_norm'])
  q_BLHK = rotate(jnp.einsum('BLD,DHK->BLHK', h_BLD, p['wq_DHK'].astype(dt)), hp['rope_base'])
  k_BLHK = rotate(jnp.einsum('BLD,DHK->BLHK', h_BLD, p['wk_DHK'].astype(dt)), hp['rope_base'])
  v_BLHK = jnp.einsum('BLD,DHK->BLHK', h_BLD, p['wv_DHK'].astype(dt))
  seq_len = x_BLD.shape[1]
  scores_BHLM = jnp.einsum('BLHK,BMHK->BHLM', q_BLHK, k_BLHK).astype(jnp.float32) * hp['head_dim'] ** -0.5
  causal_LM = jnp.tril(jnp.ones((seq_len, seq_len), bool))
  probs_BHLM = jax.nn.softmax(jnp.where(causal_LM, scores_BHLM, jnp.finfo(jnp.float32).min), -1).astype(dt)
  attn_BLHK = jnp.einsum('BHLM,BMHK->BLHK', probs_BHLM, v_BLHK)
  x_BLD = x_BLD + jnp.einsum('BLHK,HKD->BLD', attn_BLHK, p['wo_HKD'].astype(dt))
  h_BLD = rms_norm(x_BLD, p['mlp_norm'])
  gate_BLF = jnp.einsum('BLD,DF->BLF', h_BLD, p['wi_gate_DF'].astype(dt))
  up_BLF = jnp.einsum('BLD,DF->BLF', h_BLD, p['wi_up_DF'].astype(dt))
  x_BLD = x_BLD + jnp.einsum('BLF,FD->BLD', jax.nn.silu(gate_BLF) * up_BLF, p['wo_FD'].astype(dt))
  return jax.lax.with_sharding_constraint(x_BLD, P(BATCH, None, None))


def hand_loss(params: dict, tokens_BL: jax.Array, targets_BL: jax.Array, hp: dict) -> jax.Array:
  """Mean token cross-entropy in float32: log-sum-exp minus the target's logit."""
  dt = jnp.dtype(hp['compute_dtype'])
  table_VD = params['embedding_VD'].astype(dt)
  x_BLD = jax.lax.with_sharding_constraint(table_VD[tokens_BL], P(BATCH, None, None))
  for p in params['blocks']:
    x_BLD = block(p, x_BLD, hp)
  x_BLD = rms_norm(x_BLD, params['final_norm'])
  if hp['tie_embeddings']:
    logits_BLV = jnp.einsum('BLD,VD->BLV', x_BLD, table_VD).astype(jnp.float32)
  else:
    logits_BLV = jnp.einsum('BLD,DV->BLV', x_BLD, params['unembed_DV'].astype(dt)).astype(jnp.float32)
  one_hot_BLV = jax.nn.one_hot(targets_BL, logits_BLV.shape[-1], dtype=jnp.float32)
  return jnp.mean(jax.nn.logsumexp(logits_BLV, axis=-1) - jnp.sum(logits_BLV * one_hot_BLV, axis=-1))


def hand_optimizer(hp: dict) -> optax.GradientTransformation:
  warmup = min(hp['warmup_steps'], hp['steps'])
  lr = optax.warmup_cosine_decay_schedule(0.0, hp['learning_rate'], warmup, max(hp['steps'], warmup + 1),
                                          hp['learning_rate'] * hp['end_lr_fraction'])
  def decay_mask(params: dict) -> dict:
    mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    mask['embedding_VD'] = False
    return mask
  clip = optax.clip_by_global_norm(hp['grad_clip_norm']) if hp['grad_clip_norm'] > 0 else optax.identity()
  return optax.chain(clip, optax.adamw(lr, b1=hp['b1'], b2=hp['b2'], eps=hp['eps'],
                                       weight_decay=hp['weight_decay'], mask=decay_mask))


def make_hand_step(hp: dict, mesh: jax.sharding.Mesh, params: dict):
  """(jitted step (params, opt_state, tokens, targets) -> (params, opt_state, loss), opt_state)."""
  tx = hand_optimizer(hp)
  param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), hand_specs(hp))
  opt_state = jax.jit(tx.init)(params)  # Adam moments follow their params; step counts are replicated.
  opt_sh = jax.tree.map(
      lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else NamedSharding(mesh, P()), opt_state)
  opt_state = jax.device_put(opt_state, opt_sh)
  data_sh = NamedSharding(mesh, P(BATCH, None))

  def step(params, opt_state, tokens_BL, targets_BL):
    loss, grads = jax.value_and_grad(hand_loss)(params, tokens_BL, targets_BL, hp)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, in_shardings=(param_sh, opt_sh, data_sh, data_sh),
                 out_shardings=(param_sh, opt_sh, None), donate_argnums=(0, 1)), opt_state


# ---------------------------------------------------------------------------------------------------------
# The comparison.
# ---------------------------------------------------------------------------------------------------------
def hyperparameters(config) -> dict:
  return {**dataclasses.asdict(config.model), **dataclasses.asdict(config.optimizer),
          'steps': config.train.steps}


def copy_params(mintrain_params, hp: dict, mesh: jax.sharding.Mesh) -> dict:
  """mintrain's nnx.State as the hand-written dict, copied (mintrain's step donates its own buffers)."""
  src = mintrain_params.to_pure_dict()
  tree = {'embedding_VD': src['embedding_VD'], 'final_norm': src['final_norm']['scale'], 'blocks': []}
  for i in range(hp['num_layers']):
    # With model.scan_layers, one block holds every layer's parameters on a leading axis.
    b = src['blocks'][i] if i in src['blocks'] else jax.tree.map(lambda x, i=i: x[i], src['blocks'])
    tree['blocks'].append({
        'attn_norm': b['attn_norm']['scale'], 'mlp_norm': b['mlp_norm']['scale'],
        **{k: b['attn'][k] for k in ('wq_DHK', 'wk_DHK', 'wv_DHK', 'wo_HKD')},
        **{k: b['mlp'][k] for k in ('wi_gate_DF', 'wi_up_DF', 'wo_FD')}})
  if not hp['tie_embeddings']:
    tree['unembed_DV'] = src['unembed_DV']
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s), may_alias=False), tree,
                      hand_specs(hp))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser)
  parser.add_argument('--steps', type=int, default=5, help='timed steps of each')
  parser.add_argument('--warmup', type=int, default=harness.WARMUP, help='untimed steps of each first')
  parser.add_argument('--smoke', action='store_true', help='tiny model, one step (a few seconds)')
  args = parser.parse_args()

  devices = harness.start_devices()
  path, overrides = harness.bench_tiny() if args.config is None else (args.config.resolve(), ())
  overrides += tuple(args.override) + (harness.SMOKE if args.smoke else ())
  steps, warmup = (1, 1) if args.smoke else (args.steps, args.warmup)
  config = harness.load(path, overrides)
  if config.model_name != 'transformer' or config.train.grad_accum_steps != 1 or config.model.dropout_rate:
    print('overhead.py compares the transformer with grad_accum_steps=1 and no dropout only.')
    return 1
  hp = hyperparameters(config)

  ours, built, batches = harness.prepare(config, devices)
  hand_mesh = jax.make_mesh(tuple(built.mesh.shape.values()), MESH_AXES,
                            axis_types=(AxisType.Auto,) * len(MESH_AXES),
                            devices=built.mesh.devices.flatten())
  params = copy_params(ours.state.params, hp, hand_mesh)
  hand_step, opt_state = make_hand_step(hp, hand_mesh, params)
  data_sh = NamedSharding(hand_mesh, P(BATCH, None))
  hand_batches = [(jax.device_put(b['inputs'][0], data_sh, may_alias=False),
                   jax.device_put(b['targets'][0], data_sh, may_alias=False)) for b in batches]
  with jax.set_mesh(hand_mesh):  # For the activation constraints' PartitionSpecs.
    start = time.perf_counter()
    hand_compiled = hand_step.lower(params, opt_state, *hand_batches[0]).compile()
    hand_compile_s = time.perf_counter() - start

  state = ours.state
  times = {'mintrain': [], 'hand': []}
  losses = {'mintrain': [], 'hand': []}
  with jax.set_mesh(built.mesh):
    for i in range(warmup + steps):
      batch, (tokens, targets) = batches[i % len(batches)], hand_batches[i % len(batches)]
      start = time.perf_counter()
      state, metrics = ours.compiled(state, batch)
      jax.block_until_ready((state, metrics))
      elapsed_ours = time.perf_counter() - start
      start = time.perf_counter()
      params, opt_state, loss = hand_compiled(params, opt_state, tokens, targets)
      jax.block_until_ready((params, opt_state, loss))
      elapsed_hand = time.perf_counter() - start
      if i >= warmup:
        times['mintrain'].append(elapsed_ours)
        times['hand'].append(elapsed_hand)
      losses['mintrain'].append(float(metrics['loss']))
      losses['hand'].append(float(loss))

  rows = []
  for name, compile_s in (('mintrain', ours.total_s), ('hand', hand_compile_s)):
    rows.append([name, f'{compile_s:.1f}', f'{statistics.median(times[name]) * 1e3:.1f}',
                 harness.spread(times[name]), f'{losses[name][0]:.4f}', f'{losses[name][-1]:.4f}'])
  ratio = statistics.median(times['mintrain']) / statistics.median(times['hand'])
  paired = statistics.median([a / b for a, b in zip(times['mintrain'], times['hand'])])
  max_diff = max(abs(a - b) for a, b in zip(losses['mintrain'], losses['hand']))
  print(f'\nconfig {harness.describe_config(path, overrides)}')
  print(f'mesh {harness.describe_mesh(built.mesh)}, {harness.param_count(built):,} parameters, '
        f'compute {config.model.compute_dtype}, tie_embeddings={config.model.tie_embeddings}; medians of '
        f'{steps} alternating steps after {warmup} warm-up; losses of the first and last step\n')
  print(harness.table(['step', 'compile_s', 'step_ms', 'spread', 'loss_first', 'loss_last'], rows))
  print(f'\nmintrain / hand-written step time: {ratio:.3f} (median of per-step ratios {paired:.3f})')
  print(f'largest loss difference over {len(losses["hand"])} steps: {max_diff:.2e}; '
        f'ln(vocab) = {math.log(config.model.vocab_size):.4f}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
