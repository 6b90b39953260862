"""Mixture of experts: 8 experts (2 per token) in every block, split 4 ways over `expert`, data 2 ways;
dropless, each choice through its expert alone by the grouped matmul, sent there and back by all-to-all."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.model = 2, 1, 4, 1
  c.model.num_experts = 8
  c.model.experts_per_token = 2
  c.model.expert_mlp_dim = 128  # Active expert width 2 x 128: the FLOPs of a 256-wide dense MLP.
  c.model.capacity_factor = 0.0  # Dropless.
  c.model.grouped_matmul = 'auto'  # ragged_dot on TPU, tiles of sorted rows on CPU and GPU.
  c.model.expert_exchange_factor = 0.0  # No bound on what a peer is sent: exact.
  c.model.expert_exchange = 'auto'  # ragged_all_to_all on GPU and TPU, a padded all_to_all on CPU.
  return c
