"""A small DeepSeek-V3-style model: latent attention (low-rank queries, a 32-wide key/value latent), one
dense block, then 8 experts in 4 groups (2 per token from the best 2 groups) behind a sigmoid router whose
balancing bias moves each step, and a shared expert; experts split 4 ways over `expert`, data 2 ways."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.model = 2, 1, 4, 1
  m = c.model
  m.num_layers, m.tie_embeddings = 3, False
  m.kv_lora_rank, m.q_lora_rank = 32, 48
  m.qk_nope_head_dim, m.head_dim, m.v_head_dim = 16, 8, 16
  m.num_experts, m.experts_per_token, m.expert_mlp_dim = 8, 2, 64
  m.shared_expert_dim, m.shared_expert_gate = 64, False
  m.dense_layers = (0,)
  m.router_score, m.router_groups, m.router_group_topk = 'sigmoid', 4, 2
  m.routed_scaling_factor = 2.5
  m.router_bias_rate = 1e-3
  m.load_balance_loss_weight, m.router_z_loss_weight = 0.0, 0.0  # Balanced by the bias instead.
  return c
