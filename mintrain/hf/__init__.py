"""Hugging Face checkpoints in and out: `from_pretrained(path)` and `save_pretrained(model, out_dir)`.

The model family that claims the config's `model_type` (`Family.hf`) says which options it sets and
where each tensor goes; this package only reads (`load`) and writes (`save`).
"""

from mintrain.hf.load import INDEX, SINGLE, check, from_pretrained, load_params, make_config
from mintrain.hf.save import RUN_SOURCE, check_out_dir, config_files, save_pretrained, save_sources

__all__ = ['INDEX', 'RUN_SOURCE', 'SINGLE', 'check', 'check_out_dir', 'config_files', 'from_pretrained',
           'load_params', 'make_config', 'save_pretrained', 'save_sources']
