"""Chat SFT data (`data.format='chat'`) through the real pipeline, against transformers' apply_chat_template:
ids, assistant weights as target_weights, conversations as documents, bad records, training and resume."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, build, load_config, mesh_devices, quiet, run_script, script_flags, train_in_process

from mintrain import loop as train_loop
from mintrain.data import pipeline, records, streaming, tokenizer
from mintrain.data.batches import make_batches
from mintrain.errors import ConfigError, DataError
from mintrain.objectives.lm import loss as loss_fn

SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
# ChatML (Qwen's, without tools), its assistant turns marked with {% generation %}; unknown roles refused.
MARKED = """{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}
{{- raise_exception('ChatML knows system, user and assistant, not ' + message.role) }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}
{{- '\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
"""
UNMARKED = MARKED.replace('{% generation %}', '').replace('{% endgeneration %}', '')
WORDS = 'the quick brown fox jumps over a lazy dog while seven primes and thirteen owls sing'.split()


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
  """Distinct chats of one to three exchanges, some with a system prompt, each naming itself."""
  rng = np.random.default_rng(seed)
  say = lambda k: ' '.join(rng.choice(WORDS, size=rng.integers(1, k)))  # noqa: E731
  chats = []
  for i in range(n):
    chat = [{'role': 'system', 'content': f'Be brief ({i}).'}] if i % 3 == 0 else []
    for turn in range(1 + i % 3):
      chat += [{'role': 'user', 'content': f'Question {i}.{turn}: {say(8)}?'},
               {'role': 'assistant', 'content': f'Answer {i}.{turn}: {say(10)}.'}]
    chats.append(chat)
  return chats


@pytest.fixture(scope='module')
def bpe():
  """A small byte-level BPE with ChatML's special tokens, trained here (offline)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  texts = [json.dumps(c) for c in conversations(60)] + [MARKED]
  tok.train_from_iterator(texts * 3, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def save(bpe, directory, template):
  """transformers' tokenizer saved to `directory` with `template` (None: no chat template)."""
  import transformers

  theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=template,
                                                eos_token='<|im_end|>', pad_token='<|endoftext|>')
  theirs.save_pretrained(directory)
  return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope='module')
def marked(bpe, tmp_path_factory):
  directory = tmp_path_factory.mktemp('marked')
  return save(bpe, directory, MARKED), str(directory)


@pytest.fixture(scope='module')
def expected(marked):
  """Each conversation's (ids, assistant mask) as transformers gives them."""
  theirs, _ = marked
  out = []
  for chat in conversations(24):
    got = theirs.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert sum(got['assistant_masks']) > 0
    out.append((got['input_ids'], got['assistant_masks']))
  return out


def write_chats(path, chats, bad_lines=()):
  lines = [json.dumps({'messages': chat, 'id': i}) for i, chat in enumerate(chats)]
  for at, line in bad_lines:
    lines.insert(at, line)
  path.write_text('\n'.join(lines) + '\n')
  return str(path)


def chat_overrides(tmp_path, tok_dir, **values) -> list[str]:
  """`data.*` overrides that read 24 conversations from a JSONL file in `tmp_path`."""
  settings = {'source': 'jsonl', 'path': str(tmp_path / 'chats.jsonl'), 'format': 'chat',
              'tokenizer': tok_dir, 'eval_fraction': 0.0, 'prefetch': 0, **values}
  if not (tmp_path / 'chats.jsonl').exists():
    write_chats(tmp_path / 'chats.jsonl', conversations(24))
  return [f'data.{k}={v}' for k, v in settings.items()]


def chat_data(tmp_path, tok_dir, **values):
  return load_config('single', *TINY, *chat_overrides(tmp_path, tok_dir, **values)).data


def rows(cfg, tok, *, seq_len=192, batch=8, seed=0):
  return pipeline.make_iterator(cfg, tok, split='train', seq_len=seq_len, global_batch_size=batch,
                                micro_batch_size=batch, rows=np.arange(batch), seed=seed)


@pytest.mark.parametrize('template', ['marked', 'unmarked'])
def test_padded_rows_are_apply_chat_template_ids_weighted_by_its_assistant_mask(marked, expected, tmp_path,
                                                                                template):
  """Without {% generation %}, the assistant's content and <|im_end|> are what the marked template marks."""
  chosen = {}
  if template == 'unmarked':
    (tmp_path / 'unmarked.jinja').write_text(UNMARKED)
    chosen = {'chat_template': str(tmp_path / 'unmarked.jinja')}
  cfg = chat_data(tmp_path, marked[1], packing='pad', **chosen)
  by_ids = {tuple(ids): mask for ids, mask in expected}
  seen, it = set(), rows(cfg, tokenizer.load(marked[1]))
  for batch in [next(it) for _ in range(4)]:
    for r in range(8):
      n = int((batch['segment_ids'][r] > 0).sum())
      ids = tuple(batch['inputs'][r][:n].tolist() + batch['targets'][r][n - 1:n].tolist())
      assert ids in by_ids, 'a row is not one whole conversation'
      assert batch['target_weights'][r][:n].tolist() == by_ids[ids][1:]  # Target t + 1 weighs as token t + 1.
      assert not batch['target_weights'][r][n:].any() and (batch['positions'][r][:n] == np.arange(n)).all()
      seen.add(ids)
  assert len(seen) > 12


def test_packed_chats_mixed_with_text_are_document_masked_and_weighted(marked, expected, tmp_path):
  """A conversation is one document though <|im_end|>, its tokenizer's EOS, ends each of its turns."""
  text = tmp_path / 'text.jsonl'
  text.write_text(''.join(json.dumps({'text': ' '.join(WORDS[i % 7:])}) + '\n' for i in range(50)))
  mixture = [({'source': 'jsonl', 'path': write_chats(tmp_path / 'chats.jsonl', conversations(24))}, 0.5),
             ({'source': 'jsonl', 'path': str(text), 'format': 'text'}, 0.5)]
  cfg = load_config('single', *TINY, 'data.source=mixture', f'data.mixture={mixture!r}', 'data.format=chat',
                    f'data.tokenizer={marked[1]}', 'data.eval_fraction=0.0', 'data.prefetch=0').data
  tok = tokenizer.load(marked[1])
  choices = [streaming.mixture_choices([0.5, 0.5], 0, step, 8) for step in range(6)]
  batches = [next(it) for it in [rows(cfg, tok, seq_len=32)] for _ in range(6)]
  by_ids = {tuple(ids): mask for ids, mask in expected}
  for r in range(8):
    chat_steps = [s for s in range(6) if choices[s][r] == 0]
    text_steps = [s for s in range(6) if choices[s][r] == 1]
    for s in text_steps:
      assert batches[s]['target_weights'][r].all()  # Text counts every target, as before.
    if not chat_steps:
      continue
    stream = np.concatenate([batches[s]['inputs'][r] for s in chat_steps])
    weights = np.concatenate([batches[s]['target_weights'][r] for s in chat_steps])
    positions = np.concatenate([batches[s]['positions'][r] for s in chat_steps])
    start, starts = 0, np.arange(len(stream)) % 32 == 0  # Each row restarts its positions.
    while start < len(stream):
      ids = next((k for k in by_ids if tuple(stream[start:start + len(k)]) == k[:len(stream) - start]), None)
      assert ids is not None, f'row {r}: no conversation starts at {start}'
      end = min(start + len(ids), len(stream))
      assert weights[start:end - 1].tolist() == by_ids[ids][1:end - start]
      starts[start] = True
      start = end
    assert ((positions == 0) == starts).all()  # Positions restart at each conversation and at no turn.


def test_loss_on_all_weights_every_token_of_a_conversation(marked, tmp_path):
  cfg = chat_data(tmp_path, marked[1], packing='pad', loss_on='all')
  batch = next(rows(cfg, tokenizer.load(marked[1])))
  counted = batch['segment_ids'] > 0
  assert (batch['target_weights'][counted] == 1).all() and not batch['target_weights'][~counted].any()


BAD = [(2, json.dumps({'messages': [{'content': 'no role'}]}), r'message 0 has no "role"'),
       (5, json.dumps({'messages': [{'role': 'user', 'content': 7}]}), r'"content" must be a string'),
       (9, json.dumps({'messages': [{'role': 'critic', 'content': 'meh'}]}), 'not critic'),
       (13, json.dumps({'messages': 'hello'}), 'a chat is a non-empty list of messages'),
       (17, json.dumps({'text': 'no messages'}), r"no field 'messages' \(data.messages_field\)")]


def test_bad_chat_records_name_file_and_line_or_are_counted_when_skipped(marked, tmp_path):
  tok = tokenizer.load(marked[1])
  path = write_chats(tmp_path / 'chats.jsonl', conversations(20), [(at, line) for at, line, _ in BAD])
  for _, line, says in BAD:
    one = write_chats(tmp_path / 'one.jsonl', conversations(3), [(1, line)])
    cfg = chat_data(tmp_path, marked[1], path=one)
    reader = records.Reader(cfg, tok)
    with pytest.raises(DataError, match=f'one.jsonl:2: .*{says}.*; fix it or set data.skip_bad_records') as e:
      reader.read(reader.all_blocks(), 0)
    assert '\n' not in str(e.value)
  cfg = chat_data(tmp_path, marked[1], path=path, skip_bad_records=True)
  reader = records.Reader(cfg, tok)
  docs = reader.read(reader.all_blocks(), 0)
  assert len(docs) == 20 and reader.bad.count == len(BAD)
  assert all(isinstance(d, records.Conversation) for d in docs)


def test_parquet_chats_read_as_the_jsonl_ones(marked, tmp_path):
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq

  tok = tokenizer.load(marked[1])
  chats = conversations(6)
  pq.write_table(pa.table({'messages': chats}), tmp_path / 'chats.parquet')
  datasets.Dataset.from_dict({'messages': chats}).save_to_disk(str(tmp_path / 'saved'))
  read = {}
  for source, path in [('parquet', tmp_path / 'chats.parquet'), ('jsonl', tmp_path / 'chats.jsonl'),
                       ('hf_datasets', tmp_path / 'saved')]:
    reader = records.Reader(chat_data(tmp_path, marked[1], source=source, path=path), tok)
    read[source] = reader.read(reader.all_blocks(), 0)
  for source in ('parquet', 'hf_datasets'):  # Hugging Face datasets' save_to_disk too.
    assert len(read[source]) == 6 and [d.ids.tolist() for d in read[source]] == [
        d.ids.tolist() for d in read['jsonl'][:6]]
    assert [d.weights.tolist() for d in read[source]] == [d.weights.tolist() for d in read['jsonl'][:6]]
  streamed = records.Reader(chat_data(tmp_path, marked[1], source='hf_datasets', hf_streaming=True), tok)
  docs = streamed.read(streamed.all_blocks(), 0)  # The JSONL file through load_dataset(streaming=True).
  assert [(d.ids.tolist(), d.weights.tolist()) for d in docs] == [
      (d.ids.tolist(), d.weights.tolist()) for d in read['jsonl']]


def test_a_chat_config_needs_a_tokenizer_with_a_chat_template(bpe, tmp_path):
  save(bpe, tmp_path / 'plain', None)
  for tok, says in [('byte', "data.format='chat' needs a Hugging Face tokenizer"),
                    (str(tmp_path / 'plain'), 'has no chat template .*; set data.chat_template')]:
    with pytest.raises(ConfigError, match=says) as e:
      load_config('single', 'data.source=jsonl', 'data.path=x.jsonl', 'data.format=chat',
                  f'data.tokenizer={tok}')
    assert '\n' not in str(e.value)
  with pytest.raises(ConfigError, match="data.format='chat' reads conversations from records of"):
    load_config('single', 'data.source=text', 'data.format=chat')
  workdir = tmp_path / 'run'
  proc = run_script('scripts/train.py', '--config', 'mintrain/configs/single.py', '--workdir', str(workdir),
                    *script_flags('data.source=jsonl', 'data.path=x.jsonl', 'data.format=chat'))
  assert proc.returncode == 2 and proc.stderr.startswith("error: data.format='chat' needs")
  assert not workdir.exists()
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_training_on_chats_runs_and_its_eval_counts_only_the_assistant_tokens(marked, tmp_path):
  """And rows of prompts alone (no assistant token) add no loss and no gradient, rather than NaN."""
  config = load_config('single', *TINY, 'train.steps=2', 'eval.steps=1', 'train.seq_len=128',
                       *chat_overrides(tmp_path, marked[1], eval_fraction=0.5, block_bytes=512))
  result = train_loop.run(config, None, devices=mesh_devices(config), print_fn=quiet)
  assert len(result.losses) == 2 and np.isfinite(result.losses).all()
  assert np.isfinite(result.summary['final_eval_loss'])
  run = build(config)
  with jax.set_mesh(run.mesh):
    batch = next(make_batches(config, run.mesh, run.rules, tokenizer.load(marked[1]), split='eval'))
    summed, count = run.eval_step(result.state.params, batch)
    prompts = {**jax.tree.map(lambda x: x[0], batch), 'target_weights': jnp.zeros(batch['inputs'].shape[1:])}
    assert_no_loss_and_no_gradient(run, result.state.params, prompts)
  weights = np.asarray(batch['target_weights'])
  assert 0 < weights.sum() < (np.asarray(batch['segment_ids']) > 0).sum()  # Not the user's or system's.
  assert float(count) == weights.sum() and np.isfinite(float(summed))


@pytest.mark.slow  # A training run of two evaluations (about 10 s).
def test_an_eval_of_prompts_alone_says_so_once_and_logs_no_nan(marked, tmp_path):
  """Rows shorter than every prompt: the held-out batches count no target, at each of two evaluations."""
  config = load_config('single', *TINY, 'train.steps=2', 'eval.steps=1', 'eval.every_steps=1',
                       'train.seq_len=8', *chat_overrides(tmp_path, marked[1], eval_fraction=0.5))
  lines = []
  result = train_loop.run(config, tmp_path / 'run', devices=mesh_devices(config), print_fn=lines.append)
  assert sum('hold no trained token' in line for line in lines) == 1
  logged = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  assert logged and not any(k.startswith('eval_') for record in logged for k in record)
  assert not any(k.startswith('final_eval') for k in result.summary) and np.isfinite(result.losses).all()


def assert_no_loss_and_no_gradient(run, params, micro):
  step = jax.jit(jax.value_and_grad(functools.partial(loss_fn, graphdef=run.graphdef, dropout_key=None),
                                    has_aux=True))
  (loss, (count, _)), grads = step(params, batch=micro)
  assert float(loss) == 0 and float(count) == 0
  assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_prompts_alone_add_no_loss_and_no_gradient_on_the_logits_path_too():
  config = load_config('single', *TINY, 'data.source=synthetic', 'model.vocab_size=384',
                       'model.loss_chunks=0')
  run = build(config)
  with jax.set_mesh(run.mesh):
    batch = next(make_batches(config, run.mesh, run.rules, tokenizer.BYTES))
    prompts = {**jax.tree.map(lambda x: x[0], batch), 'target_weights': jnp.zeros(batch['inputs'].shape[1:])}
    assert_no_loss_and_no_gradient(run, run.init().params, prompts)


@pytest.mark.parametrize('source', [{}, {'source': 'hf_datasets', 'hf_streaming': True}])
def test_chat_rows_resume_exactly_from_a_saved_state(marked, tmp_path, source):
  cfg = chat_data(tmp_path, marked[1], shuffle_window=2, block_bytes=512, **source)
  tok = tokenizer.load(marked[1])
  straight = rows(cfg, tok, seq_len=32)
  for _ in range(3):
    next(straight)
  state = json.loads(json.dumps(straight.get_state()))
  resumed = rows(cfg, tok, seq_len=32)
  resumed.set_state(state)
  for _ in range(3):
    a, b = next(straight), next(resumed)
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.slow
def test_training_on_chats_resumes_bit_exactly(marked, tmp_path):
  """Stopped by SIGTERM after step 2 (as a preemption) and resumed: the losses and parameters of one run."""
  config = load_config('single', *TINY, 'train.steps=4', 'train.log_every=1', 'checkpoint.every_steps=2',
                       *chat_overrides(tmp_path, marked[1], eval_fraction=0.3, block_bytes=512))

  straight = train_in_process(config, tmp_path / 'straight')
  first = train_in_process(config, tmp_path / 'stopped', stop_at=2)
  assert first.stopped_by == 'SIGTERM' and int(first.state.step) == 2
  resumed = train_in_process(config, tmp_path / 'stopped')
  assert first.losses + resumed.losses == straight.losses and all(np.isfinite(straight.losses))
  for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_show_marks_exactly_the_trained_spans_of_rendered_chats(marked, expected, tmp_path):
  theirs, tok_dir = marked
  path = write_chats(tmp_path / 'chats.jsonl', conversations(24))
  proc = run_script('scripts/tokenize_corpus.py', '--config', 'mintrain/configs/single.py',
                    '--format', 'chat', '--show', '2', '--config.data.source=jsonl',
                    f'--config.data.path={path}', f'--config.data.tokenizer={tok_dir}')
  assert proc.returncode == 0, proc.stderr
  shown = re.split(r'^--- conversation \d+ ---\n', proc.stdout, flags=re.M)[1:]
  assert len(shown) == 2
  for chat, block, (ids, mask) in zip(conversations(2), shown, expected):
    text, summary = block[:block.rindex('\n(')], block[block.rindex('\n('):]
    trained = re.findall('⟦(.*?)⟧', text, flags=re.S)
    assert text.replace('⟦', '').replace('⟧', '') == theirs.apply_chat_template(chat, tokenize=False)
    runs, run = [], []
    for i, m in zip(ids + [None], mask + [0]):
      if m:
        run.append(i)
      elif run:
        runs, run = runs + [theirs.decode(run)], []
    assert trained == runs
    assert summary.strip() == f'({sum(mask)} of {len(ids)} tokens trained)'
