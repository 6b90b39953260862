"""What the Hugging Face parity tests share: tiny random `transformers` models and the logits of both sides
(torch and transformers are test extras; only these tests import them)."""

import jax
import numpy as np
import torch
import transformers
from flax import nnx


def random_model(table, common, family, directory, **changes):
  """A tiny random `transformers` model of `family` (`table[family]` = (config class name, options), over
  `common`), saved in `directory`. Norm weights, biases and routers are drawn as constants
  (ones, zeros); they are moved off them so that they matter."""
  name, options = table[family]
  torch.manual_seed(0)
  config = getattr(transformers, name)(**{**common, **options, **changes})
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  with torch.no_grad():
    for param_name, param in model.named_parameters():
      if param_name.endswith(('norm.weight', 'bias', '.gate.weight')):  # A router drawn as zeros ties.
        param.add_(0.1 * torch.randn_like(param))
    for buffer_name, buffer in model.named_buffers():
      if buffer_name.endswith('e_score_correction_bias'):  # DeepSeek-V3's balancing bias, drawn as zeros.
        buffer.add_(0.1 * torch.randn_like(buffer))
  model.save_pretrained(directory)
  return model


def torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def mintrain_logits(model, tokens):
  graphdef, params = nnx.split(model)
  return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer(directory, corpus: str):
  """A byte-level BPE of 300 ids trained on `corpus`, with ChatML's template and special tokens, saved by
  transformers in `directory`; its `AutoTokenizer`, as a user's would load."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator([corpus] * 3, trainers.BpeTrainer(
      vocab_size=300, special_tokens=['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHATML, eos_token='<|im_end|>',
                                       pad_token='<|endoftext|>').save_pretrained(directory)
  return transformers.AutoTokenizer.from_pretrained(directory)
