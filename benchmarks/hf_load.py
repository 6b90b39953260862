#!/usr/bin/env python
"""Loading a Hugging Face checkpoint (`hf.load_params`): time against reading the same file, and memory.

Writes a float32 Llama-shaped safetensors checkpoint (vocab 32000, hidden 1024, 2 layers, tied: 234 MB),
then times reading the whole file (16 MB `readinto`s) into a reused buffer and into a fresh 64-byte-aligned
one (what any load that materialises the parameters must at least do; also in a process of its own, whose
memory is as new as a load's), and loading it on 1 or 8 CPU devices, in one process and in two
(`scripts/launch_local.py`, 4 devices each). "cold" evicts the file from the page cache first
(`posix_fadvise(DONTNEED)` after an fsync), so its bytes come from the disk; "warm" reads them from the
cache. Each load runs in a fresh process, which reports its time and its peak resident memory growth while
loading (`VmHWM` after `/proc/self/clear_refs`, or its final RSS plus the memory files its replicas map),
against the checkpoint's size. Every read and load runs once per round, rounds repeat, and each row is the
median over rounds.

  python benchmarks/hf_load.py          # ~3 min on 2 CPU cores
  python benchmarks/hf_load.py --tree /tmp/before --tree .   # two checkouts' loaders, interleaved
  python benchmarks/hf_load.py --smoke  # a 1 MB checkpoint, fsdp8 in one and two processes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import harness

REPO = pathlib.Path(__file__).resolve().parents[1]


MODEL = {'vocab_size': 32000, 'hidden_size': 1024, 'intermediate_size': 2816, 'num_hidden_layers': 2,
         'num_attention_heads': 8}
SMOKE_MODEL = {'vocab_size': 1024, 'hidden_size': 128, 'intermediate_size': 256, 'num_hidden_layers': 1,
               'num_attention_heads': 8}
# (data, fsdp, model) sizes; a mesh uses as many of the 8 devices.
MESHES = {'single': (1, 1, 1), 'fsdp8': (1, 8, 1), 'tp8': (1, 1, 8), 'dp4_tp2': (4, 1, 2)}
# (processes, mesh, page cache) of each load measured; every one in fresh processes.
LOADS = [(1, 'single', 'warm'), (1, 'fsdp8', 'cold'), (1, 'fsdp8', 'warm'), (1, 'tp8', 'warm'),
         (1, 'dp4_tp2', 'warm'), (2, 'fsdp8', 'cold'), (2, 'fsdp8', 'warm')]
SMOKE_LOADS = [(1, 'fsdp8', 'warm'), (2, 'fsdp8', 'warm')]
ROUNDS = 5  # Each read and load runs once per round; rows are medians over rounds.
RESULT = 'RESULT '  # The line a measuring process prints.
# The buffer a file read fills: one allocated once, or a fresh 64-byte-aligned one (by its row's name).
READS = {'reused': 'reused buffer', 'fresh': 'fresh aligned buffer'}
OWN_PROCESS = 'read'  # The mesh of a "load" that only reads the file into a fresh buffer, in its own process.
# x_read, x_fresh_read: wall time over the file read's from the same cache into a reused or a fresh buffer;
# cpu_x_fresh_read: the same ratio of CPU times (steadier on a loaded machine); read_MiB: bytes read (the
# process that read most); peak_growth_MiB: of the process that grew most.
HEADER = ['what', 'processes x devices', 'mesh', 'page_cache', 'ms', 'cpu_ms', 'x_read', 'x_fresh_read',
          'cpu_x_fresh_read', 'read_MiB', 'peak_growth_MiB', 'growth / ckpt']


def write_checkpoint(directory: pathlib.Path, model: dict[str, int]) -> int:
  """A random float32 Llama checkpoint of `model`'s sizes in `directory`; returns the file's bytes."""
  import numpy as np
  from safetensors.numpy import save_file

  d, f, layers = model['hidden_size'], model['intermediate_size'], model['num_hidden_layers']
  shapes = {'model.embed_tokens.weight': (model['vocab_size'], d), 'model.norm.weight': (d,)}
  for i in range(layers):
    layer = f'model.layers.{i}.'
    shapes |= {f'{layer}{n}.weight': (d,) for n in ('input_layernorm', 'post_attention_layernorm')}
    shapes |= {f'{layer}self_attn.{n}_proj.weight': (d, d) for n in 'qkvo'}
    shapes |= {f'{layer}mlp.{n}_proj.weight': (f, d) for n in ('gate', 'up')}
    shapes[f'{layer}mlp.down_proj.weight'] = (d, f)
  rng = np.random.default_rng(0)
  path = directory / 'model.safetensors'
  save_file({n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}, path,
            metadata={'format': 'pt'})
  (directory / 'config.json').write_text(json.dumps({'model_type': 'llama', 'tie_word_embeddings': True,
                                                     **model}))
  return path.stat().st_size


def evict(path: pathlib.Path) -> None:
  """Drops the file's pages from the page cache (they are clean after the fsync)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def read_seconds(path: pathlib.Path, cache: str, reused: memoryview | None) -> tuple[float, float]:
  """(wall, CPU) seconds to read the whole file, from the disk ('cold') or the page cache ('warm'), into
  `reused` (as large as the file) or, when None, into a newly allocated 64-byte-aligned buffer."""
  import numpy as np

  if cache == 'cold':
    evict(path)
  start, cpu = time.perf_counter(), time.process_time()
  if reused is None:
    size = path.stat().st_size
    raw = np.empty(size + 64, np.uint8)
    offset = -raw.ctypes.data % 64
    reused = memoryview(raw[offset:offset + size])
  done, block = 0, 16 << 20
  with open(path, 'rb', buffering=0) as f:
    while n := f.readinto(reused[done:done + block]):
      done += n
  return time.perf_counter() - start, time.process_time() - cpu


def status_bytes(key: str) -> int:
  with open('/proc/self/status') as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def bytes_read() -> int:
  """Bytes this process has read with read-like system calls (`rchar`; pages of a memory map not counted)."""
  with open('/proc/self/io') as f:
    return next(int(line.split()[1]) for line in f if line.startswith('rchar:'))


def memory_file_bytes() -> int:
  """Bytes of the memory files (memfd) this process maps, each once: copy-on-write replicas' shared pages,
  which VmHWM leaves out once the mapping that filled them is gone."""
  sizes: dict[str, int] = {}
  with open('/proc/self/maps') as f:
    for fields in (line.split() for line in f):
      if len(fields) >= 6 and fields[5].startswith('/memfd:'):
        low, high = (int(x, 16) for x in fields[0].split('-'))
        sizes[fields[4]] = max(sizes.get(fields[4], 0), high - low)
  return sum(sizes.values())


def measure_process(directory: pathlib.Path, mesh_name: str, cache: str) -> None:
  """One process of a load: prints its load time and peak memory growth (run by `load`); with `mesh_name`
  OWN_PROCESS, the time of the file read into a fresh aligned buffer in a process as new as a load's."""
  if mesh_name == OWN_PROCESS:
    path = directory / 'model.safetensors'
    read, cpu = read_seconds(path, cache, None)
    print(RESULT + json.dumps({'seconds': read, 'cpu': cpu, 'read': 0, 'growth': 0}), flush=True)
    return
  from mintrain import mesh as mesh_lib
  from mintrain.runtime import distributed

  settings = distributed.settings()
  processes = settings.num_processes if settings and settings.num_processes else 1
  mesh_lib.simulate_cpu_devices(harness.DEVICES // processes)
  if settings:
    distributed.initialize(settings, say=lambda _: None)
  import jax

  from mintrain import hf
  from mintrain.build import build

  sizes = dict(zip(('data', 'fsdp', 'model'), MESHES[mesh_name]))
  run = build(hf.make_config(directory, mesh_sizes=sizes), jax.devices()[:math.prod(sizes.values())])
  if cache == 'cold' and jax.process_index() == 0:
    evict(directory / 'model.safetensors')
  distributed.barrier('hf_load: the file is evicted')  # Every process starts the load from the same cache.
  with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # The peak (VmHWM) starts again from the current size.
  before, files = status_bytes('VmRSS:'), memory_file_bytes()
  start, cpu, read = time.perf_counter(), time.process_time(), bytes_read()
  params = jax.block_until_ready(hf.load_params(directory, run))
  seconds, cpu, read = time.perf_counter() - start, time.process_time() - cpu, bytes_read() - read
  # The memory files' pages count in VmHWM only while the mapping that fills them exists: the peak is
  # VmHWM's, or what the process holds at the end with its memory files, whichever is more.
  growth = max(status_bytes('VmHWM:'), status_bytes('VmRSS:') + memory_file_bytes() - files) - before
  del params
  print(RESULT + json.dumps({'seconds': seconds, 'cpu': cpu, 'read': read, 'growth': growth}), flush=True)


def load(directory: pathlib.Path, tree: pathlib.Path | None, processes: int, mesh_name: str,
         cache: str) -> list[dict[str, float]]:
  """The results of every process of one load, each a fresh process importing mintrain from `tree` (a
  repository root; None: as this process does)."""
  me = [sys.executable, __file__, '--process', str(directory), mesh_name, cache]
  env = {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
  if tree is not None:
    env['PYTHONPATH'] = os.pathsep.join([str(tree), *filter(None, [os.environ.get('PYTHONPATH')])])
  if processes == 1:
    command, env['JAX_PLATFORMS'] = me, 'cpu'
  else:
    command = [sys.executable, str(REPO / 'scripts' / 'launch_local.py'), '--num_processes', str(processes),
               '--', *me]
  proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  results = [json.loads(line.split(RESULT, 1)[1]) for line in proc.stdout.splitlines() if RESULT in line]
  if proc.returncode != 0 or len(results) != processes:
    raise RuntimeError(f'the load on {processes} process(es) failed:\n{proc.stdout[-3000:]}'
                       f'{proc.stderr[-3000:]}')
  return results


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--smoke', action='store_true',
                      help='a 1 MB checkpoint, fsdp8 in one and two processes')
  parser.add_argument('--tree', action='append', type=pathlib.Path, default=[],
                      help="a repository root whose loader to time (repeatable; rows name its folder)")
  parser.add_argument('--rounds', type=int, default=ROUNDS, help=f'rounds (default {ROUNDS})')
  parser.add_argument('--load', action='append', default=[], metavar='PROCESSES,MESH,CACHE',
                      help='a load to measure, e.g. 1,tp8,warm (repeatable; default: all of them)')
  parser.add_argument('--process', nargs=3, metavar=('DIR', 'MESH', 'CACHE'), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.process:
    measure_process(pathlib.Path(args.process[0]), args.process[1], args.process[2])
    return 0

  model = SMOKE_MODEL if args.smoke else MODEL
  loads, rounds = (SMOKE_LOADS, 1) if args.smoke else (LOADS, args.rounds)
  if args.load:
    loads = [(int(p), mesh_name, cache) for p, mesh_name, cache in (item.split(',') for item in args.load)]
  load_average = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix='mintrain_hf_load_') as tmp:
    directory = pathlib.Path(tmp)
    size = write_checkpoint(directory, model)
    path = directory / 'model.safetensors'
    reused = memoryview(bytearray(size))
    reads = {(cache, buffer): [] for cache in ('cold', 'warm') for buffer in READS}
    trees = [t.resolve() for t in args.tree] or [None]
    measured = {(tree, *load_key): [] for load_key in loads for tree in trees}
    own = {cache: [] for cache in dict.fromkeys(cache for *_, cache in loads)}
    for _ in range(rounds):
      for (cache, buffer), times in reads.items():
        times.append(read_seconds(path, cache, reused if buffer == 'reused' else None))
      for cache, results in own.items():
        results.append(load(directory, None, 1, OWN_PROCESS, cache))
      for load_key, results in measured.items():
        results.append(load(directory, *load_key))
        print(f'measured {load_key[1]} process(es), {load_key[2]}, {load_key[3]}', flush=True)
  load_average += os.getloadavg()
  read = {key: tuple(statistics.median(t[i] for t in times) for i in (0, 1)) for key, times in reads.items()}
  rows = []
  for (cache, buffer), (wall, cpu) in read.items():
    rows.append([f'read file, {READS[buffer]}', '1', '-', cache, f'{wall * 1e3:.1f}', f'{cpu * 1e3:.1f}',
                 f'{wall / read[cache, "reused"][0]:.2f}', f'{wall / read[cache, "fresh"][0]:.2f}',
                 f'{cpu / read[cache, "fresh"][1]:.2f}', harness.mib(size), '-', '-'])
  for cache, results in own.items():
    wall, cpu = (statistics.median(r[0][key] for r in results) for key in ('seconds', 'cpu'))
    rows.append(['read file, fresh aligned buffer, own process', '1', '-', cache, f'{wall * 1e3:.1f}',
                 f'{cpu * 1e3:.1f}', f'{wall / read[cache, "reused"][0]:.2f}',
                 f'{wall / read[cache, "fresh"][0]:.2f}', f'{cpu / read[cache, "fresh"][1]:.2f}',
                 harness.mib(size), '-', '-'])
  for (tree, processes, mesh_name, cache), results in measured.items():
    # Per round the slowest process; then the median over rounds.
    seconds = statistics.median(max(r['seconds'] for r in one) for one in results)
    cpu = statistics.median(max(r['cpu'] for r in one) for one in results)
    growth = max(r['growth'] for one in results for r in one)
    bytes_in = max(r['read'] for one in results for r in one)
    what = f'hf.load_params ({tree.name})' if tree else 'hf.load_params'
    rows.append([what, f'{processes} x {math.prod(MESHES[mesh_name]) // processes}', mesh_name, cache,
                 f'{seconds * 1e3:.1f}', f'{cpu * 1e3:.1f}', f'{seconds / read[cache, "reused"][0]:.2f}',
                 f'{seconds / read[cache, "fresh"][0]:.2f}', f'{cpu / read[cache, "fresh"][1]:.2f}',
                 harness.mib(bytes_in), harness.mib(growth),
                 f'{growth / size:.2f}'])
  sizes = ', '.join(f'{k}={v}' for k, v in model.items())
  print(f'\nCheckpoint: {harness.mib(size)} MiB of float32 ({sizes}, tied). A load row is the slowest '
        'process (wall and CPU time: all its threads) and the largest growth of its processes; every row is\n'
        f'the median of {rounds} interleaved round(s). Load average (1, 5, 15 min) before: '
        f'{", ".join(f"{x:.1f}" for x in load_average[:3])}; after: '
        f'{", ".join(f"{x:.1f}" for x in load_average[3:])}.\n')
  print(harness.table(HEADER, rows))
  return 0

if __name__ == '__main__':
  sys.exit(main())
