"""The decoder-only transformer family: Llama, Mistral, Qwen2, Qwen3, Gemma 1, 2 and 3, their mixtures of
experts, and DeepSeek-V3.

`config` holds its options and costs, `attention`, `mla` (latent attention), `block` (a layer: attention,
then a gated MLP or experts) and `model` (their stack) its modules, `moe`, `context_attention` and
`collective_matmul` what they use on a mesh, `sampling` its KV-cached generation, `hf` its Hugging Face
conversion. `FAMILY` is what the rest of mintrain knows of it (`mintrain.models.family`).
"""

from mintrain.models.family import Family
from mintrain.models.transformer import hf, sampling
from mintrain.models.transformer.config import TransformerConfig
from mintrain.models.transformer.model import Transformer

# LoRA targets: a dense block's, a mixture's experts (a leading expert axis) and Qwen2-MoE's shared expert.
LORA_TARGETS = {
    'q': {'attn.wq_DHK': (0, 1)},
    'k': {'attn.wk_DHK': (0, 1)},
    'v': {'attn.wv_DHK': (0, 1)},
    'o': {'attn.wo_HKD': (0, 2)},
    'gate': {'mlp.wi_gate_DF': (0, 1), 'mlp.wi_gate_EDF': (1, 1), 'mlp.shared_wi_gate_DF': (0, 1)},
    'up': {'mlp.wi_up_DF': (0, 1), 'mlp.wi_up_EDF': (1, 1), 'mlp.shared_wi_up_DF': (0, 1)},
    'down': {'mlp.wo_FD': (0, 1), 'mlp.wo_EFD': (1, 1), 'mlp.shared_wo_FD': (0, 1)},
}

FAMILY = Family(
    config=TransformerConfig,
    make=lambda cfg, rules, placement, rngs: Transformer(cfg, placement, rules=rules, rngs=rngs),
    hf=hf,
    lora_targets=LORA_TARGETS,
    complete=sampling.complete,
)
