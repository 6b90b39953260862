"""A Qwen3-235B-A22B-sized mixture of experts on 256 devices in 4 slices, to plan with show_sharding.py
(nothing is allocated):

  python scripts/launch_local.py --num_processes 4 --devices 256 -- python scripts/show_sharding.py \
      --config mintrain/configs/qwen3_235b_256.py

and on 512 with `--devices 512 -- ... --config.mesh.fsdp=64 --config.train.global_batch_size=512`.
On 256, each slice holds fsdp 8 x expert 8 (the 128 experts 16 to a device); fsdp goes 4 ways across
the slices.
"""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.context, c.mesh.model = 1, 32, 8, 1, 1
  c.mesh.dcn_fsdp = 4
  m = c.model  # Qwen3-235B-A22B's config.json: QK-norm, 64 query and 4 key/value heads of 128.
  m.vocab_size, m.embed_dim, m.num_layers = 151936, 4096, 94
  m.num_heads, m.num_kv_heads, m.head_dim, m.qk_norm = 64, 4, 128, True
  m.mlp_dim, m.expert_mlp_dim, m.num_experts, m.experts_per_token = 12288, 1536, 128, 8
  m.tie_embeddings, m.rope_base, m.norm_eps = False, 1e6, 1e-6
  m.scan_layers, m.remat, m.compute_dtype = True, 'full', 'bfloat16'
  c.train.seq_len, c.train.global_batch_size = 4096, 256
  return c
