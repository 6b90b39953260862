"""2 pipeline stages x 2-way data x 2-way tensor parallelism: four stacked layers, two a stage, GPipe over
four microbatches (mintrain/models/pipeline.py).

Full remat: the schedule then keeps only each layer's input for the backward pass (the memory plan's ~7 MiB
of activations per device against ~38.5 MiB), and on CPU the step is no slower for it (BENCHMARKS.md)."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.stage, c.mesh.data, c.mesh.fsdp, c.mesh.model = 2, 2, 1, 2
  c.model.num_layers, c.model.scan_layers, c.model.remat = 4, True, 'full'
  c.pipeline.microbatches = 4
  return c
