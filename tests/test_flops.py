"""The analytic FLOP count matches a hand count and XLA's own count of the compiled train step."""

import math

import jax
import pytest
from helpers import build, load_config, mesh_devices

from mintrain import report
from mintrain.data import tokenizer
from mintrain.data.batches import make_batches
from mintrain.mesh import make_mesh
from mintrain.optimizer import schedule
from mintrain.partitioning import AxisRules
from mintrain.train_step import make_train_step

TINY = ('model.vocab_size=16', 'model.embed_dim=8', 'model.num_layers=1', 'model.num_heads=2',
        'model.head_dim=4', 'model.mlp_dim=32', 'train.seq_len=4', 'train.global_batch_size=2')
# Matmuls dominate: per token ~4.5 MFLOPs of matmuls forward against ~10 kFLOPs of norms, softmax, RoPE.
MATMUL_HEAVY = ('model.vocab_size=256', 'model.embed_dim=256', 'model.num_layers=2', 'model.num_heads=4',
                'model.head_dim=64', 'model.mlp_dim=1024', 'train.seq_len=64', 'train.global_batch_size=8',
                'data.source=synthetic')  # Any of the 256 ids (the byte tokenizer's BOS is a 257th).


def test_tiny_transformer_matches_hand_count():
  config = load_config('single', *TINY)
  # Per token forward (D=8, F=32, H=2, K=4, V=16, L=4, one layer):
  qkv = 2 * 8 * (3 * 2 * 4)  # 384
  attention = 4 * 4 * 2 * 4 // 2  # 64: scores and probs @ v, causal half.
  out_proj = 2 * (2 * 4) * 8  # 128
  mlp = 3 * 2 * 8 * 32  # 1536: gate, up, down.
  logits = 2 * 8 * 16  # 256; the embedding lookup itself is free.
  forward = qkv + attention + out_proj + mlp + logits  # 2368
  assert report.train_flops_per_step(config) == 3 * forward * (2 * 4) == 56832


def test_causal_half_removes_half_the_attention_matmuls():
  config = load_config('single', *TINY)
  full = report.train_flops_per_step(config, causal_half=False)
  causal = report.train_flops_per_step(config)
  assert full - causal == 3 * (4 * 4 * 2 * 4 // 2) * 8


def test_a_local_layer_counts_the_keys_in_its_window():
  config = load_config('single', *TINY, 'model.sliding_window=2')
  # The causal count's continuous form: L / 2 keys per query, and with a window W < L, W (L - W/2) / L
  # (1.5 here), which is L / 2 at W = L.
  windowed = 4 * 2 * 4 * 1.5  # 48, against 64.
  assert report.train_flops_per_step(load_config('single', *TINY)) - report.train_flops_per_step(config) == (
      3 * (64 - windowed) * 8)
  assert report.train_flops_per_step(config, causal_half=False) == report.train_flops_per_step(
      load_config('single', *TINY), causal_half=False)  # The einsum computes every score.
  # In blocks of one query, the einsum scores only the causal keys within the window: 1, 2, 2, 2 of them.
  blocks = load_config('single', *TINY, 'model.sliding_window=2', 'model.attention_block=1')
  assert report.train_flops_per_step(blocks, causal_half=False) == report.train_flops_per_step(config) - (
      3 * 4 * 2 * 4 * (1.5 - 7 / 4) * 8)
  global_too = load_config('single', *TINY, 'model.sliding_window=2', 'model.global_every=1')
  assert report.train_flops_per_step(global_too) == report.train_flops_per_step(load_config('single', *TINY))


def test_tied_and_untied_logits_cost_the_same():
  tied = load_config('single', *TINY)
  untied = load_config('single', *TINY, 'model.tie_embeddings=False')
  assert report.train_flops_per_step(tied) == report.train_flops_per_step(untied)


def test_mlp_matches_hand_count():
  config = load_config('mlp_dp4_tp2', 'train.global_batch_size=16')
  forward = 2 * (784 * 1024 + 1024 * 1024 + 1024 * 1024 + 1024 * 10)
  assert report.train_flops_per_step(config) == 3 * forward * 16


@pytest.mark.parametrize('name,overrides', [
    ('single', TINY),
    ('single', (*TINY, 'model.tie_embeddings=False')),
    ('single', MATMUL_HEAVY),
    ('mlp_dp4_tp2', ()),
])
def test_param_count_equals_the_models_parameters(name, overrides):
  config = load_config(name, *overrides, 'mesh.data=1', 'mesh.fsdp=1', 'mesh.model=1')
  layout = build(config).layout
  assert report.param_count(config) == sum(math.prod(p.shape) for p in layout)


def xla_train_step_flops(config) -> float:
  """XLA's FLOP count of the compiled train step per device (cost_analysis is per device)."""
  mesh = make_mesh(config.mesh.sizes, mesh_devices(config))
  rules = AxisRules.from_config(config.partitioning)
  setup = build(config)
  with jax.set_mesh(mesh):
    step = make_train_step(setup.graphdef, setup.tx, schedule(config.optimizer, config.train.steps),
                           use_dropout=False)
    batch = next(make_batches(config, mesh, rules, tokenizer.load(config.data.tokenizer)))
    # The abstract state lowers to the same program as `setup.init()`'s, without running init.
    return step.lower(setup.abstract_state, batch).compile().cost_analysis()['flops']


@pytest.mark.parametrize('overrides', [
    (), ('model.sliding_window=16', 'model.global_every=2'),
    ('model.attention_block=16', 'model.sliding_window=16', 'model.global_every=2')],
    ids=['global', 'local_and_global', 'blocks'])
def test_analytic_count_is_within_10_percent_of_xla(overrides):
  """XLA computes the scores of every key the einsum scores, here the whole matrix unless the queries are
  in blocks, so the comparison counts them too (`causal_half=False`).

  What XLA counts beyond the analytic matmuls: elementwise work (RMSNorm, RoPE,
  SiLU, softmax, the causal mask, cross-entropy), the AdamW update (~15 FLOPs per
  parameter) and the embedding-gradient scatter-add. For this config XLA counts
  6.93e9, 1.3% over the analytic 6.85e9; the MaxText number (causal half) is
  6.74e9, 2.8% under XLA.
  """
  config = load_config('single', *MATMUL_HEAVY, *overrides)
  xla = xla_train_step_flops(config)
  analytic = report.train_flops_per_step(config, causal_half=False)
  assert abs(xla / analytic - 1) < 0.10, (xla, analytic)


@pytest.mark.slow  # One more compile of the matmul-heavy model, on 4 devices.
def test_on_a_context_mesh_each_device_counts_its_share_of_the_work():
  """MFU divides the analytic count by the devices: with the length split 4 ways, each device's compiled
  step does a quarter of it (the gathered path scores each of its queries against every key)."""
  config = load_config('single', *MATMUL_HEAVY, 'mesh.context=4')
  per_device = xla_train_step_flops(config)
  analytic = report.train_flops_per_step(config, causal_half=False)
  assert abs(4 * per_device / analytic - 1) < 0.10, (per_device, analytic)
