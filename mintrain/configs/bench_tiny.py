"""The benchmark comparison model: a small Llama-style LM on synthetic tokens, 4-way data x 2-way tensor.

Llama's shape at toy size (untied embeddings, 32k vocabulary, gated MLP 4x wide), big enough
that matmuls, not launch overhead, dominate a step on an accelerator.
"""

from . import base


def get_config():
  c = base.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 4, 1, 2
  c.model.vocab_size = 32000  # Llama's vocabulary size; synthetic tokens use all of it.
  c.model.embed_dim = 256
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.head_dim = 64
  c.model.mlp_dim = 1024
  c.model.tie_embeddings = False  # Llama has a separate output projection.
  c.model.param_dtype = 'float32'
  c.data.source = 'synthetic'  # No tokenizer or corpus: the byte tokenizer's vocabulary does not apply.
  c.train.seq_len = 256
  c.train.global_batch_size = 16
  return c
