"""The shipped configs: `base.py` holds every default with its meaning; the others override it."""

import ast
import io
import pathlib
import tokenize

DIR = pathlib.Path(__file__).resolve().parent


def path(name: str) -> pathlib.Path:
  """The shipped config `name` (e.g. 'dp4_tp2')."""
  return DIR / f'{name}.py'


def comments() -> dict[str, str]:
  """{'section.key': its meaning}: the comment lines right above each `c.section.key = ...` in base.py
  and the comment at the end of its line, so `--show_config` and the docs' reference say what base.py
  says."""
  source = path('base').read_text()
  on_line: dict[int, str] = {}
  whole_lines: set[int] = set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      on_line[token.start[0]] = token.string.lstrip('#').strip()
      if not token.line[:token.start[1]].strip():
        whole_lines.add(token.start[0])
  out, previous = {}, (None, '')
  for node in sorted(ast.walk(ast.parse(source)), key=lambda n: getattr(n, 'lineno', 0)):
    if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)):
      continue
    names, target = [], node.targets[0]
    while isinstance(target, ast.Attribute):
      names.insert(0, target.attr)
      target = target.value
    if not (isinstance(target, ast.Name) and target.id == 'c'):
      continue
    above, line = [], node.lineno - 1
    while line in whole_lines:
      above.insert(0, on_line[line])
      line -= 1
    text = ' '.join(above + ([on_line[node.lineno]] if node.lineno not in whole_lines and
                             node.lineno in on_line else []))
    if not text and previous[0] == node.lineno - 1:  # One comment above a group of lines.
      text = previous[1]
    out['.'.join(names)], previous = text, (node.end_lineno, text)
  return out
