"""Chat conversations -> token ids and loss weights, rendered by the tokenizer's own chat template.

`encode` renders a list of {'role', 'content'} messages as transformers 5 does (`apply_chat_template`: the
same jinja2 sandbox, extensions, globals and variables), so the ids are those the model was tuned on.
transformers is not imported: it is only the tests' reference.

Loss weights (`loss_on='assistant'`) come from the template where it marks the assistant's text with
`{% generation %}` (transformers' `return_assistant_tokens_mask`); otherwise each assistant message's rendered
content and the control token that ends its turn (`<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`, EOS, ...);
tool calls and reasoning need the markers. A token is weighted when its characters overlap a weighted span.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import functools
import json
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np

from mintrain.data.tokenizer import HFTokenizer, Tokenizer
from mintrain.errors import ConfigError, DataError

TEMPLATE_FILE = 'chat_template.jinja'  # Takes priority over tokenizer_config.json's `chat_template`.
LOSS_ON = ('assistant', 'all')
# The named special tokens a template sees (transformers' SPECIAL_TOKENS_ATTRIBUTES); any other
# tokenizer_config.json key ending in `_token` is one too.
SPECIAL_TOKENS = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token', 'mask_token')
_GENERATION_TAG = re.compile(r'\{%-?\s*generation\s*-?%\}')
_REASONING_FIELDS = ('reasoning_content', 'thinking', 'reasoning')
_MARK = 0xF0000  # Private-use characters that stand in for assistant content when locating it,
_SPACE, _OTHER_SPACE = '\u3000', '\u2003'  # and spaces that stand in for its spaces.


@dataclasses.dataclass
class _Render:
  """The output so far of one render, and the `{% generation %}` spans recorded in it."""
  length: int = 0
  spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)


_RENDER: contextvars.ContextVar[_Render | None] = contextvars.ContextVar('mintrain_chat_render', default=None)


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: records the character span of its output in the render."""

  tags = {'generation'}

  def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method('_record'), [], [], body).set_lineno(lineno)

  def _record(self, caller: Any) -> str:
    text = caller()
    if (render := _RENDER.get()) is not None:
      render.spans.append((render.length, render.length + len(text)))
    return text


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
  """jinja2's own `tojson` escapes HTML characters; templates expect plain JSON."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
  return datetime.datetime.now().strftime(format)


class _Dict:
  """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself (no attribute escapes)."""

  def __call__(self, *args, **kwargs) -> dict:
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs) -> dict:
    return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
  """jinja2's namespace, refusing underscore names (a way into CPython internals)."""

  def __init__(*args, **kwargs):
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name: str, value: Any):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name: Any):
    if isinstance(name, str) and name.startswith('_'):
      raise jinja2.exceptions.SecurityError(f'chat templates cannot set underscore attributes ({name!r}).')


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  """The template in transformers' environment: a sandbox (templates come from the Hub), trim_blocks,
  lstrip_blocks, loop controls, `{% generation %}` and its globals and `tojson`."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                     namespace=_Namespace)
  return env.from_string(template)


@contextlib.contextmanager
def _recording() -> Iterator[_Render]:
  render = _Render()
  token = _RENDER.set(render)
  try:
    yield render
  finally:
    _RENDER.reset(token)


def _render(template: jinja2.Template, variables: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
  """The rendered text and its `{% generation %}` spans (chunk by chunk, so a span knows where it starts)."""
  chunks = []
  with _recording() as render:
    for chunk in template.generate(**variables):
      chunks.append(chunk)
      render.length += len(chunk)
  return ''.join(chunks), render.spans


def _config(tok: HFTokenizer) -> dict[str, Any]:
  return json.loads(tok.files.get('tokenizer_config.json', b'{}'))


def _template(tok: Tokenizer, template: str | os.PathLike | None, tools: list | None) -> str:
  """The template text: `template` (a name among the tokenizer's templates, template text or a file), else
  the tokenizer's chat_template.jinja, else its tokenizer_config.json's (the 'tool_use' one given tools)."""
  where = getattr(tok, 'name', 'byte')
  named: dict[str, str] = {}
  if isinstance(tok, HFTokenizer):
    if TEMPLATE_FILE in tok.files:
      named = {'default': tok.files[TEMPLATE_FILE].decode('utf-8')}
    else:
      stored = _config(tok).get('chat_template')
      if isinstance(stored, str):
        named = {'default': stored}
      elif isinstance(stored, list):
        named = {t['name']: t['template'] for t in stored}
  if template is not None:
    text = os.fspath(template)
    if text in named:
      return named[text]
    if '{{' in text or '{%' in text:
      return text
    try:
      with open(os.path.expanduser(text), encoding='utf-8') as f:
        return f.read()
    except OSError as e:
      raise DataError(f'chat template {text!r} is neither template text nor a readable file '
                      f'({e.strerror}).') from None
  if not named:
    raise DataError(f'tokenizer {where!r} has no chat template (no {TEMPLATE_FILE}, no chat_template in '
                    'tokenizer_config.json); pass template= a template or its file.')
  if tools is not None and 'tool_use' in named:
    return named['tool_use']
  if 'default' not in named:
    raise DataError(f'tokenizer {where!r} has chat templates {sorted(named)} and none is "default"; pass '
                    'template= one of those names.')
  return named['default']


def run_template(tok: Tokenizer, template_file: str) -> str | None:
  """The template a run renders its chats with (`data.format='chat'`): `data.chat_template`'s file, read once,
  or None for the tokenizer's own (chosen per chat, as transformers does); a one-line ConfigError where the
  tokenizer cannot render chats."""
  name = getattr(tok, 'name', 'byte')
  if not isinstance(tok, HFTokenizer):
    raise ConfigError(f"data.format='chat' needs a Hugging Face tokenizer (a tokenizer.json directory) to "
                      f'render chats; data.tokenizer={name!r} is not one.')
  if template_file:
    try:
      with open(os.path.expanduser(template_file), encoding='utf-8') as f:
        return f.read()
    except OSError as e:
      raise ConfigError(f'data.chat_template={template_file!r} cannot be read ({e.strerror}).') from None
  try:
    _template(tok, None, None)
  except DataError as e:
    raise ConfigError(f"data.format='chat': {str(e).split('; pass template=')[0]}; set data.chat_template to "
                      'a template file.') from None
  return None


def _content(token: Any) -> str | None:
  return token.get('content') if isinstance(token, dict) else token


def special_tokens(tok: Tokenizer) -> dict[str, str]:
  """The special tokens a template sees by name (`bos_token`, `eos_token`, ...), as transformers reads them
  from tokenizer_config.json (or a legacy special_tokens_map.json)."""
  if not isinstance(tok, HFTokenizer):
    return {}
  config = _config(tok)
  if 'added_tokens_decoder' not in config and 'special_tokens_map.json' in tok.files:
    config = {**config, **json.loads(tok.files['special_tokens_map.json'])}
  named = {key: _content(value) for key, value in config.items()
           if key in SPECIAL_TOKENS or (key.endswith('_token') and isinstance(value, (str, dict)))}
  extra = config.get('extra_special_tokens')
  if isinstance(extra, dict):
    named.update({key: _content(value) for key, value in extra.items()})
  return {key: value for key, value in named.items() if isinstance(value, str)}


def _control_tokens(tok: HFTokenizer, template: str) -> list[str]:
  """Added tokens that structure a chat: the special ones and those written in the template (not whitespace);
  longest first, so a token wins over the tokens it contains."""
  ast = _compile(template).environment.parse(template)
  literals = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
  literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
  text = '\0'.join(literals)
  added = tok.tokenizer.get_added_tokens_decoder().values()
  tokens = {t.content for t in added if t.special or (t.content in text and not t.content.isspace())}
  return sorted(tokens, key=len, reverse=True)


def _plain(value: Any, where: str) -> Any:
  """A copy of `value` made of JSON types, so the template can neither change the caller's data nor reach
  methods of other objects."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, np.generic):
    return _plain(value.item(), where)
  if isinstance(value, dict):
    return {str(k): _plain(v, f'{where}[{k!r}]') for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v, f'{where}[{i}]') for i, v in enumerate(value)]
  for kind in (str, int, float):  # Subclasses (enums, ...) lose their extra methods.
    if isinstance(value, kind):
      return kind(value)
  raise DataError(f'{where} is a {type(value).__name__}; chat data holds only JSON values.')


def _messages(messages: Sequence[dict]) -> list[dict]:
  """Checked plain copies of the messages, as transformers passes them: keys whose value is None dropped,
  reasoning also under `reasoning_content` and `thinking`."""
  if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
    raise DataError(f'a chat is a non-empty list of messages, got {type(messages).__name__} '
                    f'{str(messages)[:80]!r}.')
  out = []
  for i, message in enumerate(messages):
    if not isinstance(message, dict):
      raise DataError(f'message {i} is a {type(message).__name__}, not a dict with "role" and "content".')
    message = {k: v for k, v in _plain(message, f'message {i}').items() if v is not None}
    if not isinstance(message.get('role'), str) or not message['role']:
      raise DataError(f'message {i} has no "role" (keys: {sorted(message)}).')
    content = message.get('content')
    if not isinstance(content, str) and not (content is None and 'tool_calls' in message):
      raise DataError(f'message {i} ({message["role"]}): "content" must be a string, got '
                      f'{type(content).__name__} {str(content)[:60]!r}.')
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {'thinking': reasoning, **message, 'reasoning_content': reasoning}
    out.append(message)
  return out


def _one_line(text: str) -> str:
  return ' '.join(str(text).split())


def render(tok: Tokenizer, messages: Sequence[dict], *, tools: list[dict] | None = None,
           template: str | os.PathLike | None = None,
           add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
  """The chat as text, exactly as transformers' `apply_chat_template(..., tokenize=False)`, and the character
  spans the template marks with `{% generation %}`; `add_generation_prompt` opens the assistant's turn (a
  prompt to generate from, as lm-eval's chat tasks ask)."""
  text, spans, _ = _render_checked(tok, _messages(messages), _tools(tools), template, add_generation_prompt)
  return text, spans


def _variables(tok: Tokenizer, messages: list[dict], tools: list[dict] | None,
               add_generation_prompt: bool = False) -> dict[str, Any]:
  """What apply_chat_template gives a template: the named special tokens, then the chat."""
  return {**special_tokens(tok), 'messages': messages, 'tools': tools, 'documents': None,
          'add_generation_prompt': add_generation_prompt}


def _render_checked(tok: Tokenizer, messages: list[dict], tools: list[dict] | None,
                    template: str | os.PathLike | None,
                    add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]], str]:
  """`render` of checked messages and tools, and the template's source."""
  source = _template(tok, template, tools)
  roles = [m['role'] for m in messages]
  try:
    text, spans = _render(_compile(source), _variables(tok, messages, tools, add_generation_prompt))
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise DataError(f'the chat template does not parse (line {e.lineno}: {_one_line(e.message)}).') from None
  except jinja2.exceptions.TemplateError as e:  # Its raise_exception, or an undefined name.
    raise DataError(f'the chat template refuses the chat (roles {roles}): {_one_line(e)}') from None
  except Exception as e:  # The template is foreign code; what it trips on is in the chat.
    raise DataError(f'the chat template fails on the chat (roles {roles}): {type(e).__name__}: '
                    f'{_one_line(e)}') from None
  return text, spans, source


def _tools(tools: Any) -> list[dict] | None:
  if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
    raise DataError(f'tools must be a list of JSON schemas (dicts), got {str(tools)[:80]!r}.')
  return _plain(tools, 'tools')


def _disguise(content: str, mark: str) -> str:
  """`content` with every character changed: non-space ones to `mark`, spaces to other spaces (so `trim` and
  `strip` treat both alike)."""
  return ''.join((_SPACE if c != _SPACE else _OTHER_SPACE) if c.isspace() else mark for c in content)


def _assistant_spans(tok: HFTokenizer, messages: list[dict], tools: list[dict] | None, source: str,
                     text: str) -> list[tuple[int, int]]:
  """Where each assistant message's content, and the control token ending its turn, lie in `text`.

  The chat is rendered again with each assistant content disguised (`_disguise`, one mark per message): the
  same length wherever the template only copies or trims content, and differing exactly on the content."""
  disguised, marks = [], {}
  for message in messages:
    if message['role'] == 'assistant' and isinstance(message.get('content'), str):
      mark = chr(_MARK + len(marks))
      marks[mark] = len(marks)
      message = {**message, 'content': _disguise(message['content'], mark)}
    disguised.append(message)
  if not marks:
    return []
  other, _ = _render(_compile(source), _variables(tok, disguised, tools))
  refused = DataError("the chat template changes assistant content as it renders it, so its tokens cannot be "
                      "found; use a template with {% generation %} markers, or loss_on='all'.")
  if len(other) != len(text):
    raise refused
  controls = _control_tokens(tok, source)
  ends = re.compile('[ \t]*(?:' + '|'.join(map(re.escape, controls)) + ')') if controls else None
  spans, cuts, seen = [], [], set()
  for run in re.finditer('(?:' + '|'.join(map(re.escape, marks)) + r'|\s)+', other):
    start, stop = run.span()
    while start < stop and text[start] == other[start]:  # Template whitespace before and after the content.
      start += 1
    while stop > start and text[stop - 1] == other[stop - 1]:
      stop -= 1
    found = {marks[c] for c in other[start:stop] if c in marks}
    cuts.append((start, stop))
    if not found:
      continue  # Content of only spaces: nothing to weigh.
    if len(found) > 1 or found & seen or any(a == b for a, b in zip(text[start:stop], other[start:stop])):
      raise refused  # Content twice, contents joined, or template text inside content.
    seen |= found
    end = ends.match(text, stop) if ends else None
    spans.append((start, end.end() if end else stop))
  if _cut(text, cuts) != _cut(other, cuts):
    raise refused  # The render differs outside the content.
  return spans


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
  """`text` without the spans."""
  edges = [0] + [i for span in spans for i in span] + [len(text)]
  return ''.join(text[a:b] for a, b in zip(edges[::2], edges[1::2]))


def _weights(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
  """1.0 on each token whose characters overlap a span (transformers' assistant mask); spans are in order."""
  weights = np.zeros(len(offsets), np.float32)
  k = 0
  for i, (start, stop) in enumerate(offsets):
    while k < len(spans) and start >= spans[k][1]:
      k += 1
    if k == len(spans):
      break
    if stop > spans[k][0]:
      weights[i] = 1.0
  return weights


def encode(tok: Tokenizer, messages: Sequence[dict], *, tools: list[dict] | None = None,
           template: str | os.PathLike | None = None,
           loss_on: str = 'assistant') -> tuple[np.ndarray, np.ndarray]:
  """int32 ids of the rendered chat (as `apply_chat_template(messages, tokenize=True)`) and float32 weights:
  1.0 on what the model should learn to write (`loss_on='assistant'`), or on every token ('all')."""
  if loss_on not in LOSS_ON:
    raise DataError(f'loss_on={loss_on!r}; use one of {list(LOSS_ON)}.')
  if not isinstance(tok, HFTokenizer):
    raise DataError(f'tokenizer {getattr(tok, "name", tok)!r} has no chat template: chats need a Hugging '
                    'Face tokenizer (a tokenizer.json directory).')
  plain, tools = _messages(messages), _tools(tools)
  text, spans, source = _render_checked(tok, plain, tools, template)
  encoding = tok.tokenizer.encode(text, add_special_tokens=False)
  ids = np.asarray(encoding.ids, np.int32)
  if loss_on == 'all':
    return ids, np.ones(len(ids), np.float32)
  if not _GENERATION_TAG.search(source):
    for i, message in enumerate(plain):
      extra = [k for k in ('tool_calls', *_REASONING_FIELDS) if k in message]
      if message['role'] == 'assistant' and extra:
        raise DataError(f'message {i} (assistant) has {extra[0]}, which only a chat template with '
                        "{% generation %} markers can weigh; use one, or loss_on='all'.")
    spans = _assistant_spans(tok, plain, tools, source, text)
  return ids, _weights(encoding.offsets, spans)
