"""2-way data x 2-way context x 2-way tensor parallelism: the sequence split over `context`."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.context, c.mesh.model = 2, 1, 2, 2
  return c
