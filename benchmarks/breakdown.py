#!/usr/bin/env python
"""Where a train step's time goes: XLA's own per-op times of one profiled step, by the code that made each op.

One step runs under `jax.profiler` (a Perfetto trace, nothing to install). Each op the XLA runtime executed
is an event with its HLO name and device; the compiled HLO names the Python stack that produced it. Ops are
grouped by the innermost mintrain function on that stack (`Transformer._logits`, `GatedMLP.__call__`,
`cross_entropy`, ...), optimizer ops as `optimizer (optax)`, and collectives by their kind, split into
forward and backward (XLA names backward ops `transpose(jvp(...))`). Times are per device: summed over
devices, divided by their number.

Collective times include waiting for the slowest device. On simulated CPU devices, which share the host's
cores, every op is also slowed by the other devices' ops running at the same time, so shares are the
useful figure, not absolute times.

  python benchmarks/breakdown.py                            # mintrain/configs/bench_tiny.py
  python benchmarks/breakdown.py --override model.vocab_size=384 --override model.attention=dot_product
  python benchmarks/breakdown.py --smoke                    # a tiny model: checks that it still runs
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile
import time

import harness
import jax
from op_profile import COLLECTIVES, CONTAINERS

HELPERS = ('gather', 'AxisRules.reshard', 'matmul')  # Their time goes to the layer that calls them.
# `models.layers.linear` is a custom VJP; JAX traces its rules once per shape and reuses them, so
# their stacks name whichever layer came first. Its matmuls form one row instead.
LINEAR = ('linear', '_linear', '_linear_fwd', '_linear_bwd')
LINEAR_ROW, OTHER = 'linear (weight matmuls, all layers)', 'other (compiler-made, no source)'
EINSUM = re.compile(r'\((\w+(?:,\w+)+->\w*)\)')  # In an op's name: jvp(BLD,DF->BLF), its innermost last.
INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.-]+) = .*? ([a-z][a-z-]*)\(.*?metadata=\{([^}]*)\}')


def source_tables(hlo: str) -> dict[int, list[tuple[str, str]]]:
  """stack_frame_id -> [(file, function), ...] innermost first, from the module's stack frame tables."""
  section, tables = None, collections.defaultdict(dict)
  for line in hlo.splitlines():
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      section = line
      continue
    if not line or not line[0].isdigit():
      section = None if not line or line.startswith(('HloModule', '%', 'ENTRY')) else section
      continue
    key, _, rest = line.partition(' ')
    tables[section][int(key)] = rest.strip('"')
  def fields(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r'(\w+)=(\d+)', text)}
  frames = {}
  for frame_id in tables['StackFrames']:
    stack, current = [], frame_id
    while current and current not in [s for s, _ in stack]:
      frame = fields(tables['StackFrames'][current])
      location = fields(tables['FileLocations'][frame['file_location_id']])
      stack.append((current, (tables['FileNames'][location['file_name_id']],
                              tables['FunctionNames'][location['function_name_id']])))
      current = frame.get('parent_frame_id', 0)
    frames[frame_id] = [where for _, where in stack]
  return frames


def part_of(opcode: str, stack: list[tuple[str, str]]) -> str:
  """The row an op's time goes to."""
  if opcode in COLLECTIVES:
    return f'{opcode} (collective)'
  if any('/optax/' in file for file, _ in stack):
    return 'optimizer (optax)'
  if any('/mintrain/' in file and function in LINEAR for file, function in stack):
    return LINEAR_ROW
  for file, function in stack:
    if '/mintrain/' in file and function not in HELPERS:
      return function.replace('<locals>.', '').split('.<lambda>')[0]
  return OTHER


def instructions(hlo: str) -> dict[str, tuple[str, str, bool]]:
  """HLO op name -> (opcode, row, is backward). An op whose stack holds no mintrain function but a helper
  (a custom VJP's forward rule is traced where its caller's frames are gone) goes by its einsum: to
  `linear` when the linear layers' backward ops name the same einsum, else to a row of that einsum."""
  frames = source_tables(hlo)
  found = []
  for line in hlo.splitlines():
    match = INSTRUCTION.match(line)
    if not match:
      continue
    name, opcode, metadata = match.groups()
    frame = re.search(r'stack_frame_id=(\d+)', metadata)
    op_name = re.search(r'op_name="([^"]*)"', metadata)
    stack = frames.get(int(frame.group(1)), []) if frame else []
    found.append((name, opcode, part_of(opcode, stack), op_name.group(1) if op_name else '', stack))
  linear = {einsum for _, _, part, op_name, _ in found if part == LINEAR_ROW
            for einsum in EINSUM.findall(op_name)}
  out = {}
  for name, opcode, part, op_name, stack in found:
    einsum = EINSUM.findall(op_name)
    if part == OTHER and einsum and any('/mintrain/' in file for file, _ in stack):
      part = LINEAR_ROW if einsum[-1] in linear else f'{stack[0][1]} {einsum[-1]}'
    out[name] = (opcode, part, 'transpose(' in op_name)
  return out


def trace_events(directory: pathlib.Path) -> list[dict]:
  path = sorted(directory.rglob('*.trace.json.gz'))[-1]
  with gzip.open(path) as f:
    data = json.load(f)
  return data['traceEvents'] if isinstance(data, dict) else data


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  harness.config_arguments(parser)
  parser.add_argument('--smoke', action='store_true', help='tiny model (a few seconds)')
  args = parser.parse_args()

  devices = harness.start_devices()
  path, overrides = harness.bench_tiny() if args.config is None else (args.config.resolve(), ())
  overrides += tuple(args.override) + (harness.SMOKE if args.smoke else ())
  config = harness.load(path, overrides)
  compiled, built, batches = harness.prepare(config, devices)
  ops = instructions(compiled.compiled.as_text())

  with jax.set_mesh(built.mesh), tempfile.TemporaryDirectory(prefix='mintrain_breakdown_') as trace_dir:
    state = compiled.state
    for _ in range(1 if args.smoke else harness.WARMUP):  # Outside the trace.
      state, _ = compiled.compiled(state, batches[0])
      jax.block_until_ready(state)
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    start = time.perf_counter()
    state, metrics = compiled.compiled(state, batches[1])
    jax.block_until_ready((state, metrics))
    wall_s = time.perf_counter() - start
    jax.profiler.stop_trace()
    events = trace_events(pathlib.Path(trace_dir))

  fwd, bwd, unknown = collections.Counter(), collections.Counter(), 0
  for e in events:
    name = e.get('args', {}).get('hlo_op')
    if e.get('ph') != 'X' or name is None:
      continue
    if name not in ops:
      unknown += e['dur']
      continue
    opcode, part, backward = ops[name]
    if opcode not in CONTAINERS:
      (bwd if backward else fwd)[part] += e['dur'] / 1e3 / built.mesh.size  # ms per device.
  total = sum(fwd.values()) + sum(bwd.values())
  rows = []
  for part in sorted(set(fwd) | set(bwd), key=lambda p: -(fwd[p] + bwd[p])):
    rows.append([part, f'{fwd[part]:.1f}', f'{bwd[part]:.1f}', f'{fwd[part] + bwd[part]:.1f}',
                 f'{(fwd[part] + bwd[part]) / total:.1%}'])

  print(f'\nconfig {harness.describe_config(path, overrides)}')
  print(f'mesh {harness.describe_mesh(built.mesh)}; one profiled step took {wall_s * 1e3:.0f} ms wall; '
        f'the ops of one device add up to {total:.0f} ms on average')
  if unknown > 1e3:
    print(f'note: {unknown / 1e3:.1f} ms of events named ops not in the compiled HLO')
  print()
  print(harness.table(['part', 'forward_ms', 'backward_ms', 'total_ms', 'share'], rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
