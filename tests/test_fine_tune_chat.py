"""The README's "Fine-tune a chat model", end to end through the scripts as a user runs them: chat SFT with
LoRA on dp4_tp2 from a tiny Hugging Face model, export merged (transformers loads it with mintrain's
logits) and as a PEFT adapter (peft loads it onto the base with the same logits), then evaluate with
scripts/evaluate.py on a local lm-eval task."""

import json

import numpy as np
import pytest
from helpers import run_script, script_flags
from test_chat_data import bpe, conversations, marked, save, write_chats  # noqa: F401  (fixtures)
from test_evaluation import write_tasks

pytestmark = pytest.mark.slow  # Four script runs (~1 min).


def test_sft_with_lora_then_export_merged_and_adapter_then_evaluate(marked, tmp_path):  # noqa: F811
  import peft
  import torch
  import transformers

  theirs, tok_dir = marked
  base_dir = tmp_path / 'base'
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256, tie_word_embeddings=False,
                                    eos_token_id=theirs.eos_token_id)
  transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(base_dir)
  theirs.save_pretrained(base_dir)
  chats = write_chats(tmp_path / 'chats.jsonl', conversations(48))
  options = (f'init.hf_checkpoint={base_dir}', 'data.source=jsonl', f'data.path={chats}', 'data.format=chat',
             'data.eval_fraction=0.2', 'lora.rank=8', 'lora.alpha=16', 'lora.base_dtype=nf4',
             'lora.nf4_block_size=8', 'train.steps=6', 'train.seq_len=64', 'train.global_batch_size=8',
             'train.log_every=3', 'optimizer.learning_rate=1e-2', 'optimizer.warmup_steps=1', 'eval.steps=1',
             'eval.every_steps=6')
  train = run_script('scripts/train.py', '--config', 'dp4_tp2', '--workdir', str(tmp_path / 'run'),
                     *script_flags(*options))
  assert train.returncode == 0, train.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in records if 'eval_loss' in r] == [6]
  assert any('trainable_fraction' in r or 'trainable_parameters' in r for r in records) or \
      'trainable' in train.stdout

  merged = run_script('scripts/export_hf.py', '--workdir', str(tmp_path / 'run'), '--out',
                      str(tmp_path / 'm'))
  assert merged.returncode == 0, merged.stderr[-3000:]
  adapter = run_script('scripts/export_hf.py', '--workdir', str(tmp_path / 'run'), '--out',
                       str(tmp_path / 'a'), '--adapter')
  assert adapter.returncode == 0, adapter.stderr[-3000:]
  ids = theirs.apply_chat_template(conversations(1)[0], tokenize=True, return_dict=True)['input_ids']
  tokens = torch.tensor(np.asarray(ids, np.int64)[None])
  with torch.no_grad():
    merged_logits = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'm')(tokens).logits
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base_logits = base(tokens).logits
    adapted_logits = peft.PeftModel.from_pretrained(base, tmp_path / 'a')(tokens).logits
  assert not torch.allclose(merged_logits, base_logits, atol=1e-3)  # The adapters learned something.
  # The merged export holds the NF4 base dequantized; the adapter goes onto the float32 base, whose
  # quantization error the adapter does not carry: both must agree on what was learned to within it.
  np.testing.assert_allclose((adapted_logits - base_logits).numpy(), (merged_logits - base_logits).numpy(),
                             atol=0.15)
  assert json.loads((tmp_path / 'm' / 'config.json').read_text())['eos_token_id'] == theirs.eos_token_id

  tasks = tmp_path / 'tasks'
  tasks.mkdir()
  write_tasks(tasks)
  out = tmp_path / 'results.json'
  evaluated = run_script('scripts/evaluate.py', '--workdir', str(tmp_path / 'run'), '--tasks', 'mt_choice',
                         '--include_path', str(tasks), '--limit', '4', '--batch_size', '4', '--output_path',
                         str(out))
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  assert 0 <= json.loads(out.read_text())['results']['mt_choice']['acc,none'] <= 1
