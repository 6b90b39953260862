"""Grouped-query and multi-query attention (`model.num_kv_heads`): the multi-head computation with each
key/value head shared by its group, on any mesh, in training and in the KV-cached decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import build, load_config, mesh_devices, quiet

from mintrain import loop as train_loop
from mintrain import partitioning
from mintrain.errors import ConfigError
from mintrain.models.transformer import sampling

# 8 query heads in 2 groups of 4; batch 8 splits over every config's `batch` axes.
GQA = ('model.vocab_size=384', 'model.embed_dim=32', 'model.mlp_dim=64', 'model.num_heads=8',
       'model.num_kv_heads=2', 'train.global_batch_size=8')


def model_of(name, *overrides, seed=0):
  """(run, model) of config `name`, parameters drawn from `seed` in the run's layout."""
  setup = build(load_config(name, *overrides))
  with jax.set_mesh(setup.mesh):
    model = setup.config.family.make(setup.config.model, setup.rules, setup.placement, nnx.Rngs(params=seed))
  return setup, model


def tokens(shape, seed=0):
  return np.random.RandomState(seed).randint(0, 384, shape).astype(np.int32)


def logits(setup, model, tokens_BL):
  graphdef, params = nnx.split(model)
  with jax.set_mesh(setup.mesh):
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens_BL))


def test_grouped_attention_is_multi_head_attention_with_each_kv_head_repeated_for_its_group():
  gqa_setup, gqa = model_of('single', *GQA)
  mha_setup, mha = model_of('single', *GQA, 'model.num_kv_heads=0')
  assert gqa.blocks[0].attn.wk_DHK.shape == (32, 2, 16) and mha.blocks[0].attn.wk_DHK.shape == (32, 8, 16)
  _, gqa_params = nnx.split(gqa)
  graphdef, mha_params = nnx.split(mha)
  flat = dict(nnx.to_flat_state(gqa_params))
  for path, var in nnx.to_flat_state(mha_params):
    value = flat[path][...]
    if path[-1] in ('wk_DHK', 'wv_DHK'):
      value = jnp.repeat(value, 4, axis=1)  # Query head h reads group h // 4 (transformers' repeat_kv).
    var.set_value(value)
  x = tokens((2, 16))
  np.testing.assert_allclose(logits(gqa_setup, gqa, x), logits(mha_setup, nnx.merge(graphdef, mha_params), x),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('overrides,meshes', [
    pytest.param((), ('dp4_tp2', 'tp8'), marks=pytest.mark.slow),  # Split kv heads, and replicated ones.
    pytest.param(('model.num_kv_heads=1',), ('tp8',), marks=pytest.mark.slow),  # As Gemma's parity.
    pytest.param((), ('fsdp4_tp2', 'fsdp8'), marks=pytest.mark.slow),
], ids=['grouped', 'multi-query', 'grouped-fsdp'])
def test_grouped_attention_trains_with_the_same_losses_on_every_mesh(overrides, meshes):
  losses, lines = {}, []
  for name in ('single', *meshes):
    config = load_config(name, *GQA, *overrides, 'data.source=synthetic', 'train.steps=3',
                         'train.log_every=3', 'train.seq_len=16')
    say = lines.append if name == 'tp8' else quiet
    losses[name] = train_loop.run(config, None, devices=mesh_devices(config), print_fn=say).losses
  for name, value in losses.items():
    np.testing.assert_allclose(value, losses['single'], rtol=1e-4, err_msg=name)
  if 'tp8' in meshes:  # Neither 2 nor 1 kv heads split 8 ways: the run says they are replicated.
    kv_heads = 1 if overrides else 2
    assert f'note: model.num_kv_heads={kv_heads} key/value heads do not split 8 ways' in '\n'.join(lines)


@pytest.mark.slow  # the default suite's time (7 min)
def test_kv_heads_split_when_the_mesh_divides_them_and_are_replicated_and_reported_when_not():
  split, _ = model_of('dp4_tp2', *GQA)  # model=2 divides 2 kv heads.
  replicated, _ = model_of('tp8', *GQA)  # model=8 does not.
  def spec(run, name):
    return partitioning.format_spec({p.path: p.spec for p in run.layout}[f'blocks.0.attn.{name}'])

  # Storage layouts: `embed` on `fsdp` at rest (of size 1 on these meshes).
  assert spec(split, 'wk_DHK') == '(fsdp, model, -)'
  assert spec(replicated, 'wk_DHK') == '(fsdp, -, -)' and spec(replicated, 'wq_DHK') == '(fsdp, model, -)'
  assert split.notes == []
  assert replicated.notes == [
      'model.num_kv_heads=2 key/value heads do not split 8 ways (the rules for `kv_heads`); they are '
      'replicated on every device of that split.']


# The sharded caches in the slow set (the default suite's time); test_sampling decodes on dp4_tp2 and tp8.
@pytest.mark.parametrize('name', ['single', pytest.param('dp4_tp2', marks=pytest.mark.slow),
                                  pytest.param('tp8', marks=pytest.mark.slow)])
def test_the_kv_cache_holds_the_kv_heads_and_decoding_gives_the_training_logits(name):
  setup, model = model_of(name, *GQA, 'model.num_kv_heads=1')
  graphdef, params = nnx.split(model)
  tokens_BL = tokens((8, 10), seed=1)

  @jax.jit
  def cached_logits(params, tokens_BL):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(8, 10, jnp.float32)
    first, cache = model.decode(tokens_BL[:, :6], cache, 0)
    rest, cache = model.decode(tokens_BL[:, 6:], cache, 6)
    return jnp.concatenate([first, rest], axis=1), cache

  with jax.set_mesh(setup.mesh):
    cached, cache = cached_logits(params, jax.sharding.reshard(tokens_BL, jax.P()))
    generated = np.asarray(sampling.generate(model, tokens_BL[:, :4], 6))
    recomputed = np.asarray(sampling.generate_without_cache(model, tokens_BL[:, :4], 6))
  assert cache[0][0].shape == (8, 10, 1, 16)  # One head of keys, not eight.
  np.testing.assert_allclose(np.asarray(cached), logits(setup, model, tokens_BL), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(generated, recomputed)


def test_dot_product_attention_matches_einsum_with_grouped_heads():
  setup, model = model_of('dp4_tp2', *GQA)
  dot_setup, dot = model_of('dp4_tp2', *GQA, 'model.attention=dot_product')
  x = tokens((8, 16))
  np.testing.assert_allclose(logits(dot_setup, dot, x), logits(setup, model, x), rtol=1e-5, atol=1e-5)


def test_kv_heads_that_do_not_divide_the_heads_are_a_config_error():
  with pytest.raises(ConfigError, match=r'model.num_kv_heads=3 must divide model.num_heads=8'):
    build(load_config('single', *GQA, 'model.num_kv_heads=3'))
