"""A Mixtral-8x7B-sized mixture of experts on 256 devices in 4 slices, to plan with show_sharding.py:

  python scripts/launch_local.py --num_processes 4 --devices 256 -- python scripts/show_sharding.py \
      --config mintrain/configs/mixtral_8x7b_256.py

(four processes of 64 simulated CPU devices stand in for the slices; nothing is allocated). Each slice
holds fsdp 8 x expert 8; data goes 4 ways across the slices, the only traffic on the slower network.
"""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.context, c.mesh.model = 4, 8, 8, 1, 1
  c.mesh.dcn_data = 4
  m = c.model  # Mixtral-8x7B's shape (its config.json), 46.7B parameters, 12.9B active per token.
  m.vocab_size, m.embed_dim, m.num_layers = 32000, 4096, 32
  m.num_heads, m.num_kv_heads, m.head_dim = 32, 8, 128
  m.mlp_dim = m.expert_mlp_dim = 14336
  m.num_experts, m.experts_per_token = 8, 2
  m.tie_embeddings, m.rope_base, m.norm_eps = False, 1e6, 1e-5
  m.scan_layers, m.remat, m.compute_dtype = True, 'full', 'bfloat16'
  c.train.seq_len, c.train.global_batch_size = 4096, 256
  return c
