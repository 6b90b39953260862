"""The shipped configs: `base.py` holds every default with its meaning; the others override it."""

import pathlib

DIR = pathlib.Path(__file__).resolve().parent


def path(name: str) -> pathlib.Path:
  """The shipped config `name` (e.g. 'dp4_tp2')."""
  return DIR / f'{name}.py'
