"""Heavy libraries imported on first use (Python's `importlib.util.LazyLoader` recipe), so that start-up
does not pay for what a run may never touch: Orbax without a workdir, Grain on synthetic data."""

from __future__ import annotations

import importlib.util
import sys
import types


def lazy_import(name: str) -> types.ModuleType:
  """Module `name`, executed when one of its attributes is first read. Finding a submodule
  ('package.module') imports its package, so only that package's own import is deferred."""
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.find_spec(name)
  if spec is None:
    raise ModuleNotFoundError(f'No module named {name!r}', name=name)
  loader = importlib.util.LazyLoader(spec.loader)
  spec.loader = loader
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  loader.exec_module(module)
  return module
