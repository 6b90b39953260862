"""Mixture of experts: 8 experts (2 per token) in every block, split 4 ways over `expert`, data 2 ways."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.model = 2, 1, 4, 1
  c.model.num_experts = 8
  c.model.experts_per_token = 2
  c.model.expert_mlp_dim = 128  # Active expert width 2 x 128: the FLOPs of a 256-wide dense MLP.
  return c
