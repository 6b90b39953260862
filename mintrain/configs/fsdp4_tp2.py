"""4-way FSDP x 2-way tensor parallelism."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 1, 4, 2
  return c
