"""8-way tensor parallelism: heads, mlp and vocab split 8 ways."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 1, 1, 8
  return c
