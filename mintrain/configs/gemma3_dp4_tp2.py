"""A small Gemma-3-style model on the default mesh: five local layers (a 16-position sliding window) to
one global, QK-norm, norms before and after attention and MLP, (1 + w) norms, scaled embeddings, GeGLU,
multi-query attention, and RoPE with a base of its own on the local layers and linear scaling on the
global ones."""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 4, 1, 2
  m = c.model
  m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 6, 4, 1, 32
  m.sliding_window, m.global_every = 16, 6
  m.qk_norm = m.post_norms = m.norm_plus_one = m.embed_scale = True
  m.mlp_activation = 'gelu_tanh'
  m.rope_base, m.rope_local_base = 1_000_000.0, 10_000.0
  m.rope_scaling, m.rope_scaling_factor = 'linear', 8.0
  return c
