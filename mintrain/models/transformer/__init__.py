"""The decoder-only transformer family: Llama, Mistral, Qwen2, Qwen3, Gemma and their mixtures of
experts, and DeepSeek-V3.

`config` holds its options and costs, `attention`, `mla` (latent attention) and `model` its modules,
`moe`, `context_attention` and `collective_matmul` what they use on a mesh, `sampling` its KV-cached
generation, `hf` its Hugging Face conversion. `FAMILY` is what the rest of mintrain knows of it
(`mintrain.models.family`).
"""

from mintrain.models.family import Family
from mintrain.models.transformer import hf
from mintrain.models.transformer.config import TransformerConfig
from mintrain.models.transformer.model import Transformer

FAMILY = Family(
    config=TransformerConfig,
    make=lambda cfg, rules, placement, rngs: Transformer(cfg, placement, rules=rules, rngs=rngs),
    hf=hf,
)
