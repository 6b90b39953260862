"""Where a compiled step's time goes by what each op computes, for any JAX program: matmuls (with their
FLOP/s), collectives by kind, copies and transposes, dtype converts, fusions with and without a reduction,
the rest.

`benchmarks/breakdown.py` groups mintrain's ops by the mintrain function that made them; this groups by the
op itself, so that two frameworks' steps (`peers.py --profile`) compare row by row. Inputs: the step's
optimised HLO text (`Compiled.as_text()`, or XLA's `--xla_dump_hlo_as_text` file) and a profiler trace
(`*.xplane.pb`, as `jax.profiler.start_trace` writes it) of one or more steps. Times are per device (summed
over devices, divided by their number) and per step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pathlib
import re

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
CONTAINERS = ('while', 'call', 'conditional')  # Their time is that of the ops inside, which are counted.
LAYOUT = ('copy', 'transpose', 'bitcast', 'parameter', 'tuple', 'get-tuple-element', 'constant', 'broadcast')
INDEXING = ('gather', 'scatter', 'dynamic-slice', 'dynamic-update-slice')
MATMUL = 'matmul (dot fusions)'
COMPUTATION = re.compile(r'^(?:ENTRY )?%([\w.-]+) \(')
INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.-]+) = (.*?) ([a-z][a-z-]*)\((.*)$')
DIMS = re.compile(r'^\(?[a-z]\w*\[([0-9,]*)\]')


@dataclasses.dataclass(frozen=True)
class Op:
  opcode: str
  row: str  # The row of the table its time goes to.
  backward: bool  # XLA names the backward pass's ops transpose(jvp(...)).
  gflop: float  # Of its matmuls, per execution.


def _dims(shape: str) -> list[int]:
  match = DIMS.match(shape.strip())
  return [int(d) for d in match.group(1).split(',') if d] if match else []


def _dot_gflop(rest: str, result: str, shapes: dict[str, str]) -> float:
  """2 x result elements x contracted size, the contracted dims read off the left operand's shape."""
  lhs = re.match(r'\s*(?:[a-z]\w*\[[0-9,]*\]\S* )?%([\w.-]+)', rest)
  contracting = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}', rest)
  if not lhs or not contracting or lhs.group(1) not in shapes:
    return 0.0
  lhs_dims = _dims(shapes[lhs.group(1)])
  contracted = math.prod(lhs_dims[int(c)] for c in contracting.group(1).split(',') if c)
  return 2 * math.prod(_dims(result)) * contracted / 1e9


def computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
  """Computation name -> its instructions as (op name, result shape, opcode, the rest of the line)."""
  found = collections.defaultdict(list)
  current = None
  for line in hlo.splitlines():
    if match := COMPUTATION.match(line):
      current = match.group(1)
    elif line.startswith('}'):
      current = None
    elif current and (match := INSTRUCTION.match(line)):
      found[current].append(match.groups())
  return found


def program(hlo: str) -> tuple[str, dict[str, Op]]:
  """(the module's name, HLO op name -> Op) for every op of an optimised HLO module."""
  module = re.match(r'HloModule ([\w.-]+)', hlo).group(1)
  parsed = computations(hlo)

  def contents(name: str, seen: frozenset = frozenset()) -> tuple[set[str], float]:
    """The opcodes of a fused computation (nested fusions opened) and its dots' GFLOP."""
    opcodes, gflop = set(), 0.0
    shapes = {op: result for op, result, _, _ in parsed[name]}
    for _, result, opcode, rest in parsed[name]:
      called = re.search(r'calls=%([\w.-]+)', rest)
      if opcode == 'fusion' and called and called.group(1) not in seen:
        inner, inner_gflop = contents(called.group(1), seen | {name})
        opcodes |= inner
        gflop += inner_gflop
      else:
        opcodes.add(opcode)
        gflop += _dot_gflop(rest, result, shapes) if opcode == 'dot' else 0.0
    return opcodes, gflop

  ops = {}
  for computation in parsed.values():
    shapes = {op: result for op, result, _, _ in computation}
    for name, result, opcode, rest in computation:
      called = re.search(r'calls=%([\w.-]+)', rest)
      inside, gflop = contents(called.group(1)) if opcode == 'fusion' and called else ({opcode}, 0.0)
      if opcode == 'dot':
        gflop = _dot_gflop(rest, result, shapes)
      if opcode in COLLECTIVES:
        row = f'{opcode} (collective)'
      elif inside & {'dot', 'convolution'}:
        row = MATMUL
      elif inside <= set(LAYOUT):
        row = 'copy, transpose, broadcast'
      elif inside <= {*LAYOUT, 'convert'}:
        row = 'dtype converts'
      elif inside & set(INDEXING):
        row = 'gather, scatter, dynamic slices'
      elif 'reduce' in inside:
        row = 'fusions with a reduction (softmax, norms, sums)'
      elif opcode == 'fusion':
        row = 'elementwise fusions'
      else:
        row = f'other ops: {opcode}'
      op_name = re.search(r'op_name="([^"]*)"', rest)
      ops[name] = Op(opcode, row, bool(op_name and 'transpose(' in op_name.group(1)), gflop)
  return module, ops


def xplane_events(path: pathlib.Path, module: str) -> list[tuple[str, str, int, float]]:
  """(HLO op name, event name, device, seconds) of every op of `module` the trace holds. An accelerator's
  trace also names the ops in the host's launch events: only its device planes' kernels count then."""
  import jax

  profile = jax.profiler.ProfileData.from_file(str(path))
  planes = list(profile.planes)
  on_devices = [p for p in planes if p.name.startswith(('/device:GPU', '/device:TPU'))]
  events = []
  for plane in on_devices or planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if stats.get('hlo_module') == module and 'hlo_op' in stats:
          events.append((stats['hlo_op'], event.name, int(stats.get('device_ordinal', 0)),
                         event.duration_ns / 1e9))
  return events


# A GPU step replayed as a command buffer (a CUDA graph) names the buffer, not the op, in each kernel's
# `hlo_op`. XLA's own kernels are named after their fusion ('loop_add_fusion_2' for %loop_add_fusion.2);
# a library's are not, and go to a row by what their names say they compute (not split by pass).
LIBRARY_KERNELS = (('library matmuls (cuBLAS)', ('nvjet', 'gemm', 'xmma', 'cutlass')),
                   ('attention (cuDNN)', ('sdpa', 'fmha', 'cudnn')))


def _kernel_op(event: str, kernels: dict[str, str], ops: dict[str, Op]) -> tuple[str, Op] | None:
  """(op name, Op) of a kernel named `event`: its fusion's, or a library kernel's own."""
  if event in kernels:
    return kernels[event], ops[kernels[event]]
  for row, marks in LIBRARY_KERNELS:
    if any(mark in event.lower() for mark in marks):
      return event, Op('custom-call', row, 'bprop' in event or 'dgrad' in event or 'wgrad' in event, 0.0)
  return None


@dataclasses.dataclass
class Breakdown:
  """One traced program's time by row and by op, per device and step."""
  ops: dict[str, Op]
  op_ms: collections.Counter  # HLO op name -> ms.
  op_runs: collections.Counter  # HLO op name -> executions.
  unmatched_ms: float  # Events naming no op of the program (there should be none).
  forward_ms: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # By row.
  backward_ms: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  matmul_gflop: float = 0.0  # From the traced dot fusions' shapes.

  def __post_init__(self):
    for name, ms in self.op_ms.items():
      op = self.ops[name]
      (self.backward_ms if op.backward else self.forward_ms)[op.row] += ms
      self.matmul_gflop += op.gflop * self.op_runs[name]

  @property
  def total_ms(self) -> float:
    return sum(self.forward_ms.values()) + sum(self.backward_ms.values())

  def ms(self, row: str) -> float:
    return self.forward_ms[row] + self.backward_ms[row]

  def longest(self, count: int = 40) -> list[list[str]]:
    """The `count` ops that took longest: name, row, pass, runs, ms, matmul GFLOP/s."""
    table = []
    for name, ms in self.op_ms.most_common(count):
      op = self.ops[name]
      rate = f'{op.gflop * self.op_runs[name] / ms * 1e3:.1f}' if op.gflop else ''
      table.append([name, op.row, 'backward' if op.backward else 'forward', f'{self.op_runs[name]:g}',
                    f'{ms:.2f}', rate])
    return table


def breakdown(hlo: str, trace: pathlib.Path, steps: int = 1) -> Breakdown:
  """The ops of `hlo` in the trace, per device and step."""
  module, ops = program(hlo)
  kernels = {name.replace('.', '_'): name for name in ops}
  events = xplane_events(trace, module)
  per = 1 / max(len({device for _, _, device, _ in events}), 1) / steps
  op_ms, op_runs, unmatched = collections.Counter(), collections.Counter(), 0.0
  for name, event, _, seconds in events:
    if name not in ops and (found := _kernel_op(event, kernels, ops)) is not None:
      name, op = found
      ops.setdefault(name, op)
    op = ops.get(name)
    if op is None:
      unmatched += seconds * 1e3 * per
    elif op.opcode not in CONTAINERS:
      op_ms[name] += seconds * 1e3 * per
      op_runs[name] += per
  return Breakdown(ops, op_ms, op_runs, unmatched)


def newest_trace(directory: pathlib.Path) -> pathlib.Path:
  found = sorted(directory.rglob('*.xplane.pb'), key=lambda p: p.stat().st_mtime)
  if not found:
    raise FileNotFoundError(f'no *.xplane.pb under {directory}')
  return found[-1]


def rows(named: dict[str, Breakdown]) -> tuple[list[str], list[list[str]]]:
  """A table with one ms and one share column per breakdown, rows by the largest total first."""
  every = sorted({row for b in named.values() for row in (*b.forward_ms, *b.backward_ms)},
                 key=lambda row: -sum(b.ms(row) for b in named.values()))
  header = ['part'] + [f'{name} {what}' for name in named for what in ('ms', 'share')]
  table = []
  for row in every:
    cells = [row]
    for b in named.values():
      cells += [f'{b.ms(row):.1f}', f'{b.ms(row) / b.total_ms:.1%}' if b.total_ms else '-']
    table.append(cells)
  table.append(['all ops'] + [cell for b in named.values() for cell in (f'{b.total_ms:.1f}', '100%')])
  rate = ['matmul GFLOP/s (per device)']
  for b in named.values():
    ms = b.ms(MATMUL)
    rate += [f'{b.matmul_gflop / ms * 1e3:.1f}' if ms else '-', f'{b.matmul_gflop:.3g} GFLOP']
  table.append(rate)
  return header, table


@dataclasses.dataclass(frozen=True)
class Dot:
  """One `dot` of an optimised HLO module, its operands in their physical (row-major) order."""
  lhs: tuple[int, ...]
  rhs: tuple[int, ...]
  dimension_numbers: tuple  # As `jax.lax.dot_general` takes them, on `lhs` and `rhs` as laid out here.
  gflop: float


def _physical(shape: str) -> tuple[tuple[int, ...], dict[int, int]]:
  """(the dims of `shape` in memory order, major first; logical dim -> position there)."""
  dims = _dims(shape)
  layout = re.search(r'\]\{([0-9,]*)', shape)
  minor_to_major = [int(d) for d in layout.group(1).split(',')] if layout else list(range(len(dims)))[::-1]
  order = minor_to_major[::-1]
  return tuple(dims[d] for d in order), {d: i for i, d in enumerate(order)}


def dots(hlo: str) -> list[Dot]:
  """Every `dot` of an optimised HLO module (fused ones included), once per appearance; a dot inside a loop
  runs more than once, so a module with one is refused (scanned layers: use unrolled ones)."""
  found, calls, loops = {}, collections.defaultdict(set), set()
  for computation, instructions in computations(hlo).items():
    shapes = {name: result for name, result, _, _ in instructions}
    for _, result, opcode, rest in instructions:
      calls[computation] |= set(re.findall(r'(?:calls|to_apply|body|condition)=%([\w.-]+)', rest))
      if opcode == 'while':
        loops |= set(re.findall(r'(?:body|condition)=%([\w.-]+)', rest))
      if opcode != 'dot':
        continue
      lhs_name, rhs_name = re.findall(r'%([\w.-]+)', rest.split(')')[0])[:2]
      (lhs, lhs_at), (rhs, rhs_at) = _physical(shapes[lhs_name]), _physical(shapes[rhs_name])
      given = {key: tuple(int(d) for d in value.split(',') if d)
               for key, value in re.findall(r'(\w+_dims)=\{([0-9,]*)\}', rest)}
      lhs_c, rhs_c, lhs_b, rhs_b = (given.get(f'{side}_{kind}_dims', ()) for kind in ('contracting', 'batch')
                                    for side in ('lhs', 'rhs'))
      numbers = ((tuple(lhs_at[d] for d in lhs_c), tuple(rhs_at[d] for d in rhs_c)),
                 (tuple(lhs_at[d] for d in lhs_b), tuple(rhs_at[d] for d in rhs_b)))
      found.setdefault(computation, []).append(Dot(lhs, rhs, numbers, _dot_gflop(rest, result, shapes)))
  inside, todo = set(), list(loops)
  while todo:
    if (name := todo.pop()) not in inside:
      inside.add(name)
      todo.extend(calls[name])
  if inside & set(found):
    raise ValueError('a dot of the module runs in a loop, more than once a step: use unrolled layers')
  return [d for computation in found.values() for d in computation]
