"""8-way data parallelism: params replicated, batch split."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 8, 1, 1
  return c
