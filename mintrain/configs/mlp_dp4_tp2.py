"""The tutorial MLP classifier on synthetic data, 4-way data x 2-way tensor parallelism."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 4, 1, 2
  c.model = base.ml_collections.ConfigDict(dict(
      name='mlp',
      input_dim=784,  # Flattened 28x28 image.
      hidden_dims=(1024, 1024, 1024),  # Pairs of column- then row-parallel layers.
      num_classes=10,
      dropout_rate=0.0,
      param_dtype='float32',
      compute_dtype='float32',
  ))
  c.data.source = 'synthetic'  # Noisy class prototypes from the seed; no image dataset is bundled.
  c.train.steps = 100
  c.train.log_every = 10
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_steps = 10
  return c
