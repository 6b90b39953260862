"""A small Qwen3-style model on the default mesh: QK-norm, grouped heads wider than embed_dim / num_heads,
Qwen3's RoPE base."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 4, 1, 2
  m = c.model
  m.qk_norm = True
  m.num_heads, m.num_kv_heads, m.head_dim = 8, 4, 32  # 8 x 32 = 256 query dims on a 128-wide stream.
  m.rope_base = 1_000_000.0
  return c
