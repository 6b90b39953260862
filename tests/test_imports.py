"""The import graph of mintrain/ and what importing it leaves behind.

Layers import downwards only (no cycle, counting imports inside functions too), the light layers (metrics,
the data pipeline, the mesh) load no model or optimizer code, and importing any module changes no
process-wide state: `sys.modules`, `sys.path`, import hooks, warning filters or the loggers' filters
and handlers; nor do a run's metric writers and console once closed.
"""

import ast
import pathlib

import pytest
from helpers import REPO, run_script

PACKAGE = REPO / 'mintrain'


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob('*.py'))}


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
  """The modules an import statement names (`from a import b` names a.b where a.b is a module)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  package = module if MODULES[module].name == '__init__.py' else module.rpartition('.')[0]
  if node.level:
    package = '.'.join(package.split('.')[:len(package.split('.')) - node.level + 1] + [node.module or ''])
  base = (package if node.level else node.module).strip('.')
  return [f'{base}.{a.name}' if f'{base}.{a.name}' in MODULES else base for a in node.names]


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
  """mintrain module -> the mintrain modules it imports when it is imported, and -> those it imports
  later (inside functions). Imports for type checkers alone (annotations) are in neither."""
  eager: dict[str, set[str]] = {m: set() for m in MODULES}
  deferred: dict[str, set[str]] = {m: set() for m in MODULES}

  def visit(module: str, node: ast.AST, later: bool) -> None:
    for child in ast.iter_child_nodes(node):
      type_checking = isinstance(child, ast.If) and 'TYPE_CHECKING' in ast.unparse(child.test)
      if type_checking:
        continue
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        names = {n for n in imported(module, child) if n.split('.')[0] == 'mintrain'}
        (deferred if later else eager)[module].update(names)
      function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
      visit(module, child, later or function)

  for module, path in MODULES.items():
    visit(module, ast.parse(path.read_text()), False)
  return eager, deferred


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One cycle of `graph` as the list of its modules (the first repeated at the end), or []."""
  state: dict[str, str] = {}
  stack: list[str] = []

  def walk(node: str) -> list[str]:
    state[node] = 'open'
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 'open':
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (cycle := walk(nxt)):
        return cycle
    state[node] = 'done'
    stack.pop()
    return []

  for node in sorted(graph):
    if node not in state and (cycle := walk(node)):
      return cycle
  return []


def test_the_graph_reader_sees_the_imports_of_a_known_module():
  eager, deferred = import_graph()
  assert {'mintrain.errors', 'mintrain.runtime.storage'} <= eager['mintrain.metric_writers']
  assert 'mintrain.hf' in deferred['mintrain.loop'] and 'mintrain.hf' not in eager['mintrain.loop']


def test_no_module_imports_itself_through_others():
  eager, _ = import_graph()
  assert not (cycle := find_cycle(eager)), 'import cycle: ' + ' -> '.join(cycle)


def test_no_cycle_either_when_imports_inside_functions_count():
  eager, deferred = import_graph()
  both = {m: eager[m] | deferred[m] for m in MODULES}
  assert not (cycle := find_cycle(both)), 'import cycle through a deferred import: ' + ' -> '.join(cycle)


@pytest.mark.parametrize('module', ['mintrain.metrics', 'mintrain.metric_writers', 'mintrain.data',
                                    'mintrain.data.sources', 'mintrain.data.streaming',
                                    'mintrain.data.pipeline', 'mintrain.mesh'])
def test_light_layers_load_no_model_or_optimizer_code(module):
  code = (f'import sys, {module}; print(sorted(m for m in sys.modules '
          "if m.startswith('mintrain.models') or m.split('.')[0] == 'optax' or m == 'flax.nnx'))")
  result = run_script('-c', code)
  assert result.returncode == 0 and result.stdout.strip() == '[]', result.stdout + result.stderr


GLOBAL_STATE = '''
import ast, importlib, logging, pathlib, sys, tempfile, warnings

def snapshot():
  named = [logging.getLogger(name) for name in ('', 'absl', 'asyncio', 'jax', 'mintrain')]
  loggers = {g.name: (list(g.filters), list(g.handlers), g.level, g.propagate) for g in named}
  return {'sys.modules None entries': sorted(k for k, v in sys.modules.items() if v is None),
          'sys.path': list(sys.path), 'sys.meta_path': list(sys.meta_path),
          'sys.path_hooks': list(sys.path_hooks),
          'warnings.filters': list(warnings.filters), 'loggers': loggers}

modules = sys.argv[1:]
third_party = set()
for path in pathlib.Path('mintrain').rglob('*.py'):
  body = ast.parse(path.read_text()).body  # Module level, and in its try blocks (an optional extra's guard).
  for node in body + [n for t in body if isinstance(t, ast.Try) for n in t.body]:
    if isinstance(node, ast.Import):
      third_party.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      third_party.add(node.module)
for name in sorted(n for n in third_party if n.split('.')[0] not in ('mintrain', '__future__')):
  importlib.import_module(name)  # What they do to the process is theirs, not mintrain's.
def compare(before, after, doing):
  for key in before:
    if before[key] != after[key]:
      print(f'{doing} changed {key}: {before[key]} -> {after[key]}')

before = snapshot()
for name in modules:
  importlib.import_module(name)
compare(before, snapshot(), 'importing mintrain')

def run_writers():  # What a run constructs of its metrics and console, and closes.
  from mintrain import metric_writers, metrics
  with tempfile.TemporaryDirectory() as workdir, metrics.console_logging(print):
    metric_writers.make_writer(workdir, is_main=True, total_steps=1).close()

run_writers()  # Once for the libraries it imports on first use.
before = snapshot()
run_writers()
compare(before, snapshot(), "a run's writers")
'''


def test_importing_every_module_and_making_a_runs_writers_changes_no_process_wide_state():
  result = run_script('-c', GLOBAL_STATE, *sorted(MODULES))
  assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr

