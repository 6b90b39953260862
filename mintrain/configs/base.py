"""Every default of mintrain, each with a one-line comment. Other configs override this."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds parameter init, synthetic data and dropout; same seed -> same run on any mesh.

  c.mesh = ml_collections.ConfigDict()
  c.mesh.stage = 1  # Pipeline stages: the stacked layers (model.scan_layers) split into blocks, one a stage.
  c.mesh.data = 4  # Data-parallel ways (batch split, params replicated). -1: all remaining devices.
  c.mesh.fsdp = 1  # Fully-sharded data-parallel ways (batch split, params split on `embed`).
  c.mesh.expert = 1  # Expert-parallel ways: MoE layers' experts split, the batch split everywhere else.
  c.mesh.context = 1  # Context-parallel ways (the sequence's `length` split; attention gathers keys).
  c.mesh.model = 2  # Tensor-parallel ways (heads, mlp and vocab split).
  # Multi-slice: how many of the stage (data, fsdp) ways go across slices or hosts over the data-centre
  # network; the rest stay within each slice. 1: one slice. The product is the number of slices (or
  # processes).
  c.mesh.dcn_stage = 1
  c.mesh.dcn_data = 1
  c.mesh.dcn_fsdp = 1

  c.partitioning = ml_collections.ConfigDict()
  # Compute layout of activations and of parameters in use: (logical name, mesh axes) in priority
  # order, as t5x and MaxText (flax.linen.logical_to_mesh_axes). None means replicated; a name with
  # no rule is an error.
  c.partitioning.rules = [
      ('batch', ('data', 'fsdp', 'expert')),  # `expert` too: its devices hold other rows outside MoE layers.
      ('length', 'context'),  # Never a parameter's axis; a dimension of size 1 (a decode step) stays whole.
      ('embed', None),
      ('mlp', 'model'),
      ('heads', 'model'),
      ('kv_heads', 'model'),  # Grouped key/value heads (model.num_kv_heads); replicated if too few.
      ('kv', None),
      ('latent', None),  # Multi-head latent attention's low-rank widths (model.kv_lora_rank, q_lora_rank).
      ('vocab', 'model'),
      ('expert', 'expert'),  # The experts of a mixture-of-experts layer (model.num_experts).
      ('classes', None),
      ('layers', 'stage'),  # Stacked layers: each pipeline stage holds its block of them (mesh.stage).
      ('lora_rank', None),  # The rank dimension of LoRA's adapters (lora.rank): small, replicated.
  ]
  # Storage layout of parameters at rest, tried before `rules`: FSDP shards `embed` on `fsdp`.
  c.partitioning.param_rules = [('embed', 'fsdp'), ('latent', 'fsdp')]

  # Pipeline parallelism over mesh.stage (mintrain/models/pipeline.py; needs model.scan_layers): each stage
  # holds a block of the stacked layers and the batch flows through them in microbatches, each stage passing
  # its output to the next. Unused at mesh.stage=1.
  c.pipeline = ml_collections.ConfigDict()
  # Microbatches each batch (each train.grad_accum_steps micro-batch) is cut into; they must split each
  # device's rows evenly. The idle share of the stages (the bubble) is (S - 1) / (repeats * M + S - 1).
  c.pipeline.microbatches = 4
  # Circular schedule: each stage holds this many non-contiguous blocks of layers (stage s: blocks s,
  # s + S, ...) and each microbatch goes round the stages this many times, shrinking the bubble; 1: GPipe.
  # Needs microbatches >= mesh.stage; the stacked weights move between stages each step for it.
  c.pipeline.repeats = 1

  c.model = ml_collections.ConfigDict()
  c.model.name = 'transformer'  # 'transformer' (decoder-only LM) or 'mlp' (classifier).
  c.model.vocab_size = 0  # 0: data.tokenizer's ids, padded to a multiple of 128 to split (bytes: 257 -> 384).
  c.model.embed_dim = 128  # Width of the residual stream (D).
  c.model.num_layers = 2  # Transformer blocks.
  c.model.num_heads = 8  # Attention heads (H); split over `model`.
  c.model.num_kv_heads = 0  # Key/value heads (G) for grouped-query attention (1: multi-query); 0: H.
  c.model.head_dim = 16  # Per-head width (K).
  c.model.mlp_dim = 512  # Gated-MLP hidden width (F); split over `model`.
  c.model.tie_embeddings = True  # Output projection shares the embedding table.
  c.model.rope_base = 10000.0  # Rotary embedding base frequency.
  # RoPE frequency scaling, as transformers' rope_type: 'llama3' (Llama 3.1), 'linear', 'dynamic' (NTK) or
  # 'yarn', with the options below; 'none' leaves it out.
  c.model.rope_scaling = 'none'
  c.model.rope_scaling_factor = 8.0  # How many times longer the context gets (all four).
  c.model.rope_low_freq_factor = 1.0  # llama3.
  c.model.rope_high_freq_factor = 4.0  # llama3.
  # The context length the frequencies were trained for (llama3, yarn); dynamic's max_position_embeddings.
  c.model.rope_original_max_len = 8192
  c.model.rope_beta_fast = 32.0  # yarn: a frequency turning more often over the original context is kept.
  c.model.rope_beta_slow = 1.0  # yarn: one turning less often is divided by the factor; between, blended.
  c.model.rope_attention_factor = 0.0  # yarn: scale of cos and sin; 0: 0.1 * ln(factor) + 1.
  c.model.rope_truncate = True  # yarn: round the range of blended dimensions outwards to integers.
  c.model.norm_eps = 1e-6  # RMSNorm epsilon.
  c.model.norm_plus_one = False  # Gemma: norms scale by (1 + weight).
  c.model.embed_scale = False  # Gemma: embeddings times sqrt(embed_dim).
  c.model.qkv_bias = False  # Qwen2: biases on the query, key and value projections.
  c.model.qk_norm = False  # Qwen3: RMSNorm of each query and key head over head_dim, before RoPE.
  # Local layers attend over the last sliding_window positions only (Mistral, Gemma 2 and 3); 0: no window.
  c.model.sliding_window = 0
  c.model.global_every = 0  # With a window, every N-th layer is global (Gemma 2: 2, Gemma 3: 6); 0: none is.
  c.model.rope_local_base = 0.0  # Gemma 3: local layers' own RoPE base, without rope_scaling; 0: as global.
  c.model.attn_softcap = 0.0  # Gemma 2: attention scores soft-capped to cap * tanh(s / cap); 0: none.
  c.model.final_softcap = 0.0  # Gemma 2: output logits soft-capped the same way (not in the fused loss).
  c.model.query_scale = 0.0  # Scores times query_scale ** -0.5 (Gemma's query_pre_attn_scalar); 0: head_dim.
  c.model.post_norms = False  # Gemma 2 and 3: RMSNorm of the attention's and MLP's outputs as well.
  # Multi-head latent attention (DeepSeek-V2/V3, models/transformer/mla.py) when kv_lora_rank > 0: each
  # head's keys and values come from one shared latent of kv_lora_rank dims (all a KV cache keeps, with one
  # rotary key); queries and keys are qk_nope_head_dim dims without RoPE, then head_dim with it.
  c.model.kv_lora_rank = 0  # Width of the key/value latent; 0: ordinary attention.
  c.model.q_lora_rank = 0  # Queries through a normed latent this wide; 0: one query projection.
  c.model.qk_nope_head_dim = 0  # Query/key dims per head without RoPE (MLA).
  c.model.v_head_dim = 0  # Value dims per head (MLA); 0: head_dim.
  c.model.rope_interleave = True  # DeepSeek's checkpoints order the rotary dims as pairs (MLA).
  # Under YaRN, scores / sqrt(qk_nope_head_dim + head_dim) also times (0.1 * this * ln(factor) + 1)^2; 0: not.
  c.model.mla_mscale_all_dim = 0.0
  c.model.mlp_activation = 'silu'  # Gate nonlinearity: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU, Gemma).
  c.model.dropout_rate = 0.0  # Dropout on attention and MLP outputs; 0 disables it.
  c.model.param_dtype = 'float32'  # Storage dtype of parameters and optimizer state.
  c.model.compute_dtype = 'float32'  # Dtype of matmuls and activations ('bfloat16' for speed).
  c.model.remat = 'none'  # Recompute each block's activations in backward: 'none', 'full', 'save_matmuls'.
  c.model.scan_layers = False  # Stack layer params on a leading `layers` axis and run the blocks in a scan.
  c.model.attention = 'einsum'  # 'einsum' (reference) or 'dot_product' (jax.nn.dot_product_attention).
  # The einsum's causal self-attention in blocks of this many queries, each scoring only the keys up to its
  # last (and within a local layer's window), not the whole (L, L) matrix; 0: max(64, seq_len / 8).
  c.model.attention_block = 0
  # With `length` split (mesh.context): 'all_gather' gathers keys and values before attention; 'ring'
  # passes them round a ring of devices, overlapped with blockwise attention, the sequence in zigzag order.
  c.model.context_attention = 'all_gather'
  c.model.mlp_overlap = False  # Overlap the MLP's tensor-parallel collectives with chunked matmuls (a ring).
  # Output layer and loss fused, never keeping the (tokens x vocab) logits, over N sequence chunks
  # (more chunks, less memory); 0: logits, then cross-entropy (the reference); -1: 1 on CPU, where it was
  # measured to help, else 0.
  c.model.loss_chunks = -1
  # Weight matmuls' gradients: 'custom_vjp' transposes the smaller operand (measured faster on CPU),
  # 'einsum' leaves it to autodiff; 'auto': custom_vjp on CPU, einsum elsewhere.
  c.model.linear = 'auto'
  # Mixture of experts (mintrain/models/moe.py): every moe_every-th block's MLP becomes num_experts gated MLPs
  # of width expert_mlp_dim, experts split over mesh.expert, each token routed to experts_per_token of them.
  c.model.num_experts = 0  # Experts per MoE layer (E); 0: every MLP dense.
  c.model.experts_per_token = 2  # Top-k experts each token goes to.
  c.model.moe_every = 1  # Every N-th block is MoE (1: all; 2: blocks 1, 3, ...), the others dense.
  c.model.dense_layers = ()  # Blocks kept dense anyway (Qwen-MoE's mlp_only_layers, DeepSeek's first k).
  c.model.expert_mlp_dim = 0  # Hidden width of each expert; 0: mlp_dim.
  c.model.shared_expert_dim = 0  # Width of an expert every token takes (Qwen2-MoE, DeepSeek); 0: none.
  c.model.shared_expert_gate = True  # Qwen2-MoE scales its shared expert by a sigmoid gate; DeepSeek not.
  c.model.capacity_factor = 0.0  # Slots per expert: factor * seq_len * k / E (the rest dropped); 0: dropless.
  # Dropless (capacity_factor 0): each choice meets its expert alone, by a grouped matmul: 'ragged_dot'
  # (jax.lax.ragged_dot: TPU; XLA makes it a dense product masked per expert on CPU and GPU), 'tiles' (each
  # expert's sorted rows in tiles of moe_tile rows, a loop over the tiles in use: CPU, GPU), 'mosaic_gpu'
  # (JAX's Mosaic GPU grouped matmuls, Hopper GPUs in bfloat16; not measured in a run yet), 'auto' (by
  # platform) or 'off' (every expert all seq_len slots: E / k times the active work).
  c.model.grouped_matmul = 'auto'
  c.model.moe_tile = 0  # Rows of a tile; 0: a power of two by the even share (CPU: <= 256, GPU: <= 1024).
  # Dropless on mesh.expert: the choices a device sends each peer at most, times its even share (choices /
  # expert ways); past it they are dropped (moe_dropped_fraction). 0: all of them, never a drop.
  c.model.expert_exchange_factor = 0.0
  # How the choices travel: 'ragged' (jax.lax.ragged_all_to_all: each peer is sent exactly its choices, up
  # to the bound; GPU, TPU), 'padded' (all_to_all: each peer is sent room for the bound, mostly zeros when
  # the bound is exact) or 'auto' (ragged where the platform has it, padded on the CPU). The bound and
  # what it drops are the same on both.
  c.model.expert_exchange = 'auto'
  c.model.router_norm_topk = True  # Top-k router weights renormalised to sum 1 (Mixtral; Qwen2-MoE: False).
  # DeepSeek-V3's router: sigmoid scores; experts chosen by score + a per-expert bias that takes no gradient
  # but moves router_bias_rate per step towards balance (bias += rate * sign(mean load - load); the
  # auxiliary-loss-free balancing); the choices weighted by the scores alone, times routed_scaling_factor.
  c.model.router_score = 'softmax'  # 'softmax' (Mixtral, Qwen) or 'sigmoid' (DeepSeek-V3).
  c.model.router_groups = 1  # Experts in this many groups; each token picks from the router_group_topk
  c.model.router_group_topk = 1  # groups whose two best scores sum highest (DeepSeek's n_group, topk_group).
  c.model.routed_scaling_factor = 1.0  # The routed experts' weights times this.
  c.model.router_bias_rate = 0.0  # Step of the balancing bias (sigmoid router); 0 keeps it as loaded.
  c.model.router_z_loss_weight = 1e-3  # Weight of the router z-loss, mean(logsumexp(logits)^2), in the loss.
  c.model.load_balance_loss_weight = 1e-2  # Weight of the balancing loss E * sum_e f_e * p_e (1: balanced).
  # Multi-token prediction (DeepSeek-V3): mtp_layers more blocks, used in training only, depth k predicting
  # the token k + 1 ahead from depth k - 1's hidden states and the embedding of the token k ahead; their
  # mean cross-entropy times mtp_loss_weight joins the objective (metric `mtp_loss`). 0: none.
  c.model.mtp_layers = 0
  c.model.mtp_loss_weight = 0.3

  c.data = ml_collections.ConfigDict()
  # 'stdlib': this Python's standard library source (~12 MB, no download); 'text': UTF-8 files of
  # data.path; 'tokens': flat uint16/uint32 token files of data.path; 'synthetic': sequences from the seed.
  # 'jsonl', 'parquet', 'arrayrecord': files of data.path streamed a block at a time; 'mixture': data.mixture.
  c.data.source = 'stdlib'
  c.data.path = ''  # Glob of the source's files, e.g. 'data/*.txt' or 'corpus/*.jsonl.gz'.
  # 'byte' (UTF-8 bytes + BOS), a Hugging Face tokenizer.json, a SentencePiece .model, or a directory
  # holding one; '': init.hf_checkpoint's tokenizer (an error if it has none), else 'byte'.
  c.data.tokenizer = ''
  # Held-out share: files (streamed sources: blocks) by a stable hash of their path; a token file's tail. A
  # corpus too small for the hash to hold one out gives eval the round(fraction * n) of smallest hash (at
  # least one, never all); a streamed source of one block is split by document instead.
  c.data.eval_fraction = 0.05
  # A held-out corpus (a glob read by the same source) for evaluation; then nothing is held out of `path`.
  c.data.eval_path = ''
  c.data.token_dtype = 'uint16'  # Element type of 'tokens' files: 'uint16' or 'uint32'.
  c.data.max_bytes = 0  # Read only the first files (in sorted order) up to about this many bytes; 0: all.
  # Rows of file sources: 'pack' documents back to back (attention and RoPE positions restart at each),
  # or 'pad' one document per row, truncated or padded (padding never counts in the loss).
  c.data.packing = 'pack'
  c.data.num_threads = 1  # Grain reader threads (no worker processes).
  c.data.prefetch = 4  # Batches each process reads ahead of the train step; 0 turns prefetching off.
  c.data.device_prefetch = 1  # Train batches already on their devices when a step starts; 0: none.
  c.data.text_field = 'text'  # The JSONL field or Parquet column holding each document's text.
  c.data.record_format = 'text'  # ArrayRecord records: 'text' (UTF-8) or 'tokens' (token_dtype ids from BOS).
  c.data.block_bytes = 1 << 18  # Streamed files are read and shuffled in blocks of about this many bytes.
  c.data.shuffle_window = 4  # Blocks each batch row reads together and shuffles the documents of.
  # A streamed corpus whose files changed since the checkpoint resumed from (said in one line): 'continue'
  # keeps the unchanged files' positions and reads new files from the next epoch; 'restart' starts its data
  # order anew at the checkpoint's step.
  c.data.on_corpus_change = 'continue'
  # data.source='hf_datasets': data.path is a directory written by datasets' save_to_disk, a glob of local
  # files that datasets' load_dataset reads (.parquet, .json(l), .arrow, .csv, .txt), or a Hub dataset name
  # (online only); streamed in row blocks of about data.block_bytes like the other sources, or with
  # data.hf_streaming a shard at a time (a Parquet row group, a whole JSON, CSV or text file).
  c.data.hf_split = 'train'  # The split of a DatasetDict or of a Hub dataset.
  c.data.hf_config = ''  # A Hub dataset's configuration name; '' its default.
  c.data.hf_streaming = False  # load_dataset(streaming=True) of the files or Hub name: no download first.
  c.data.skip_bad_records = False  # Skip bad lines, records and files with a counted warning, not an error.
  # What a 'jsonl' or 'parquet' record holds: 'text' (data.text_field) or 'chat': a conversation, a list of
  # {'role', 'content'} in data.messages_field (and the record's 'tools', if any), rendered by the
  # tokenizer's own chat template (a Hugging Face tokenizer's chat_template.jinja or tokenizer_config.json).
  # Packed conversations are document-masked and one runs on into the next row when longer than
  # train.seq_len; with data.packing='pad' one longer than train.seq_len + 1 tokens is truncated.
  # 'preference' (train.objective='dpo'; jsonl or parquet): records of `prompt`, `chosen`
  # and `rejected`, strings, or the prompt a list of messages (rendered by the chat template with the
  # assistant's turn opened) and each response a list of assistant messages (TRL's format). Each pair is
  # two padded rows of one batch row, prompt + chosen and prompt + rejected, truncated to train.seq_len + 1
  # tokens (data.packing='pack': as many whole pairs as fit, each chosen and rejected a document of the two
  # halves); only the response tokens count. In a mixture, every source or none is 'preference'. 'prompt'
  # (train.objective='grpo'; jsonl): records of `prompt`, a string or a list of messages, and any other
  # fields, which the reward functions receive.
  c.data.format = 'text'
  c.data.messages_field = 'messages'  # The JSONL field or Parquet column holding a chat record's messages.
  # Which chat tokens the loss counts: 'assistant' the spans the template marks with {% generation %}, or
  # without such markers each assistant message's content and the token ending its turn; 'all' every token.
  c.data.loss_on = 'assistant'
  c.data.chat_template = ''  # A chat template file to render chats with instead of the tokenizer's own.
  # Sources to mix, with data.source='mixture': [({'source': 'jsonl', 'path': 'a/*.jsonl'}, 0.7), (..., 0.3)];
  # each row draws its source per step in proportion to the weights. A source sets only its own keys.
  c.data.mixture = []

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 100  # Evaluate on the held-out split every N steps and at the end; 0: only at the end.
  c.eval.steps = 8  # Batches of the held-out split per evaluation; 0 turns evaluation off.
  # lm-evaluation-harness tasks run on the live model (the `eval` extra), comma-separated ('arc_easy,piqa');
  # each task's metrics are logged as harness/<task>/<metric>. '' turns them off.
  c.eval.harness_tasks = ''
  c.eval.harness_every_steps = 0  # Run them every N steps and at the end; 0: only at the end.
  c.eval.harness_limit = 0.0  # Documents per task (a fraction of them if < 1), to keep it short; 0: all.
  c.eval.harness_include_path = ''  # A directory of task YAML files of your own; '': lm-eval's tasks only.

  c.train = ml_collections.ConfigDict()
  c.train.steps = 300  # Optimizer steps.
  c.train.global_batch_size = 32  # Sequences per optimizer step, over all devices and micro-batches.
  c.train.seq_len = 64  # Tokens per sequence.
  c.train.grad_accum_steps = 1  # Micro-batches per step; gradients are averaged over them.
  c.train.log_every = 25  # Steps between progress lines and metrics.jsonl records.
  # Seconds without a finished step (start-up and compilation included) after which every process writes
  # the stacks of all its threads to WORKDIR/logs/hang.log and says on the console where it is stuck; the
  # run goes on (a slow step may yet finish). Generous, so a long compile or save is not taken for a hang.
  c.train.hang_timeout_s = 1800.0
  # JAX's persistent compilation cache, per machine, in $MINTRAIN_CACHE_DIR/xla (default ~/.cache/mintrain),
  # unless JAX_COMPILATION_CACHE_DIR names another: a re-run or a resume of the same program on the same
  # kind of machine loads the compiled train step instead of compiling it again (so do scripts/sample.py and
  # scripts/evaluate.py, by the checkpoint's config).
  c.train.compilation_cache = True
  # What the run learns (mintrain/objectives/): 'lm' the model family's own loss (next-token cross-entropy
  # over the counted targets); 'dpo' preference tuning from data.format='preference' pairs (the dpo
  # section); 'grpo' reinforcement learning with verifiable rewards from data.format='prompt' records (the
  # grpo section).
  c.train.objective = 'lm'

  # train.objective='dpo': TRL's DPO losses on the summed log-probabilities of each pair's response tokens,
  # against a reference model: the initial weights (init.hf_checkpoint's, or the seed's), frozen, laid out as
  # the trained ones and saved in checkpoints (so a resume is bit-exact); it costs a second copy of
  # the parameters and a forward pass per micro-batch. train.global_batch_size then counts pairs (two
  # sequences each). Metrics: loss, dpo_reward_accuracy (chosen reward > rejected), dpo_reward_margin,
  # dpo_chosen_reward, dpo_rejected_reward (beta times the policy's log-ratio over the reference),
  # dpo_chosen_logp and dpo_rejected_logp (the policy's summed log-probabilities), averaged over the pairs.
  c.dpo = ml_collections.ConfigDict()
  c.dpo.beta = 0.1  # How far the policy may move from the reference: the reward scale (TRL's beta).
  # 'sigmoid' (DPO), 'ipo' (squared loss on length-averaged log-ratios, as TRL), 'hinge' (SLiC), or
  # 'simpo' (reference-free, length-averaged log-probabilities, target margin dpo.gamma; no reference model).
  c.dpo.loss = 'sigmoid'
  # Conservative DPO: the assumed chance that a pair's labels are swapped (sigmoid and simpo), in [0, 0.5).
  c.dpo.label_smoothing = 0.0
  c.dpo.gamma = 0.5  # SimPO's target reward margin (dpo.loss='simpo').
  # True: the reference's log-probabilities of every batch the run reads are computed in one pass before the
  # first step and kept in WORKDIR/reference_logp.npz (read back on resume), so the state holds no reference
  # copy and each step no reference forward pass.
  c.dpo.precompute_reference = False

  # train.objective='grpo' (RL with verifiable rewards, mintrain/objectives/grpo/): each step samples
  # grpo.group_size completions of each of train.global_batch_size / group_size prompts
  # (data.format='prompt') with the KV-cached sampler, scores them with the reward functions, normalises the
  # rewards within each group (the advantages), and makes grpo.num_iterations updates with TRL's clipped
  # surrogate and a KL penalty to the reference (the initial weights, kept while kl_coef > 0). Sampling keys
  # fold the step and the row into the seed. Needs eval.steps=0. Metrics: grpo_reward (mean),
  # grpo_reward_std, grpo_reward/<function>, grpo_zero_variance_groups (fraction of groups whose rewards are
  # all equal), grpo_kl, grpo_clip_fraction, grpo_completion_length(_max), and the step's time split:
  # grpo_sample_sec (sampling), grpo_rollout_sec (sampling, rewards, log-probabilities) and grpo_update_sec
  # (the previous step's updates).
  c.grpo = ml_collections.ConfigDict()
  # Reward functions, comma-separated 'package.module:function' (importable, e.g. through PYTHONPATH), called
  # as TRL's: function(prompts=, completions=, completion_ids=, **the records' other fields) -> a float each.
  c.grpo.reward = ''
  c.grpo.reward_weights = ()  # One weight per reward function, summed into the reward; (): all 1.0.
  c.grpo.group_size = 4  # Completions sampled per prompt; it must divide train.global_batch_size.
  c.grpo.max_new_tokens = 32  # Tokens per completion at most (sampling stops at EOS); prompts get the rest.
  c.grpo.temperature = 1.0  # Sampling temperature (> 0).
  c.grpo.top_p = 1.0  # Nucleus sampling: draw among the most likely tokens holding this much mass; 1: all.
  # Updates per step on its batch of completions (TRL's num_iterations); above 1 the ratio is to the sampling
  # policy's. The optimizer counts updates: its schedule runs over train.steps * num_iterations of them.
  c.grpo.num_iterations = 1
  c.grpo.clip_eps = 0.2  # The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (TRL's epsilon).
  c.grpo.clip_eps_high = 0.0  # The upper clip (DAPO's epsilon_high); 0: clip_eps.
  c.grpo.kl_coef = 0.0  # Weight of the k3 KL estimate to the reference (TRL's beta); 0 keeps no reference.
  # 'token': the loss sums over every completion token of the batch over their count; 'sequence': each
  # completion's mean over its tokens, then their mean (TRL's 'grpo').
  c.grpo.loss_norm = 'token'

  c.metrics = ml_collections.ConfigDict()
  c.metrics.peak_tflops = 0.0  # Peak TFLOP/s per device for MFU; 0: the device table, or a CPU calibration.
  # Weights & Biases (pip install -e '.[wandb]'), on process 0: the same scalars as TensorBoard, the config,
  # the sharding report and the memory plan. '' is off. A resumed run continues the same W&B run (its id is
  # kept in WORKDIR/wandb_run_id). WANDB_MODE and W&B's other environment variables apply as usual.
  c.metrics.wandb_project = ''
  c.metrics.wandb_entity = ''  # '' : W&B's default entity.
  c.metrics.wandb_run_name = ''  # '' : W&B picks one.
  c.metrics.wandb_tags = ''  # Comma-separated.
  c.metrics.wandb_mode = 'online'  # 'online' or 'offline' (written to WORKDIR/wandb; `wandb sync` later).

  c.profile = ml_collections.ConfigDict()
  c.profile.start_step = -1  # Write a JAX profiler trace starting at this step to WORKDIR/profile; -1: off.
  c.profile.num_steps = 3  # Steps in the trace.

  c.init = ml_collections.ConfigDict()
  # A Hugging Face directory (config.json + safetensors): the model's options come from its config.json
  # (the family that reads its model_type; other model options such as remat stay) and its weights are
  # the initial parameters, on any mesh. '' draws them from the seed.
  c.init.hf_checkpoint = ''
  # Refuse a checkpoint holding tensors the model its config.json describes does not use (e.g. more layers
  # than num_hidden_layers); False drops them with a warning naming them.
  c.init.hf_strict = True
  # A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors, as peft's
  # save_pretrained writes it): its A and B start the run's adapters; its r, lora_alpha and target_modules
  # must match the lora section. '' draws A as PEFT does and B as zeros.
  c.init.lora_adapter = ''

  # LoRA / QLoRA (mintrain/lora/): low-rank adapters trained on a frozen base (init.hf_checkpoint's weights,
  # or the seed's). Only the adapters get gradients, optimizer state and checkpoint space; a resume reads
  # the base again from init.hf_checkpoint, refusing one that changed or moved since the first save.
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0  # Adapter rank r; 0: LoRA off, every parameter trains.
  c.lora.alpha = 16.0  # The adapters' output is scaled by alpha / rank, as PEFT's lora_alpha.
  # Dropout on the adapters' inputs (PEFT's lora_dropout), training only. At 0 each layer gathers the
  # adapter merged into its weight (base + alpha/rank * A @ B); above 0, in training, the base matmul and the
  # adapter's on the dropped-out input are separate at each call site (not for a mixture's experts: refused).
  c.lora.dropout = 0.0
  # The model family's projections to adapt, comma-separated; the transformer's: q,k,v,o,gate,up,down
  # (gate/up/down include a mixture's experts and Qwen2-MoE's shared expert).
  c.lora.targets = 'q,k,v,o,gate,up,down'
  # How the frozen base projections are stored: 'float32', 'bfloat16', 'int8' (absmax per output channel)
  # or 'nf4' (QLoRA's 4-bit NormalFloat, two codes a byte, absmax per block); dequantized as each layer
  # gathers its weight. Other frozen parameters (embeddings, norms) keep model.param_dtype.
  c.lora.base_dtype = 'float32'
  c.lora.nf4_block_size = 64  # NF4 block length along a weight's last axis; it must divide that axis.

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 100  # Save every N steps (asynchronously), at the end, and on SIGTERM/SIGINT.
  c.checkpoint.keep = 3  # Newest checkpoints kept in WORKDIR/checkpoints; 0 disables checkpointing.
  c.checkpoint.fallback_to_previous = True  # If the newest checkpoint is damaged, restore the previous one.

  c.optimizer = ml_collections.ConfigDict()
  # 'adamw'; 'lion' (sign updates: use a 3-10x smaller learning rate); 'adafactor' (factored second
  # moments, momentum b1 if > 0); 'muon' (hidden matrices orthogonalised by Newton-Schulz, scaled to AdamW's
  # update size as Moonlight does; embeddings, the output layer and vectors by AdamW); 'sgd' (momentum b1,
  # L2 weight decay). Each state shards like the parameters it tracks.
  c.optimizer.name = 'adamw'
  c.optimizer.learning_rate = 3e-3  # Peak learning rate, reached after warmup.
  c.optimizer.warmup_steps = 30  # Linear warmup from 0 to the peak.
  # After warmup: 'cosine' or 'linear' decay to end_lr_fraction at the last step, 'constant', or 'wsd'
  # (warmup-stable-decay: the peak until the last decay_fraction of the steps, then decay_shape down).
  c.optimizer.schedule = 'cosine'
  c.optimizer.end_lr_fraction = 0.1  # Where the decay ends, as a fraction of the peak.
  c.optimizer.decay_fraction = 0.2  # 'wsd': the share of the steps after warmup that decays.
  c.optimizer.decay_shape = 'sqrt'  # 'wsd': 'linear', 'cosine' or 'sqrt' (1 - sqrt(t), MiniCPM's).
  c.optimizer.b1 = 0.9  # First-moment decay (AdamW, Lion, Muon's momentum, Adafactor and SGD momentum).
  c.optimizer.b2 = 0.95  # Second-moment decay (AdamW; Lion's momentum tracking).
  c.optimizer.eps = 1e-8  # Denominator epsilon.
  c.optimizer.weight_decay = 0.1  # Decoupled weight decay (not on norms, biases, embeddings).
  c.optimizer.grad_clip_norm = 1.0  # Global-norm gradient clipping; 0 disables it.
  # dtype of first moments (momentum): '' is the parameters' dtype; 'bfloat16' halves their memory (the
  # memory plan counts it).
  c.optimizer.mu_dtype = ''
  return c
