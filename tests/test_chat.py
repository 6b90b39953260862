"""Chat rendering against transformers' `apply_chat_template`: real templates (ChatML/Qwen with and without
`{% generation %}`, Llama 3, Gemma) on small BPE tokenizers built here, offline."""

import json

import numpy as np
import pytest

from mintrain.data import chat, tokenizer
from mintrain.errors import DataError

SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|begin_of_text|>', '<|start_header_id|>',
           '<|end_header_id|>', '<|eot_id|>', '<bos>', '<eos>', '<pad>', '<start_of_turn>', '<end_of_turn>']

QWEN = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(answered=false) %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- continue %}
{%- elif message.role == 'assistant' %}
{%- set ns.answered = true %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content if message.content else '' }}
{%- for call in message.tool_calls %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": '
    + call.function.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHATML = QWEN.replace('{% generation %}', '').replace('{% endgeneration %}', '')

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] | trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
{{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
{{- "You have access to the following functions.\\n\\n" }}
{%- for t in tools %}
{{- t | tojson(indent=4) }}
{{- "\\n\\n" }}
{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if message.role in ['user', 'assistant'] %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
    + message['content'] | trim + '<|eot_id|>' }}
{%- elif message.role in ['tool', 'ipython'] %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
{%- else %}
{{- raise_exception('Unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = "" -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif -%}
{%- if message['role'] == 'assistant' -%}
{%- set role = "model" -%}
{%- elif message['role'] == 'user' -%}
{%- set role = "user" -%}
{%- else -%}
{{ raise_exception("Gemma knows the roles user and assistant, not " + message['role']) }}
{%- endif -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
{{- message['content'] | trim }}
{{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

TEMPLATES = {  # name -> (template, special tokens, the token that ends a turn)
    'qwen': (QWEN, {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>'}, '<|im_end|>'),
    'chatml': (CHATML, {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>'}, '<|im_end|>'),
    'llama3': (LLAMA3, {'bos_token': '<|begin_of_text|>', 'eos_token': '<|eot_id|>'}, '<|eot_id|>'),
    'gemma': (GEMMA, {'bos_token': '<bos>', 'eos_token': '<eos>', 'pad_token': '<pad>'}, '<end_of_turn>'),
}

CHATS = {
    'one turn': [{'role': 'user', 'content': 'Hello, how are you?'},
                 {'role': 'assistant', 'content': 'I am fine, thank you.'}],
    'system and three turns': [
        {'role': 'system', 'content': 'You are terse.'},
        {'role': 'user', 'content': 'Name a prime.'},
        {'role': 'assistant', 'content': 'Seven.'},
        {'role': 'user', 'content': 'Another one?'},
        {'role': 'assistant', 'content': ' Eleven, and then 13.\n'},
        {'role': 'user', 'content': 'Thanks!'},
        {'role': 'assistant', 'content': 'You are welcome.'}],
    'unicode': [{'role': 'user', 'content': 'Grüße aus Köln! Что нового? 世界 🙂'},
                {'role': 'assistant', 'content': 'Naïve café — 你好，世界 🙂🎉\n\tfin'}],
    'ends with the user': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'},
                           {'role': 'user', 'content': 'Bye'}],
}

WEATHER = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'The weather in a city, "now".',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string', 'description': 'Zürich & co'}},
                   'required': ['city']}}}
TOOL_CHAT = [
    {'role': 'system', 'content': 'Use tools.'},
    {'role': 'user', 'content': 'Weather in Zürich?'},
    {'role': 'assistant', 'content': '', 'tool_calls': [
        {'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Zürich'}}}]},
    {'role': 'tool', 'content': '{"temperature": 21, "sky": "clear"}'},
    {'role': 'assistant', 'content': 'It is 21 °C and clear in Zürich.'}]


@pytest.fixture(scope='module')
def bpe():
  """A byte-level BPE trained on the templates' text and the chats, with the chat formats' special tokens."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  texts = [t for t, _, _ in TEMPLATES.values()] + [json.dumps(c, ensure_ascii=False) for c in CHATS.values()]
  trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts * 3 + [json.dumps(TOOL_CHAT), json.dumps(WEATHER)], trainer)
  return tok


@pytest.fixture(scope='module')
def metaspace():
  """A SentencePiece-style BPE (spaces as '▁', no byte fallback): offsets that skip a normalized text."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first')
  tok.decoder = decoders.Metaspace(replacement='▁', prepend_scheme='first')
  texts = [t for t, _, _ in TEMPLATES.values()] + [json.dumps(c, ensure_ascii=False)
                                                   for c in [*CHATS.values(), TOOL_CHAT, WEATHER]]
  tok.train_from_iterator(texts * 3, trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIAL))
  return tok


def save(bpe, directory, template, **special):
  """(transformers' tokenizer, ours), read from one directory saved by transformers."""
  import transformers

  theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=template, **special)
  theirs.save_pretrained(directory)
  return transformers.AutoTokenizer.from_pretrained(directory), tokenizer.load(str(directory))


@pytest.fixture(params=sorted(TEMPLATES))
def pair(request, bpe, tmp_path):
  template, special, _ = TEMPLATES[request.param]
  return (request.param, *save(bpe, tmp_path / request.param, template, **special))


def assert_same(theirs, ours, messages, **kwargs):
  """Our ids equal apply_chat_template's; returns ours, our weights and transformers' assistant mask."""
  expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, **kwargs)
  ids, weights = chat.encode(ours, messages, **kwargs)
  assert ids.dtype == np.int32 and weights.dtype == np.float32 and ids.shape == weights.shape
  assert ids.tolist() == expected['input_ids']
  text = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
  assert chat.render(ours, messages, **kwargs)[0] == text
  return ids, weights, np.asarray(expected['assistant_masks'], np.float32)


def weighted_text(ours, ids, weights):
  """The text of each run of weighted tokens, special tokens included."""
  runs, run = [], []
  for i, w in zip(ids.tolist(), weights.tolist()):
    if w:
      run.append(i)
    elif run:
      runs.append(ours.tokenizer.decode(run, skip_special_tokens=False))
      run = []
  return runs + ([ours.tokenizer.decode(run, skip_special_tokens=False)] if run else [])


@pytest.mark.parametrize('name', sorted(CHATS))
def test_ids_equal_apply_chat_template_for_every_template(pair, name):
  _, theirs, ours = pair
  assert_same(theirs, ours, CHATS[name])


@pytest.mark.parametrize('name', sorted(CHATS))
def test_generation_weights_equal_return_assistant_tokens_mask(bpe, tmp_path, name):
  theirs, ours = save(bpe, tmp_path, QWEN, **TEMPLATES['qwen'][1])
  _, weights, mask = assert_same(theirs, ours, CHATS[name])
  assert weights.tolist() == mask.tolist() and mask.sum() > 0


@pytest.mark.parametrize('name', sorted(CHATS))
def test_without_markers_assistant_content_and_its_end_of_turn_are_weighted(pair, name):
  """Each run of weighted tokens is one assistant message's content as rendered, then the turn's end token."""
  template, theirs, ours = pair
  end = TEMPLATES[template][2]
  ids, weights, _ = assert_same(theirs, ours, CHATS[name])
  trim = template in ('llama3', 'gemma')  # These templates trim content.
  contents = [m['content'].strip() if trim else m['content'] for m in CHATS[name] if m['role'] == 'assistant']
  assert weighted_text(ours, ids, weights) == [c + end for c in contents]


@pytest.mark.parametrize('name', sorted(CHATS))
def test_chatml_without_markers_weights_what_the_same_template_with_markers_marks(bpe, tmp_path, name):
  special = TEMPLATES['qwen'][1]
  theirs, _ = save(bpe, tmp_path / 'marked', QWEN, **special)
  _, ours = save(bpe, tmp_path / 'plain', CHATML, **special)
  _, weights, _ = assert_same(theirs, ours, CHATS[name])
  mask = theirs.apply_chat_template(CHATS[name], return_dict=True, return_assistant_tokens_mask=True)
  assert weights.tolist() == mask['assistant_masks']


@pytest.mark.parametrize('template', sorted(TEMPLATES))
def test_a_sentencepiece_style_tokenizer_gives_the_same_ids_and_mask(metaspace, tmp_path, template):
  theirs, ours = save(metaspace, tmp_path / 'tok', TEMPLATES[template][0], **TEMPLATES[template][1])
  marked, _ = save(metaspace, tmp_path / 'marked', QWEN, **TEMPLATES['qwen'][1])
  for messages in CHATS.values():
    _, weights, _ = assert_same(theirs, ours, messages)
    if template in ('qwen', 'chatml'):  # The same text; one template marks it, the other not.
      mask = marked.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
      assert weights.tolist() == mask['assistant_masks']


def test_tool_calls_and_tool_results_with_generation_markers(bpe, tmp_path):
  theirs, ours = save(bpe, tmp_path, QWEN, **TEMPLATES['qwen'][1])
  ids, weights, mask = assert_same(theirs, ours, TOOL_CHAT, tools=[WEATHER])
  assert weights.tolist() == mask.tolist()
  first, second = weighted_text(ours, ids, weights)
  assert first == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
                   '<|im_end|>')
  assert second == 'It is 21 °C and clear in Zürich.<|im_end|>'


def test_llama3_lists_tools_with_todays_date_after_its_bos(bpe, tmp_path):
  import datetime

  theirs, ours = save(bpe, tmp_path, LLAMA3, **TEMPLATES['llama3'][1])
  chat_ = [m for m in TOOL_CHAT if 'tool_calls' not in m]
  ids, _, _ = assert_same(theirs, ours, chat_, tools=[WEATHER])
  text = chat.render(ours, chat_, tools=[WEATHER])[0]
  assert ids[0] == ours.tokenizer.token_to_id('<|begin_of_text|>') and '"description": "Zürich & co"' in text
  assert f'Today Date: {datetime.datetime.now().strftime("%d %b %Y")}' in text


def test_gemma_folds_the_system_prompt_into_the_first_user_turn_and_names_the_assistant_model(bpe, tmp_path):
  theirs, ours = save(bpe, tmp_path, GEMMA, **TEMPLATES['gemma'][1])
  ids, weights, _ = assert_same(theirs, ours, CHATS['system and three turns'])
  text = chat.render(ours, CHATS['system and three turns'])[0]
  assert text.startswith('<bos><start_of_turn>user\nYou are terse.\n\nName a prime.<end_of_turn>\n')
  assert '<start_of_turn>model\nSeven.<end_of_turn>\n' in text


def test_loss_on_all_weights_every_token(pair):
  _, theirs, ours = pair
  ids, weights = chat.encode(ours, CHATS['unicode'], loss_on='all')
  assert weights.tolist() == [1.0] * len(ids) and len(ids) > 10


def test_the_template_comes_from_tokenizer_config_when_there_is_no_jinja_file(bpe, tmp_path):
  import transformers

  save(bpe, tmp_path / 'saved', QWEN, **TEMPLATES['qwen'][1])
  config = json.loads((tmp_path / 'saved' / 'tokenizer_config.json').read_text())
  tool_use = QWEN.replace('# Tools', '# Tools (tool_use)')
  config['chat_template'] = [{'name': 'default', 'template': QWEN},
                             {'name': 'tool_use', 'template': tool_use}]
  (tmp_path / 'tok').mkdir()
  (tmp_path / 'tok' / 'tokenizer_config.json').write_text(json.dumps(config))
  (tmp_path / 'tok' / 'tokenizer.json').write_bytes((tmp_path / 'saved' / 'tokenizer.json').read_bytes())
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / 'tok')
  ours = tokenizer.load(str(tmp_path / 'tok'))
  assert_same(theirs, ours, CHATS['one turn'])
  assert_same(theirs, ours, TOOL_CHAT, tools=[WEATHER])
  assert '# Tools (tool_use)' in chat.render(ours, TOOL_CHAT, tools=[WEATHER])[0]
  named = chat.render(ours, CHATS['one turn'], template='tool_use')[0]
  assert named == chat.render(ours, CHATS['one turn'])[0]


def test_an_explicit_template_is_text_or_a_file(bpe, tmp_path):
  theirs, ours = save(bpe, tmp_path / 'tok', QWEN, **TEMPLATES['qwen'][1])
  (tmp_path / 'gemma.jinja').write_text(GEMMA)
  expected = theirs.apply_chat_template(CHATS['one turn'], chat_template=GEMMA, tokenize=False)
  assert chat.render(ours, CHATS['one turn'], template=GEMMA)[0] == expected
  assert chat.render(ours, CHATS['one turn'], template=tmp_path / 'gemma.jinja')[0] == expected


def test_a_saved_tokenizer_keeps_its_chat_template(bpe, tmp_path):
  _, ours = save(bpe, tmp_path / 'tok', LLAMA3, **TEMPLATES['llama3'][1])
  assert chat.TEMPLATE_FILE in ours.save(tmp_path / 'copy')
  copy = tokenizer.load(str(tmp_path / 'copy'))
  assert chat.encode(copy, CHATS['unicode'])[0].tolist() == chat.encode(ours, CHATS['unicode'])[0].tolist()


def test_template_variables_are_the_tokenizers_special_tokens(bpe, tmp_path):
  theirs, ours = save(bpe, tmp_path, GEMMA, bos_token='<bos>', eos_token='<eos>', pad_token='<pad>',
                      image_token='<start_of_turn>')
  assert chat.special_tokens(ours) == theirs.special_tokens_map == {
      'bos_token': '<bos>', 'eos_token': '<eos>', 'pad_token': '<pad>', 'image_token': '<start_of_turn>'}


@pytest.mark.parametrize('messages, message', [
    ([{'content': 'hi'}], 'message 0 has no "role"'),
    ([{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': ['a', 'b']}],
     'message 1 (assistant): "content" must be a string, got list'),
    ([{'role': 'user', 'content': 7}], 'message 0 (user): "content" must be a string, got int'),
    ([{'role': 'user'}], 'message 0 (user): "content" must be a string, got NoneType'),
    (['hello'], 'message 0 is a str'),
    ([], 'a chat is a non-empty list of messages'),
])
def test_bad_messages_are_one_line_data_errors(bpe, tmp_path, messages, message):
  _, ours = save(bpe, tmp_path, CHATML, **TEMPLATES['chatml'][1])
  with pytest.raises(DataError, match='^' + message.replace('(', r'\(').replace(')', r'\)')) as e:
    chat.encode(ours, messages)
  assert '\n' not in str(e.value)


def test_a_role_the_template_refuses_is_a_one_line_data_error(bpe, tmp_path):
  _, ours = save(bpe, tmp_path, GEMMA, **TEMPLATES['gemma'][1])
  bad = [{'role': 'user', 'content': 'hi'}, {'role': 'critic', 'content': 'meh'}]
  with pytest.raises(DataError, match=r"refuses the chat \(roles \['user', 'critic'\]\): .*not critic$") as e:
    chat.encode(ours, bad)
  assert '\n' not in str(e.value)
  with pytest.raises(DataError, match='must alternate'):
    chat.encode(ours, [{'role': 'user', 'content': 'a'}, {'role': 'user', 'content': 'b'}])


def test_tool_calls_and_reasoning_need_generation_markers_to_be_weighed(bpe, tmp_path):
  _, ours = save(bpe, tmp_path, CHATML, **TEMPLATES['chatml'][1])
  with pytest.raises(DataError, match=r'^message 2 \(assistant\) has tool_calls, .* markers can weigh'):
    chat.encode(ours, TOOL_CHAT, tools=[WEATHER])
  thought = [{'role': 'user', 'content': 'Hi'},
             {'role': 'assistant', 'content': 'Hello', 'reasoning': 'Greet.'}]
  with pytest.raises(DataError, match=r'^message 1 \(assistant\) has reasoning_content'):
    chat.encode(ours, thought)
  assert chat.encode(ours, TOOL_CHAT, tools=[WEATHER], loss_on='all')[1].all()


def test_no_chat_template_is_a_data_error(bpe, tmp_path):
  _, ours = save(bpe, tmp_path, None, eos_token='<eos>')
  with pytest.raises(DataError, match='has no chat template'):
    chat.encode(ours, CHATS['one turn'])
  with pytest.raises(DataError, match='need a Hugging Face tokenizer'):
    chat.encode(tokenizer.BYTES, CHATS['one turn'])
  with pytest.raises(DataError, match="loss_on='user'"):
    chat.encode(ours, CHATS['one turn'], template=CHATML, loss_on='user')
  with pytest.raises(DataError, match='neither template text nor a readable file'):
    chat.encode(ours, CHATS['one turn'], template=str(tmp_path / 'missing.jinja'))


def test_a_template_that_rewrites_assistant_content_needs_markers_or_loss_on_all(bpe, tmp_path):
  """Like Qwen3's, which drops the reasoning before `</think>` from the content it renders."""
  thinks = CHATML.replace("message.content if message.content else ''",
                          "message.content.split('</think>')[-1]")
  _, ours = save(bpe, tmp_path, thinks, **TEMPLATES['chatml'][1])
  reasoned = [{'role': 'user', 'content': 'Hi'},
              {'role': 'assistant', 'content': '<think>Greet.</think>Hello!'}]
  with pytest.raises(DataError, match='changes assistant content'):
    chat.encode(ours, reasoned)
  ids, weights = chat.encode(ours, reasoned, loss_on='all')
  assert weights.sum() == len(ids)
