"""A DeepSeek-V3-sized model (671B parameters, 37B active per token) on 256 devices in 4 slices, to plan
with show_sharding.py (nothing is allocated):

  python scripts/launch_local.py --num_processes 4 --devices 256 -- python scripts/show_sharding.py \
      --config mintrain/configs/deepseek_v3_671b_256.py

and on 512 with `--devices 512 -- ... --config.mesh.fsdp=64 --config.train.global_batch_size=512`.
On 256, each slice holds fsdp 8 x expert 8 (the 256 experts 32 to a device); fsdp goes 4 ways across
the slices (its all-gathers and reduce-scatters are the slower network's traffic). Its 3 dense blocks
before the MoE ones rule out scan_layers.
"""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.context, c.mesh.model = 1, 32, 8, 1, 1
  c.mesh.dcn_fsdp = 4
  m = c.model  # DeepSeek-V3's config.json.
  m.vocab_size, m.embed_dim, m.num_layers, m.num_heads = 129280, 7168, 61, 128
  m.kv_lora_rank, m.q_lora_rank = 512, 1536
  m.qk_nope_head_dim, m.head_dim, m.v_head_dim = 128, 64, 128
  m.rope_base, m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_len = 10000.0, 'yarn', 40.0, 4096
  m.rope_beta_fast, m.rope_beta_slow, m.rope_attention_factor, m.mla_mscale_all_dim = 32.0, 1.0, 1.0, 1.0
  m.mlp_dim, m.dense_layers = 18432, (0, 1, 2)
  m.num_experts, m.experts_per_token, m.expert_mlp_dim, m.shared_expert_dim = 256, 8, 2048, 2048
  m.shared_expert_gate, m.router_score, m.router_groups, m.router_group_topk = False, 'sigmoid', 8, 4
  m.routed_scaling_factor, m.router_bias_rate = 2.5, 1e-3
  m.load_balance_loss_weight, m.router_z_loss_weight = 0.0, 0.0
  m.tie_embeddings, m.remat, m.compute_dtype = False, 'full', 'bfloat16'
  c.train.seq_len, c.train.global_batch_size = 4096, 256
  return c
