"""8-way FSDP: batch and parameters (on `embed`) split 8 ways."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 1, 8, 1
  return c
