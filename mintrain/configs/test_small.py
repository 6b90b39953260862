"""The tests' and benchmarks' small model: one layer 64 wide, 16 rows of 32 tokens, 4-way data x 2-way tensor.

Small enough that a test's many compiles stay cheap; `OVERRIDES` puts the same model on any other config.
"""

from . import dp4_tp2

SMALL = {'model.num_layers': 1, 'model.embed_dim': 64, 'model.mlp_dim': 128, 'train.global_batch_size': 16,
         'train.seq_len': 32}
OVERRIDES = tuple(f'{key}={value}' for key, value in SMALL.items())


def get_config():
  c = dp4_tp2.get_config()
  for key, value in SMALL.items():
    section, name = key.split('.')
    c[section][name] = value
  return c
