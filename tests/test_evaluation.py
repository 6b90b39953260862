"""Evaluation with lm-evaluation-harness: a trained run's checkpoint served to lm-eval (`HarnessLM`) gives the
results of lm-eval's own `hf` backend on the exported model, on one device and on dp4_tp2; scripts/evaluate.py
writes lm-eval's results JSON and prints its table; the training loop's harness action logs its metrics.

The tasks are local YAML files over local JSON lines (no dataset hub): a multiple-choice task, a rolling
log-likelihood task and a generation task with a stop sequence.
"""

import json
import re
import textwrap

import jax
import numpy as np
import pytest
from helpers import (
  TINY,
  build,
  fresh_compilation_cache,
  load_config,
  mesh_devices,
  quiet,
  run_script,
  short_documents,
)

from mintrain import loop
from mintrain.checkpoint.model import layout_config, restore_model
from mintrain.errors import ConfigError
from mintrain.evaluation import harness

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


def train(workdir, tokenizer_dir, short_docs, *overrides):
  config = load_config('single', *TINY, *short_docs, f'data.tokenizer={tokenizer_dir}', 'train.steps=4',
                       'optimizer.warmup_steps=1', 'optimizer.learning_rate=0.03', *overrides)
  return loop.run(config, workdir, devices=mesh_devices(config), print_fn=quiet)


@pytest.fixture(scope='module')
def trained(tmp_path_factory, bpe_tokenizer, short_docs):
  """A workdir of a tiny model trained 4 steps on text with the BPE tokenizer."""
  workdir = tmp_path_factory.mktemp('eval_run') / 'run'
  train(workdir, bpe_tokenizer, short_docs)
  return workdir


@pytest.fixture(scope='module')
def exported(trained):
  """The trained run and its export, as scripts/export_hf.py writes it."""
  root = trained.parent
  proc = run_script('scripts/export_hf.py', '--workdir', str(trained), '--out', str(root / 'hf'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  # transformers' generate stops at the EOS its generation config names (a Llama's names </s>); the export
  # writes none, and HarnessLM stops at the tokenizer's EOS.
  (root / 'hf' / 'generation_config.json').write_text(json.dumps({'bos_token_id': 0, 'eos_token_id': 1}))
  return trained, root / 'hf'


@pytest.fixture(scope='module')
def hf_results(exported, tasks):
  """lm-eval's own `hf` backend on the exported model (transformers, torch, float32 on CPU)."""
  from lm_eval.models.huggingface import HFLM
  lm = HFLM(pretrained=str(exported[1]), batch_size=4, max_length=MAX_LENGTH, device='cpu', dtype='float32')
  return harness.evaluate(lm, TASKS, tasks[1], log_samples=True)


def responses(results, task):
  """Each document's filtered responses (log-likelihoods, greedy flags, texts), in document order."""
  return [sample['filtered_resps'] for sample in sorted(results['samples'][task], key=lambda s: s['doc_id'])]


@pytest.mark.slow
@pytest.mark.parametrize('mesh', ['single', 'dp4_tp2'])
def test_a_checkpoint_gives_the_results_of_lm_evals_hf_backend_on_its_export(exported, tasks, hf_results,
                                                                             mesh):
  layout = layout_config(None if mesh == 'single' else f'mintrain/configs/{mesh}.py')
  restored = restore_model(exported[0], layout=layout, devices=jax.devices()[:1 if mesh == 'single' else 8])
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
  for metric in ('word_perplexity,none', 'bits_per_byte,none'):
    np.testing.assert_allclose(ours['results']['mt_rolling'][metric],
                               hf_results['results']['mt_rolling'][metric], rtol=1e-4)


def test_unknown_tasks_are_a_one_line_error(tasks):
  with pytest.raises(ConfigError, match=r"--tasks: unknown lm-eval task\(s\) 'mt_nope'"):
    harness.check_tasks(['mt_choice', 'mt_nope'], tasks[1])


@pytest.mark.slow
def test_evaluate_script_writes_lm_evals_results_json_and_prints_its_table(trained, tasks, tmp_path):
  cache = fresh_compilation_cache(tmp_path / 'cache')

  def evaluate(out):
    return run_script('scripts/evaluate.py', '--workdir', str(trained), '--tasks', 'mt_choice,mt_until',
                      '--include_path', str(tasks[0]), '--limit', '4', '--batch_size', '4',
                      '--output_path', str(out), env_extra=cache)

  out = tmp_path / 'results' / 'out.json'
  proc = evaluate(out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "cache hit for 'jit__score'" not in proc.stderr
  again = evaluate(tmp_path / 'again.json')
  assert again.returncode == 0 and "cache hit for 'jit__score'" in again.stderr, again.stderr[-3000:]
  results = json.loads(out.read_text())
  assert json.loads((tmp_path / 'again.json').read_text())['results'] == results['results']
  assert set(results['results']) == {'mt_choice', 'mt_until'}
  assert 0 <= results['results']['mt_choice']['acc,none'] <= 1
  assert results['n-samples']['mt_choice'] == {'original': 12, 'effective': 4}
  assert re.search(r'^\|\s*mt_choice\s*\|.*\|acc\s*\|', proc.stdout, re.M), proc.stdout
  assert 'Evaluating step 4 of' in proc.stdout
  plan = r'^sampling memory per device: .*, KV cache .* \(batch 4, 16 positions\)'
  assert re.search(plan, proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize('args, says', [
    (('--workdir', 'nowhere'), 'nowhere'),
    (('--tasks', 'mt_nope'), "--tasks: unknown lm-eval task(s) 'mt_nope'"),
])
@pytest.mark.slow
def test_evaluate_script_bad_input_is_one_line_and_exit_2(trained, tasks, tmp_path, args, says):
  given = {'--workdir': str(trained), '--tasks': 'mt_choice', **dict(zip(args[::2], args[1::2]))}
  proc = run_script('scripts/evaluate.py', *(x for kv in given.items() for x in kv), '--include_path',
                    str(tasks[0]), '--output_path', str(tmp_path / 'out.json'))
  assert proc.returncode == 2 and proc.stderr.startswith('error: ') and says in proc.stderr, proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert not (tmp_path / 'out.json').exists()


def test_a_missing_lm_eval_is_a_one_line_error_naming_the_extra(tmp_path):
  code = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv = sys.argv[1:]; "
          "runpy.run_path('scripts/evaluate.py', run_name='__main__')")
  proc = run_script('-c', code, 'evaluate.py', '--workdir', str(tmp_path), '--tasks', 'x', '--output_path',
                    str(tmp_path / 'out.json'))
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr == "error: lm-evaluation-harness is not installed: pip install -e '.[eval]'.\n"


@pytest.mark.slow
def test_the_training_loops_harness_action_logs_each_tasks_metrics(tmp_path, bpe_tokenizer, short_docs,
                                                                   tasks):
  result = train(tmp_path / 'run', bpe_tokenizer, short_docs, 'train.steps=2', 'eval.harness_every_steps=1',
                 'eval.harness_tasks=mt_choice,mt_rolling', 'eval.harness_limit=2',
                 f'eval.harness_include_path={tasks[0]}')
  records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  logged = [r for r in records if 'harness/mt_choice/acc' in r]
  assert [r['step'] for r in logged] == [1, 2]
  assert all(r['harness/mt_choice/acc'] in (0, 0.5, 1) and r['harness/mt_rolling/bits_per_byte'] > 0
             for r in logged)
  assert [r['step'] for r in result.records if 'harness/mt_rolling/word_perplexity' in r] == [1, 2]


@pytest.mark.slow
def test_unknown_harness_tasks_stop_training_before_it_writes(tmp_path, bpe_tokenizer, short_docs, tasks):
  with pytest.raises(ConfigError, match=r"eval.harness_tasks: unknown lm-eval task\(s\) 'mt_nope'"):
    train(tmp_path / 'run', bpe_tokenizer, short_docs, 'eval.harness_tasks=mt_choice,mt_nope',
          f'eval.harness_include_path={tasks[0]}')
  assert not (tmp_path / 'run' / 'metrics.jsonl').exists()


def test_harness_task_lists_with_empty_names_are_refused_by_the_config():
  with pytest.raises(ConfigError, match='eval.harness_tasks'):
    load_config('single', 'eval.harness_tasks=arc_easy,,piqa')


def test_a_model_without_a_sampler_refuses_generate_until_in_one_line():
  from lm_eval.api.instance import Instance

  from mintrain.build import build
  from mintrain.data.tokenizer import BYTES
  config = load_config('mlp_dp4_tp2')
  run = build(config, mesh_devices(config))
  lm = harness.HarnessLM(run.model(run.abstract_state.params), run.config, BYTES, run.mesh)
  request = Instance('generate_until', {}, ('def ', {'until': ['\n']}), 0)
  with pytest.raises(harness.EvalError, match=r"^model.name='mlp' has no sampler: it cannot run"):
    lm.generate_until([request])
  with pytest.raises(harness.EvalError, match=r"^model.name='mlp' is not a language model"):
    lm.loglikelihood([Instance('loglikelihood', {}, ('a', 'b'), 0)])
  from mintrain.actions import HarnessEvaluate
  run = build(load_config('mlp_dp4_tp2', 'eval.harness_tasks=arc_easy'), mesh_devices(config))
  with pytest.raises(ConfigError, match=r"^eval.harness_tasks='arc_easy' needs a language model"):
    HarnessEvaluate(run, quiet, BYTES, quiet)


def test_requests_are_tokenized_and_chats_rendered_as_transformers_does(bpe_tokenizer, tmp_path):
  """As lm-eval's hf backend: BOS first, context and continuation encoded whole then split; the chat template
  with the assistant's turn opened."""
  import shutil

  import transformers
  from helpers import build

  from mintrain.data import tokenizer
  shutil.copytree(bpe_tokenizer, tmp_path / 'tok')
  (tmp_path / 'tok' / 'chat_template.jinja').write_text(
      "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
      "{% if add_generation_prompt %}<|assistant|>{% endif %}")
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / 'tok')
  config = load_config('single', *TINY, 'model.vocab_size=512')
  run = build(config)
  lm = harness.HarnessLM(run.model(run.abstract_state.params), run.config,
                         tokenizer.load(str(tmp_path / 'tok')), run.mesh)
  context, continuation = 'def parse(path):\n    return', ' open(path).read()'
  whole = theirs.encode(context + continuation)
  assert lm.tok_encode(context + continuation) == whole and whole[0] == theirs.bos_token_id
  assert lm._encode_pair(context, continuation) == (theirs.encode(context),
                                                    whole[len(theirs.encode(context)):])
  chat = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
  assert lm.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False,
                                                                    add_generation_prompt=True)
  assert lm.apply_chat_template(chat, add_generation_prompt=False).endswith('Hi\n')


@pytest.mark.slow  # About 12 s: the sampler compiled for each prompt alone, as the reference.
def test_generate_until_pads_prompts_to_length_buckets_and_generates_what_each_prompt_alone_does():
  """Prompts of five lengths in two buckets (16, 32) compile two programs; each row's tokens are those of
  the sampler on its prompt alone, past a local layer's window (its rolling buffer)."""
  from lm_eval.api.instance import Instance

  from mintrain.data.tokenizer import BYTES
  from mintrain.models.transformer import sampling
  config = load_config('single', *TINY, 'model.vocab_size=384', 'model.sliding_window=5',
                       'model.global_every=2')
  run = build(config)
  with jax.set_mesh(run.mesh):
    model = run.model(run.init().params)
  lm = harness.HarnessLM(model, run.config, BYTES, run.mesh, batch_size=4, max_length=64)
  texts = ['abc', 'def parse(', 'import numpy as np', 'class Tokenizer:\n    ',
           'for i in range(n):\n   x += 1']
  requests = [Instance('generate_until', {}, (text, {'until': ['\x00'], 'max_gen_toks': 6}), i)
              for i, text in enumerate(texts)]
  compiled = sampling._complete._cache_size()
  out = lm.generate_until(requests)
  assert sampling._complete._cache_size() - compiled == 2
  with jax.set_mesh(run.mesh):
    alone = [np.asarray(sampling.generate(model, np.array([lm.tok_encode(text)], np.int32), 6))[0]
             for text in texts]
  assert out == [BYTES.decode(tokens.tolist()).split('\x00')[0] for tokens in alone]
  assert len({len(lm.tok_encode(text)) for text in texts}) == 5 and max(map(len, out)) > 0
