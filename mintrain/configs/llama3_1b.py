"""A Llama-3.2-1B-sized model on one accelerator, for MFU: bfloat16 activations over float32 weights,
`jax.nn.dot_product_attention` (cuDNN's flash attention on an NVIDIA GPU), synthetic tokens over the whole
128k vocabulary, 16k tokens a step.

  python benchmarks/gpu.py --part mfu          # its step, and variants of it, against the device's peak
"""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = -1, 1, 1  # Every device a data replica (one GPU: one).
  m = c.model  # Llama 3.2 1B's config.json.
  m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads = 128256, 2048, 16, 32, 8
  m.head_dim, m.mlp_dim, m.tie_embeddings, m.norm_eps = 64, 8192, True, 1e-5
  m.rope_base, m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_len = 500000.0, 'llama3', 32.0, 8192
  m.param_dtype, m.compute_dtype, m.attention = 'float32', 'bfloat16', 'dot_product'
  c.data.source = 'synthetic'
  c.train.seq_len, c.train.global_batch_size = 2048, 8
  return c
