"""A Llama-3.1-405B-sized model on 512 devices in 2 slices, pipelined: to plan with show_sharding.py (nothing
is allocated):

  python scripts/launch_local.py --num_processes 2 --devices 512 -- python scripts/show_sharding.py \
      --config mintrain/configs/llama3_405b_512.py

The 126 layers go 2 ways over `stage`, one stage a slice (mesh.dcn_stage: only one activation per
microbatch crosses the slower network); within each slice fsdp 32 x model 8. GPipe over 4 microbatches of
one row per device each.
"""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.stage, c.mesh.data, c.mesh.fsdp, c.mesh.model = 2, 1, 32, 8
  c.mesh.dcn_stage = 2
  m = c.model  # Llama 3.1 405B's config.json.
  m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads = 128256, 16384, 126, 128, 8
  m.head_dim, m.mlp_dim, m.tie_embeddings, m.norm_eps = 128, 53248, False, 1e-5
  m.rope_base, m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_len = 500000.0, 'llama3', 8.0, 8192
  m.scan_layers, m.remat, m.compute_dtype = True, 'full', 'bfloat16'
  c.pipeline.microbatches = 4
  c.train.seq_len, c.train.global_batch_size = 4096, 128
  return c
