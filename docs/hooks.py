"""MkDocs hook: the config reference page, generated from mintrain/configs/base.py at every build, so it
lists every key with its default and the comment base.py gives it."""

from __future__ import annotations

import pathlib
import sys

from mkdocs.structure.files import File

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # The checkout's mintrain.


def reference() -> str:
  from mintrain import configs
  from mintrain.config import defaults

  meanings = configs.comments()
  lines = ['# Config keys', '',
           'Every option of `mintrain/configs/base.py`, with its default and meaning (generated from the '
           'file at each build). Override any of them with `--config.section.key=value`; '
           '`scripts/train.py --config C --show_config` prints a config\'s values.', '']

  def walk(tree, prefix: str, level: int) -> None:
    for key, value in tree.items():
      name = f'{prefix}{key}'
      if hasattr(value, 'items') and value and not isinstance(value, (list, tuple)):
        lines.extend([f'{"#" * level} `{name}`', '', meanings.get(name, ''), ''] if meanings.get(name)
                     else [f'{"#" * level} `{name}`', ''])
        lines.extend(['| key | default | meaning |', '|---|---|---|'])
        leaves = {k: v for k, v in value.items() if not (hasattr(v, 'items') and v)}
        for leaf, default in leaves.items():
          text = meanings.get(f'{name}.{leaf}', '').replace('|', '\\|')
          shown = repr(default).replace('|', '\\|')
          lines.append(f'| `{name}.{leaf}` | `{shown}` | {text} |')
        lines.append('')
        walk({k: v for k, v in value.items() if k not in leaves}, f'{name}.', level + 1)
      elif not prefix:
        lines.extend([f'`{name}` = `{value!r}`: {meanings.get(name, "")}', ''])

  walk(defaults().to_dict(), '', 2)
  return '\n'.join(lines)


def on_files(files, config):
  files.append(File.generated(config, 'reference/config.md', content=reference()))
  return files
