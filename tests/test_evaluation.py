"""Evaluation with lm-evaluation-harness: a trained run's checkpoint served to lm-eval (`HarnessLM`) gives the
results of lm-eval's own `hf` backend on the exported model, on one device and on dp4_tp2; scripts/evaluate.py
writes lm-eval's results JSON and prints its table; the training loop's harness action logs its metrics.

The tasks are local YAML files over local JSON lines (no dataset hub): a multiple-choice task, a rolling
log-likelihood task and a generation task with a stop sequence.
"""

import json
import textwrap

import jax
import numpy as np
import pytest
from helpers import TINY, load_config, mesh_devices, quiet, run_script, short_documents

from mintrain import loop
from mintrain.errors import ConfigError, MintrainError
from mintrain.evaluation import harness
from mintrain.evaluation.restore import layout_config, restore_model

TASKS = ('mt_choice', 'mt_rolling', 'mt_until')
MAX_LENGTH = 24  # Short enough that the rolling task's texts span several windows.


def write_tasks(directory):
  """The three tasks' YAML files and their JSON lines in `directory`."""
  docs = [doc.decode() for doc in short_documents(40, seed=3) if len(doc) >= 14][:12]
  choice = [{'question': doc[:6], 'choices': [doc[6:12], docs[(i + 1) % 12][6:12], 'zzzz'], 'answer': i % 3}
            for i, doc in enumerate(docs)]
  rolling = [{'text': doc * 3} for doc in docs[:6]]
  until = [{'prompt': doc[:8], 'target': doc[8:12]} for doc in docs[:6]]
  for name, rows in (('choice', choice), ('rolling', rolling), ('until', until)):
    (directory / f'{name}.jsonl').write_text(''.join(json.dumps(row) + '\n' for row in rows))
  head = 'dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n'
  (directory / 'choice.yaml').write_text(f'task: mt_choice\n{head.format(path=directory / "choice.jsonl")}' +
                                         textwrap.dedent('''\
      output_type: multiple_choice
      doc_to_text: "{{question}}"
      doc_to_choice: "{{choices}}"
      doc_to_target: "{{answer}}"
      metric_list:
        - metric: acc
      '''))
  (directory / 'rolling.yaml').write_text(f'task: mt_rolling\n{head.format(path=directory / "rolling.jsonl")}'
                                          + textwrap.dedent('''\
      output_type: loglikelihood_rolling
      doc_to_text: ""
      doc_to_target: "{{text}}"
      metric_list:
        - metric: word_perplexity
        - metric: byte_perplexity
        - metric: bits_per_byte
      '''))
  (directory / 'until.yaml').write_text(f'task: mt_until\n{head.format(path=directory / "until.jsonl")}' +
                                        textwrap.dedent('''\
      output_type: generate_until
      doc_to_text: "{{prompt}}"
      doc_to_target: "{{target}}"
      generation_kwargs:
        until: ["k"]
        max_gen_toks: 6
        do_sample: false
      metric_list:
        - metric: exact_match
      '''))
  return directory


@pytest.fixture(scope='module')
def tasks(tmp_path_factory):
  directory = write_tasks(tmp_path_factory.mktemp('lm_eval_tasks'))
  return directory, harness.task_manager(str(directory), include_defaults=False)


@pytest.fixture(scope='module')
def trained(tmp_path_factory, bpe_tokenizer, short_docs):
  """A workdir of a tiny model trained 4 steps on text with the BPE tokenizer, and its export."""
  root = tmp_path_factory.mktemp('eval_run')
  config = load_config('single', *TINY, *short_docs, f'data.tokenizer={bpe_tokenizer}', 'train.steps=4',
                       'optimizer.warmup_steps=1', 'optimizer.learning_rate=0.03')
  loop.run(config, root / 'run', devices=mesh_devices(config), print_fn=quiet)
  proc = run_script('scripts/export_hf.py', '--workdir', str(root / 'run'), '--out', str(root / 'hf'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return root / 'run', root / 'hf'


@pytest.fixture(scope='module')
def hf_results(trained, tasks):
  """lm-eval's own `hf` backend on the exported model (transformers, torch, float32 on CPU)."""
  from lm_eval.models.huggingface import HFLM
  lm = HFLM(pretrained=str(trained[1]), batch_size=4, max_length=MAX_LENGTH, device='cpu', dtype='float32')
  return harness.evaluate(lm, TASKS, tasks[1], log_samples=True)


def responses(results, task):
  """Each document's filtered responses (log-likelihoods, greedy flags, texts), in document order."""
  return [sample['filtered_resps'] for sample in sorted(results['samples'][task], key=lambda s: s['doc_id'])]


@pytest.mark.parametrize('mesh', ['single', pytest.param('dp4_tp2', marks=pytest.mark.slow)])
def test_a_checkpoint_gives_the_results_of_lm_evals_hf_backend_on_its_export(trained, tasks, hf_results,
                                                                             mesh):
  layout = layout_config(None if mesh == 'single' else f'mintrain/configs/{mesh}.py')
  restored = restore_model(trained[0], layout=layout, devices=jax.devices()[:1 if mesh == 'single' else 8])
  lm = harness.HarnessLM(restored.model, restored.config, restored.tokenizer, restored.mesh, batch_size=4,
                         max_length=MAX_LENGTH)
  ours = harness.evaluate(lm, TASKS, tasks[1], log_samples=True)
  assert ours['results']['mt_choice']['acc,none'] == hf_results['results']['mt_choice']['acc,none']
  for task in ('mt_choice', 'mt_rolling'):
    mine, theirs = responses(ours, task), responses(hf_results, task)
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs):
      logp_a = [r[0] if isinstance(r, (list, tuple)) else r for r in a]
      logp_b = [r[0] if isinstance(r, (list, tuple)) else r for r in b]
      np.testing.assert_allclose(logp_a, logp_b, atol=1e-4, rtol=0)
  assert responses(ours, 'mt_until') == responses(hf_results, 'mt_until')
  print(ours['results'], responses(ours, 'mt_until'), responses(ours, 'mt_choice')[:2])
  for metric in ('word_perplexity,none', 'bits_per_byte,none'):
    np.testing.assert_allclose(ours['results']['mt_rolling'][metric], hf_results['results']['mt_rolling'][metric],
                               rtol=1e-4)


def test_unknown_tasks_are_a_one_line_error(tasks):
  with pytest.raises(ConfigError, match=r"--tasks: unknown lm-eval task\(s\) 'mt_nope'"):
    harness.check_tasks(['mt_choice', 'mt_nope'], tasks[1])
