"""A small Qwen3-MoE-style model: QK-norm, 8 experts (2 per token, renormalised) in every block but the
first (`dense_layers`, Qwen's mlp_only_layers), split 4 ways over `expert`, data 2 ways."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.model = 2, 1, 4, 1
  m = c.model
  m.qk_norm = True
  m.num_heads, m.num_kv_heads, m.head_dim = 8, 4, 32  # 8 x 32 = 256 query dims on a 128-wide stream.
  m.rope_base = 1_000_000.0
  m.num_experts, m.experts_per_token, m.expert_mlp_dim = 8, 2, 128
  m.dense_layers = (0,)
  return c
