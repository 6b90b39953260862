"""2 pipeline stages x 2-way data x 2-way tensor parallelism: four stacked layers, two a stage, GPipe over
four microbatches (mintrain/models/pipeline.py).

Full remat: without it the activations the schedule saves for the backward pass leave its shard_map whole
over `model`, gathered at every step (the known cost in mintrain/models/pipeline.py)."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.stage, c.mesh.data, c.mesh.fsdp, c.mesh.model = 2, 2, 1, 2
  c.model.num_layers, c.model.scan_layers, c.model.remat = 4, True, 'full'
  c.pipeline.microbatches = 4
  return c
