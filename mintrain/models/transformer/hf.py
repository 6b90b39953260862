"""The transformer family's Hugging Face conversion, as `mintrain.hf` reads it (`Family.hf`): which model
types it takes and what config.json says (`hf_config`), and where each tensor goes (`hf_weights`).
`mintrain.hf` knows nothing of any architecture; these two say everything about this one's."""

from mintrain.models.transformer.hf_config import MODEL_TYPES, config_json, model_options
from mintrain.models.transformer.hf_weights import (
  Kind,
  read,
  text_tensors,
  their_index,
  their_shape,
  weight_names,
  write,
)

__all__ = ['MODEL_TYPES', 'Kind', 'config_json', 'model_options', 'read', 'text_tensors', 'their_index',
           'their_shape', 'weight_names', 'write']
