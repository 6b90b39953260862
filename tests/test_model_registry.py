"""A model family is one module under mintrain/models/: the rest of mintrain never asks which model runs.

The proof: a third family, defined and registered in this file alone, trains, checkpoints, resumes and
reports like the built-in ones, through the same config files and loop.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, quiet

from mintrain import config as config_lib
from mintrain import configs, errors, models, report
from mintrain import loop as train_loop
from mintrain.fields import option
from mintrain.models.family import Family, ModelConfig
from mintrain.models.layers import gather, param
from mintrain.models.loss import cross_entropy

NAME = 'bigram_test'


@dataclasses.dataclass(frozen=True)
class BigramConfig(ModelConfig):
  vocab_size: int = option(at_least=1)
  embed_dim: int = option(at_least=1)

  def param_count(self):
    return 2 * self.vocab_size * self.embed_dim

  def train_flops_per_row(self, seq_len, causal_half=True):
    return 6 * self.embed_dim * self.vocab_size * seq_len

  def activation_bytes(self, rows, seq_len, ways):
    return rows * seq_len * 4 * (self.embed_dim + self.vocab_size)

  def synthetic_rows(self, seed, step, rows, seq_len):
    """Rows follow one next-token map, t -> (3 t + 1) mod V, from a start drawn per (seed, step, row)."""
    start = np.array([np.random.default_rng((seed, step, int(r))).integers(self.vocab_size) for r in rows])
    seq = [start]
    for _ in range(seq_len):
      seq.append((3 * seq[-1] + 1) % self.vocab_size)
    seq = np.stack(seq, 1).astype(np.int32)
    return {'inputs': seq[:, :-1], 'targets': seq[:, 1:]}


class Bigram(nnx.Module):
  """Next token from the current one alone: an embedding, then an untied output layer."""

  def __init__(self, cfg: BigramConfig, *, rules, rngs: nnx.Rngs):
    v, d = cfg.vocab_size, cfg.embed_dim
    self.table_VD = param(rngs, nnx.initializers.normal(0.1), (v, d), ('vocab', 'embed'), jnp.float32, rules,
                          decay=False)
    self.out_DV = param(rngs, nnx.initializers.lecun_normal(), (d, v), ('embed', 'vocab'), jnp.float32, rules)
    self.rules = rules

  def loss(self, batch, *, dropout_key=None):
    """Reads 'inputs' and 'targets' and ignores any other key of the batch (packed rows' segments)."""
    tokens_BL, targets_BL = batch['inputs'], batch['targets']
    table_VD = gather(self.table_VD, self.rules, jnp.float32)
    x_BLD = table_VD.at[tokens_BL].get(out_sharding=self.rules.activation_spec(('batch', 'length', 'embed')))
    logits_BLV = jnp.einsum('BLD,DV->BLV', x_BLD, gather(self.out_DV, self.rules, jnp.float32))
    logits_BLV = self.rules.reshard(logits_BLV, ('batch', 'length', 'vocab'))
    return cross_entropy(logits_BLV, targets_BL), jnp.float32(targets_BL.size), {}


FAMILY = Family(config=BigramConfig,
                make=lambda cfg, rules, placement, rngs: Bigram(cfg, rules=rules, rngs=rngs))


@pytest.fixture(autouse=True)
def registered(monkeypatch):
  monkeypatch.setitem(models.FAMILIES, NAME, FAMILY)


def bigram_config(mesh: str, *overrides: str) -> config_lib.Config:
  """The MESH config with the model section replaced by the bigram family's, as a user's config would."""
  config = config_lib.load(configs.DIR / f'{mesh}.py')
  config.model = ml_collections.ConfigDict({'name': NAME, 'vocab_size': 64, 'embed_dim': 32})
  config.data.source = 'synthetic'
  config.train.steps, config.train.log_every, config.train.seq_len = 12, 4, 16
  config.eval.every_steps, config.checkpoint.every_steps = 0, 6
  config.optimizer.warmup_steps, config.optimizer.learning_rate = 2, 0.05
  config_lib.apply_overrides(config, overrides)
  return config_lib.validate(config)


def run(config, workdir=None):
  from helpers import mesh_devices
  return train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=quiet)


def test_a_family_registered_outside_mintrain_trains_on_any_mesh_with_the_same_losses():
  single = run(bigram_config('single'))
  assert np.mean(single.losses[-3:]) < 0.5 * np.mean(single.losses[:3])
  for mesh in ('dp4_tp2', 'fsdp4_tp2'):
    np.testing.assert_allclose(run(bigram_config(mesh)).losses, single.losses, rtol=1e-5, err_msg=mesh)


def test_its_flops_parameters_and_weight_decay_come_from_the_family():
  config = bigram_config('single')
  assert report.param_count(config) == 2 * 64 * 32
  assert report.train_flops_per_step(config) == 3 * 2 * 32 * 64 * 16 * config.train.global_batch_size
  assert report.tokens_per_step(config) == 16 * config.train.global_batch_size
  from helpers import build

  from mintrain.optimizer import decay_mask
  mask = decay_mask(build(config).abstract_state.params)
  assert mask['table_VD'].get_value() is False and mask['out_DV'].get_value() is True


def test_it_checkpoints_and_resumes_bit_exactly(tmp_path):
  straight = run(bigram_config('dp4_tp2'), tmp_path)  # Saves steps 6 and 12.
  shutil.rmtree(tmp_path / 'checkpoints' / '12')
  resumed = run(bigram_config('dp4_tp2'), tmp_path)
  assert resumed.first_step == 6
  np.testing.assert_array_equal(resumed.losses, straight.losses[6:])
  for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_its_options_are_checked_like_the_built_in_ones():
  with pytest.raises(errors.ConfigError, match=r'model.embed_dim=0 must be an integer >= 1'):
    bigram_config('single', 'model.embed_dim=0')


# Only mintrain/models/ knows which models exist and how their parameters are named.
MODEL_NAME_COMPARISON = re.compile(r"""(model_name|model\.name|\['name'\])\s*(==|!=|in\b)|"""
                                   r"""(==|!=)\s*['"](transformer|mlp)['"]""")
PARAMETER_PATH = re.compile(r"""['"](blocks|embedding_VD|unembed_DV|final_norm|attn|wq_DHK|wi_gate_DF|"""
                            r"""weights|biases)['".]|\.blocks\b|'embedding'""")


@pytest.mark.parametrize('folder', ['mintrain', 'scripts'])
def test_no_code_outside_the_models_compares_model_names_or_knows_parameter_paths(folder):
  offenders = []
  for source in sorted((REPO / folder).rglob('*.py')):
    if pathlib.Path(REPO / 'mintrain' / 'models') in source.parents:
      continue
    for number, line in enumerate(source.read_text().splitlines(), 1):
      if MODEL_NAME_COMPARISON.search(line) or PARAMETER_PATH.search(line):
        offenders.append(f'{source.relative_to(REPO)}:{number}: {line.strip()}')
  assert not offenders, '\n'.join(offenders)


def test_the_options_are_checked_once_and_the_mesh_reaches_the_model_through_its_constructor(monkeypatch):
  from helpers import build, load_config

  from mintrain.models.transformer.config import TransformerConfig
  checked = []
  monkeypatch.setattr(TransformerConfig, 'check', lambda cfg, seq_len: checked.append(seq_len))
  config = load_config('cp2_dp2_tp2')
  run = build(config)
  assert checked == [config.train.seq_len]
  names = {f.name for f in dataclasses.fields(TransformerConfig)}
  assert not names & {'platform', 'kv_heads_axis', 'kv_heads_ways', 'length_ways'}  # Mesh facts, once there.
  assert names == set(config_lib.defaults().model) - {'name'}  # Every field is a user's option.
  assert run.config.model == config.model.for_platform('cpu')  # Only options left to 'auto' are set.
  assert run.placement.ways('length') == 2 and run.placement.ways('heads') == 2
  assert run.model(run.abstract_state.params).length_ways == 2
