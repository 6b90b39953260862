"""4-way data x 2-way tensor parallelism (the default run)."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 4, 1, 2
  return c
