#!/usr/bin/env python
"""mintrain against MaxText on bench_tiny: seconds per step and time to first step, side by side.

Every measurement is a fresh process, and every process of both frameworks gets the same malloc setting
(`--allocator`). The default is the one mintrain applies to itself on the CPU backend
(mintrain/runtime/host_allocator.py: one malloc arena, no `mmap` for big blocks, no trimming), given to
every process as GLIBC_TUNABLES: without it a CPU step page-faults its temporaries every step
(BENCHMARKS.md), and the comparison would measure the heaps, not the frameworks. `--allocator glibc` runs
every process on glibc's defaults instead (MaxText's heap keeps growing under mintrain's setting:
BENCHMARKS.md). Each process reports what its malloc did (`allocator_probe`, after its steps) and its peak
resident memory; one that passes --max-rss-gib is killed and reported.

Rounds run every (configuration, framework) once, in turn, so load from other processes falls on all alike;
the ratios pair the two frameworks of the same round. The model, batch and mesh are bench_tiny's
(mintrain/configs/bench_tiny.py), given to MaxText as its own keys (`maxtext_arguments`). Configurations:

  float32  float32 activations, no remat, unscanned layers (bench_tiny as configured)
  shipped  MaxText's defaults: bfloat16 activations, full remat, scanned layers; mintrain set the same way

mintrain's steps are timed by benchmarks/harness.py (compiled ahead, each step until `block_until_ready`);
MaxText's by its own training loop (`python -m maxtext.trainers.pre_train.train`, which logs the time
between step dispatches, one step in flight). Time to first step is, for both, from starting the process
until it reports its first step done.

MaxText 0.2.5 needs Python >= 3.12 and its own environment (not mintrain's); the `tpu` extra brings JAX,
Flax and the rest of its dependencies (libtpu lies unused: the processes run with JAX_PLATFORMS=cpu):

  python3.12 -m venv /tmp/maxtext-venv
  /tmp/maxtext-venv/bin/pip install 'maxtext[tpu]==0.2.5'

  python benchmarks/peers.py --maxtext-python /tmp/maxtext-venv/bin/python   # 2 rounds: 19 min at load 10
  python benchmarks/peers.py --maxtext-python /tmp/maxtext-venv/bin/python --allocator glibc
  python benchmarks/peers.py --only mintrain --smoke     # the tests' small model, mintrain, one step
  python benchmarks/peers.py --maxtext-python /tmp/maxtext-venv/bin/python --configs shipped --rounds 1 \
      --profile /tmp/peers_profile    # one more step of each traced, both broken down by op side by side;
                                      # each process's longest ops in /tmp/peers_profile/*.ops.md

Both on MaxText's JAX release (0.12.0.1; mintrain's own environment has 0.10.x): mintrain in a Python 3.12
environment with that release and mintrain's other dependencies, mintrain itself installed without its
pins (`pip install --no-deps -e .`), run with --mintrain-python:

  python3.12 -m venv /tmp/mintrain-jax12
  /tmp/mintrain-jax12/bin/pip install jax==0.12.0.1 flax==0.12.12 optax orbax-checkpoint ml-collections \
      grain tensorboardX matplotlib safetensors tokenizers sentencepiece jinja2 pyarrow array-record
  /tmp/mintrain-jax12/bin/pip install --no-deps -e .
  python benchmarks/peers.py --maxtext-python /tmp/maxtext-venv/bin/python \
      --mintrain-python /tmp/mintrain-jax12/bin/python
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import op_profile  # The standard library only: MaxText's environment imports this file too.

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULT = 'RESULT '  # The line a measuring process prints, then JSON.
FIRST_STEP = 'FIRST STEP DONE'  # mintrain's process prints it once its first step has finished.
# MaxText's training loop logs each step as it is flushed, after the step has finished.
MAXTEXT_STEP = re.compile(r'completed step: (\d+), seconds: ([0-9.]+),.*?loss: ([0-9.]+)')
MAXTEXT_PARAMS = re.compile(r'number parameters: ([0-9.]+) billion')
FRAMEWORKS = ('mintrain', 'maxtext')
# mintrain: mintrain's malloc setting in every process (GLIBC_TUNABLES, and mintrain's own mallopt);
# glibc: glibc's defaults in every process (mintrain's process skips its mallopt).
ALLOCATORS = ('mintrain', 'glibc')
TIMEOUT_S = 1800  # One process; a loaded 2-core machine takes minutes to compile bench_tiny.


@dataclasses.dataclass(frozen=True)
class Configuration:
  mintrain: tuple[str, ...]  # Config overrides on top of bench_tiny.
  maxtext: tuple[str, ...]  # MaxText keys on top of `maxtext_arguments`.


CONFIGURATIONS = {
    'float32': Configuration(
        ('model.compute_dtype=float32', 'model.remat=none', 'model.scan_layers=False'),
        ('dtype=float32', 'remat_policy=none', 'scan_layers=false')),
    'shipped': Configuration(
        ('model.compute_dtype=bfloat16', 'model.remat=full', 'model.scan_layers=True'),
        ('dtype=bfloat16', 'remat_policy=full', 'scan_layers=true')),
}


def maxtext_arguments(config, steps: int, output_dir: str) -> list[str]:
  """MaxText's keys for a mintrain config's model, batch and mesh (a Llama: RMSNorm, RoPE, SwiGLU, AdamW),
  synthetic data, no checkpoint, no persistent compilation cache; `config` is a `mintrain.config.Config`."""
  m, mesh = config.model, config.mesh
  devices = mesh.data * mesh.fsdp * mesh.model
  if config.train.global_batch_size % devices:
    raise ValueError(f'MaxText takes a batch per device: {config.train.global_batch_size} rows over '
                     f'{devices} devices do not divide')
  return ['hardware=cpu', 'run_name=peers', f'base_output_directory={output_dir}', 'dataset_type=synthetic',
          f'steps={steps}', 'enable_checkpointing=false', 'enable_tensorboard=false', 'jax_cache_dir=',
          'skip_jax_distributed_system=true',  # hardware=cpu alone expects a multi-host launcher.
          'log_config=false', 'decoder_block=llama2', 'mlp_activations=[silu,linear]',
          f'base_emb_dim={m.embed_dim}', f'base_num_query_heads={m.num_heads}',
          f'base_num_kv_heads={m.num_kv_heads or m.num_heads}', f'head_dim={m.head_dim}',
          f'base_mlp_dim={m.mlp_dim}', f'base_num_decoder_layers={m.num_layers}',
          f'vocab_size={m.vocab_size}',
          f'logits_via_embedding={str(m.tie_embeddings).lower()}', f'weight_dtype={m.param_dtype}',
          f'max_target_length={config.train.seq_len}',
          f'per_device_batch_size={config.train.global_batch_size // devices}',
          f'ici_data_parallelism={mesh.data}', f'ici_fsdp_parallelism={mesh.fsdp}',
          f'ici_tensor_parallelism={mesh.model}']


class _Mallinfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                                                    'fsmblks', 'uordblks', 'fordblks', 'keepcost')]


def allocator_probe(block: int = 64 << 20) -> dict[str, bool]:
  """What this process's malloc does with a big block: whether it `mmap`s it, and whether freeing it gives
  the pages back (trims). With mintrain's setting, neither."""
  libc = ctypes.CDLL(ctypes.util.find_library('c'))
  libc.mallinfo2.restype = _Mallinfo2
  libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  before = libc.mallinfo2().hblks
  pointer = libc.malloc(block)
  mapped = libc.mallinfo2().hblks > before
  libc.free(pointer)
  return {'mmap': mapped, 'trim': not mapped and libc.mallinfo2().arena < block}


def malloc_arenas() -> int:
  """How many arenas (heaps) this process's malloc has made so far: 1 under mintrain's setting."""
  libc = ctypes.CDLL(ctypes.util.find_library('c'))
  libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
  libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
  with tempfile.NamedTemporaryFile(mode='r') as f:
    stream = libc.fopen(f.name.encode(), b'w')
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    return f.read().count('<heap nr=')


def describe_allocator(probe: dict) -> str:
  arenas = f"{probe['arenas']} arena{'s' if probe['arenas'] != 1 else ''}"
  if probe['mmap']:
    return f'{arenas}, big blocks mmapped'
  return f"{arenas}, big blocks from the heap, {'trims' if probe['trim'] else 'no trim'}"


def mintrain_process(configuration: str, warmup: int, steps: int, smoke: bool, allocator: str,
                     hlo: pathlib.Path | None, trace: pathlib.Path | None) -> None:
  """One fresh mintrain process (run by `measure`): prints the first-step line, then a RESULT. With
  `trace`, one more step after the timed ones runs under the profiler, its trace written to that file."""
  import harness
  import jax

  from mintrain import mesh

  if allocator == 'mintrain':
    devices = harness.start_devices()  # Which also calls mallopt, as every mintrain script does.
  else:  # glibc's defaults: the devices (JAX_NUM_CPU_DEVICES) without mintrain's mallopt.
    devices, _ = mesh.pick_devices(harness.DEVICES)
  path, base = harness.bench_tiny()
  overrides = (*base, *CONFIGURATIONS[configuration].mintrain, *(harness.SMOKE if smoke else ()))
  compiled, built, batches = harness.prepare(harness.load(path, overrides), devices)
  if hlo is not None:
    hlo.write_text(compiled.compiled.as_text())
  with jax.set_mesh(built.mesh):
    compiled.state, metrics = jax.block_until_ready(compiled.compiled(compiled.state, batches[0]))
  print(FIRST_STEP, flush=True)
  with tempfile.TemporaryDirectory(prefix='peers_trace_') as trace_dir:
    times, _ = harness.time_steps(compiled, built, batches[1:] + batches[:1], warmup=warmup - 1, steps=steps,
                                  trace=pathlib.Path(trace_dir) if trace else None)
    if trace is not None:
      shutil.copy(op_profile.newest_trace(pathlib.Path(trace_dir)), trace)
  print(RESULT + json.dumps({'times': times, 'loss0': float(metrics['loss']), 'jax': jax.__version__,
                             'params_billion': f'{harness.param_count(built) / 1e9:.3f}',  # As MaxText logs.
                             'arenas': malloc_arenas(), **allocator_probe()}),
        flush=True)


def maxtext_process(arguments: list[str]) -> int:
  """One fresh MaxText process, in MaxText's environment: its training module as `python -m` runs it."""
  import importlib.util
  import runpy

  base_yml = pathlib.Path(importlib.util.find_spec('maxtext').origin).parent / 'configs' / 'base.yml'
  sys.argv = ['train.py', str(base_yml), *arguments]
  try:
    runpy.run_module('maxtext.trainers.pre_train.train', run_name='__main__', alter_sys=True)
    code = 0
  except SystemExit as exit_:
    code = exit_.code or 0
  import jax

  print(RESULT + json.dumps({'arenas': malloc_arenas(), 'jax': jax.__version__, **allocator_probe()}),
        flush=True)
  return code


@dataclasses.dataclass
class Launch:
  """How every measuring process starts: its environment, where its output goes, its memory limit."""
  env: dict[str, str]
  logs: pathlib.Path | None
  max_rss_gib: float
  hlo: pathlib.Path | None = None  # Where each process writes its compiled train step (`--hlo`).
  profile: pathlib.Path | None = None  # Where each process writes the trace of one more step (`--profile`).

  def measure(self, command: list[str], first_step: re.Pattern, name: str, env: dict[str, str] | None = None
              ) -> tuple[dict, list[str]]:
    """(the process's RESULT with `first_step_s`, the seconds from its start to the first line matching
    `first_step`, and `peak_rss_gib`; its output). A process killed over the memory limit gives
    {'killed': ...} instead of a RESULT; any other failure raises."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env or self.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = [0.0]  # Resident GiB, sampled.
    watcher = threading.Thread(target=watch_memory, args=(proc, peak, self.max_rss_gib), daemon=True)
    watcher.start()
    lines, first, result = [], None, None
    for line in proc.stdout:
      lines.append(line.rstrip('\n'))
      if first is None and first_step.search(line):
        first = time.perf_counter() - start
      if line.startswith(RESULT):
        result = json.loads(line[len(RESULT):])
    code = proc.wait(timeout=TIMEOUT_S)
    watcher.join()
    if self.logs is not None:
      (self.logs / f'{name}.log').write_text('\n'.join(lines) + '\n')
    if peak[0] > self.max_rss_gib:
      return {'killed': f'killed over --max-rss-gib at {peak[0]:.1f} GiB', 'peak_rss_gib': peak[0]}, lines
    if code != 0 or result is None or first is None:
      tail = '\n'.join(lines[-40:])
      raise RuntimeError(f'{" ".join(command[:4])} ... failed (exit {code}):\n{tail}')
    return {**result, 'first_step_s': first, 'peak_rss_gib': peak[0]}, lines


def watch_memory(proc: subprocess.Popen, peak: list[float], limit_gib: float) -> None:
  """Samples the process's resident memory into `peak[0]` until it exits; kills it past `limit_gib` (the
  machine is shared: better one failed measurement than the kernel's OOM killer choosing a victim)."""
  status = pathlib.Path(f'/proc/{proc.pid}/status')
  while proc.poll() is None:
    try:
      kib = int(re.search(r'VmRSS:\s*(\d+) kB', status.read_text()).group(1))
    except (OSError, AttributeError):
      break
    peak[0] = max(peak[0], kib / 2**20)
    if peak[0] > limit_gib:
      proc.kill()
      break
    time.sleep(0.2)


def run_mintrain(launch: Launch, name: str, python: str, configuration: str, warmup: int, steps: int,
                 smoke: bool, allocator: str) -> dict:
  hlo = [f'--hlo-file={launch.hlo / name}.hlo'] if launch.hlo else []
  trace = [f'--trace-file={launch.profile / name}.xplane.pb'] if launch.profile else []
  command = [python, __file__, '--process', 'mintrain', '--configs', configuration, '--allocator',
             allocator, '--warmup', str(warmup), '--steps', str(steps), *(['--smoke'] if smoke else []), *hlo,
             *trace]
  result, _ = launch.measure(command, re.compile(re.escape(FIRST_STEP)), name, mintrain_env(launch.env))
  return result


def run_maxtext(launch: Launch, name: str, python: str, config, configuration: str, warmup: int, steps: int,
                output_dir: str) -> dict:
  """`warmup` then `steps` timed steps of MaxText in `configuration`; with `launch.profile`, one more under
  MaxText's own profiler (`profiler=xplane`), whose trace is then copied beside the others."""
  arguments = [*maxtext_arguments(config, warmup + steps + bool(launch.profile), output_dir),
               *CONFIGURATIONS[configuration].maxtext]
  if launch.profile:
    arguments += ['profiler=xplane', f'skip_first_n_steps_for_profiler={warmup + steps}', 'profiler_steps=1']
  env, dump = dict(launch.env), None
  if launch.hlo:  # XLA writes every module it compiles; the train step's optimised one is kept.
    dump = pathlib.Path(tempfile.mkdtemp(prefix='maxtext_hlo_'))
    env['XLA_FLAGS'] = f'--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step'
  result, lines = launch.measure([python, __file__, '--process', 'maxtext', '--', *arguments],
                                 re.compile(r'completed step: 0,'), name, env)
  if dump is not None:
    for found in dump.glob('*jit_train_step*after_optimizations.txt'):
      (launch.hlo / f'{name}.hlo').write_text(found.read_text())
    shutil.rmtree(dump)
  logged = [m.groups() for m in map(MAXTEXT_STEP.search, lines) if m]
  params = [m.group(1) for m in map(MAXTEXT_PARAMS.search, lines) if m]
  result.update(steps_done=len(logged), params_billion=params[0] if params else '?')
  if 'killed' not in result:
    if launch.profile:
      shutil.copy(op_profile.newest_trace(pathlib.Path(output_dir)), launch.profile / f'{name}.xplane.pb')
    result.update(times=[float(s) for i, s, _ in logged if warmup <= int(i) < warmup + steps],
                  loss0=float(logged[0][2]))
  return result


def maxtext_problem(python: str | None) -> str | None:
  """Why `python` cannot run MaxText, in one line; None when it can."""
  if not python:
    return ('--maxtext-python is required to run MaxText (a Python >= 3.12 environment with '
            "`pip install 'maxtext[tpu]==0.2.5'`; see this script's help), or pass --only mintrain")
  if not (os.path.isfile(python) and os.access(python, os.X_OK)):
    return f'--maxtext-python {python}: no such executable'
  code = 'import importlib.util as u; print(u.find_spec("maxtext") is not None)'
  found = subprocess.run([python, '-c', code], capture_output=True, text=True)
  if found.stdout.strip() != 'True':
    return f'--maxtext-python {python}: cannot import maxtext there'
  return None


def child_env(allocator: str) -> dict[str, str]:
  """Both frameworks' environment: one allocator setting, the CPU backend, 8 devices, no compilation cache."""
  from mintrain.runtime import host_allocator

  env = {k: v for k, v in os.environ.items()
         if k not in ('JAX_COMPILATION_CACHE_DIR', 'PYTHONPATH', 'GLIBC_TUNABLES')}
  env.update(JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES='8', PYTHONUNBUFFERED='1')
  if allocator == 'mintrain':
    env['GLIBC_TUNABLES'] = host_allocator.glibc_tunables()
  return env


def mintrain_env(env: dict[str, str]) -> dict[str, str]:
  """`env` with this checkout's mintrain first on the path."""
  return {**env, 'PYTHONPATH': os.pathsep.join([str(REPO), *filter(None, [os.environ.get('PYTHONPATH')])])}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--maxtext-python', default=None, metavar='PATH',
                      help='the python of an environment with MaxText 0.2.5 (see above)')
  parser.add_argument('--mintrain-python', default=sys.executable, metavar='PATH',
                      help="the python that runs mintrain (default this one); one with MaxText's JAX "
                           'release compares the two on the same JAX (see above)')
  parser.add_argument('--only', choices=FRAMEWORKS, default=None, help='run one framework only')
  parser.add_argument('--configs', nargs='+', choices=sorted(CONFIGURATIONS), default=list(CONFIGURATIONS))
  parser.add_argument('--allocator', choices=ALLOCATORS, default='mintrain',
                      help="every process's malloc: mintrain's setting (default) or glibc's defaults")
  parser.add_argument('--rounds', type=int, default=2, help='fresh processes per framework and configuration')
  parser.add_argument('--steps', type=int, default=4, help='timed steps per process')
  parser.add_argument('--warmup', type=int, default=6, help='untimed steps first, the first one included')
  parser.add_argument('--smoke', action='store_true', help="the tests' small model, one round, one step")
  parser.add_argument('--max-rss-gib', type=float, default=8.0,
                      help='kill a process whose resident memory passes this (default 8)')
  parser.add_argument('--logs', type=pathlib.Path, default=None, metavar='DIR',
                      help="keep each process's output in DIR/<round>_<configuration>_<framework>.log")
  parser.add_argument('--hlo', type=pathlib.Path, default=None, metavar='DIR',
                      help="write each process's compiled train step (XLA's optimised HLO) to "
                           'DIR/<round>_<configuration>_<framework>.hlo, and compare their ops')
  parser.add_argument('--profile', type=pathlib.Path, default=None, metavar='DIR',
                      help='trace one more step of every process (jax.profiler; MaxText by its own '
                           "profiler=xplane) into DIR, write its compiled step as --hlo does, and break "
                           'both steps down by op, side by side (benchmarks/op_profile.py)')
  parser.add_argument('--process', choices=FRAMEWORKS, help=argparse.SUPPRESS)
  parser.add_argument('--hlo-file', type=pathlib.Path, default=None, help=argparse.SUPPRESS)
  parser.add_argument('--trace-file', type=pathlib.Path, default=None, help=argparse.SUPPRESS)
  parser.add_argument('maxtext_arguments', nargs='*', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.process == 'maxtext':
    return maxtext_process(args.maxtext_arguments)
  if args.process == 'mintrain':
    mintrain_process(args.configs[0], args.warmup, args.steps, args.smoke, args.allocator, args.hlo_file,
                     args.trace_file)
    return 0

  frameworks = [args.only] if args.only else list(FRAMEWORKS)
  if 'maxtext' in frameworks:
    problem = maxtext_problem(args.maxtext_python)
    if problem:
      print(f'peers.py: error: {problem}', file=sys.stderr)
      return 2
  rounds, warmup, steps = (1, 1, 1) if args.smoke else (args.rounds, args.warmup, args.steps)

  import harness

  path, base = harness.bench_tiny()
  config = harness.load(path, (*base, *(harness.SMOKE if args.smoke else ())))
  for directory in filter(None, (args.logs, args.hlo, args.profile)):
    directory.mkdir(parents=True, exist_ok=True)
  launch = Launch(child_env(args.allocator), args.logs, args.max_rss_gib, args.hlo or args.profile,
                  args.profile)
  load_average = os.getloadavg()
  results = {}  # (configuration, framework) -> one result per round
  with tempfile.TemporaryDirectory(prefix='peers_') as output_dir:
    for i in range(rounds):
      for configuration in args.configs:
        for framework in frameworks:
          name = f'{i + 1}_{configuration}_{framework}'
          if framework == 'mintrain':
            result = run_mintrain(launch, name, args.mintrain_python, configuration, warmup, steps,
                                  args.smoke, args.allocator)
          else:
            result = run_maxtext(launch, name, args.maxtext_python, config, configuration, warmup, steps,
                                 output_dir)
          results.setdefault((configuration, framework), []).append(result)
          print(f'round {i + 1}: {configuration} {framework}: {describe_run(result)}', flush=True)
  load_average += os.getloadavg()
  print(f'\nconfig {harness.describe_config(path, base)}; allocator {args.allocator} '
        f'({launch.env.get("GLIBC_TUNABLES", "no GLIBC_TUNABLES")}); medians of {steps} timed steps after '
        f'{warmup} warm-up per fresh process, {rounds} round(s) taken in turn. Load average (1, 5, 15 min) '
        f'before: {", ".join(f"{x:.1f}" for x in load_average[:3])}; after: '
        f'{", ".join(f"{x:.1f}" for x in load_average[3:])}.\n')
  print_report(results, frameworks, args.configs)
  if launch.hlo:
    print_programs(sorted(launch.hlo.glob('*.hlo')))
  if args.profile:
    print_profiles(args.profile, rounds, args.configs, frameworks)
  return 0


def describe_run(r: dict) -> str:
  if 'killed' in r:
    return f"{r['killed']}, after {r.get('steps_done', 0)} step(s)"
  return (f'{statistics.median(r["times"]):.3f} s/step, first step after {r["first_step_s"]:.1f} s, '
          f'peak {r["peak_rss_gib"]:.2f} GiB; allocator: {describe_allocator(r)}')


def paired_ratio(mine: list[float], theirs: list[float]) -> float:
  """The median over rounds of mintrain's figure over MaxText's in the same round."""
  return statistics.median(a / b for a, b in zip(mine, theirs))


def print_report(results: dict, frameworks: list[str], configurations: list[str]) -> None:
  import harness

  rows = []
  for (configuration, framework), runs in results.items():
    for i, r in enumerate(runs):
      if 'killed' in r:
        rows.append([configuration, framework, str(i + 1), *['-'] * 5, r['params_billion'],
                     f'{r["peak_rss_gib"]:.2f}', f"{r['killed']}, after {r['steps_done']} step(s)"])
        continue
      rows.append([configuration, framework, str(i + 1), r.get('jax', '?'),
                   f'{statistics.median(r["times"]):.3f}', harness.spread(r['times']),
                   f'{r["first_step_s"]:.1f}', f'{r["loss0"]:.4f}',
                   r['params_billion'], f'{r["peak_rss_gib"]:.2f}', describe_allocator(r)])
  print(harness.table(['configuration', 'framework', 'round', 'jax', 's_per_step', 'spread',
                       'to_first_step_s', 'loss_step_0', 'params_billion', 'peak_rss_GiB', 'allocator'],
                      rows))
  if len(frameworks) < 2:
    return
  rows = []
  for configuration in configurations:
    pairs = [(a, b) for a, b in zip(results[(configuration, 'mintrain')], results[(configuration, 'maxtext')])
             if 'killed' not in a and 'killed' not in b]
    if not pairs:
      rows.append([configuration, *['-'] * 6])
      continue
    step = [[statistics.median(r['times']) for r in pair] for pair in zip(*pairs)]
    first = [[r['first_step_s'] for r in pair] for pair in zip(*pairs)]
    rows.append([configuration, f'{statistics.median(step[0]):.3f}', f'{statistics.median(step[1]):.3f}',
                 f'{paired_ratio(*step):.2f}', f'{statistics.median(first[0]):.1f}',
                 f'{statistics.median(first[1]):.1f}', f'{paired_ratio(*first):.2f}'])
  print('\nratios: median over rounds (where both ran) of mintrain / MaxText within the round\n')
  print(harness.table(['configuration', 'mintrain_s_per_step', 'maxtext_s_per_step', 'step_ratio',
                       'mintrain_to_first_step_s', 'maxtext_to_first_step_s', 'first_step_ratio'], rows))


# Ops of a compiled program worth counting side by side, and the collectives whose bytes are summed.
PROGRAM_OPS = ('fusion', 'dot', 'copy', 'transpose', 'while', *op_profile.COLLECTIVES)
ITEM_BYTES = {'f64': 8, 's64': 8, 'u64': 8, 'f32': 4, 's32': 4, 'u32': 4, 'bf16': 2, 'f16': 2, 's16': 2,
              'u16': 2, 's8': 1, 'u8': 1, 'pred': 1}
INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%\S+ = (.*?) ([a-z][a-z\-]*)\(')
ARRAY = re.compile(r'\b(' + '|'.join(ITEM_BYTES) + r')\[([0-9,]*)\]')


def program_ops(hlo: str) -> dict[str, float]:
  """How many of each of PROGRAM_OPS an optimised HLO module holds (in every computation, fused ones
  included), and the MiB its collectives move (their result shapes)."""
  counts = dict.fromkeys(PROGRAM_OPS, 0)
  moved = 0
  for line in hlo.splitlines():
    match = INSTRUCTION.match(line)
    if not match or match.group(2) not in counts:
      continue
    shape, op = match.groups()
    counts[op] += 1
    if op in op_profile.COLLECTIVES:
      moved += sum(ITEM_BYTES[t] * math.prod(int(d) for d in dims.split(',') if d)
                   for t, dims in ARRAY.findall(shape))
  return {**counts, 'collective_MiB': moved / 2**20}


def print_programs(paths: list[pathlib.Path]) -> None:
  import harness

  rows = [[path.stem, *(f'{v:.1f}' if isinstance(v, float) else str(v)
                        for v in program_ops(path.read_text()).values())] for path in paths]
  print("\ncompiled train steps (XLA's optimised HLO, every computation):\n")
  print(harness.table(['process', *PROGRAM_OPS, 'collective_MiB'], rows))


def print_profiles(directory: pathlib.Path, rounds: int, configurations: list[str], frameworks: list[str]
                   ) -> None:
  """Each round's and configuration's traced steps by op, the frameworks side by side."""
  import harness

  for i in range(rounds):
    for configuration in configurations:
      traced = {}
      for framework in frameworks:
        name = f'{i + 1}_{configuration}_{framework}'
        hlo, trace = directory / f'{name}.hlo', directory / f'{name}.xplane.pb'
        if hlo.exists() and trace.exists():
          traced[framework] = found = op_profile.breakdown(hlo.read_text(), trace)
          (directory / f'{name}.ops.md').write_text(
              harness.table(['op', 'part', 'pass', 'runs', 'ms', 'GFLOP/s'], found.longest()) + '\n')
      if not traced:
        continue
      print(f'\nround {i + 1}, {configuration}: one traced step by op, ms per device '
            f"({', '.join(traced)})\n")
      print(harness.table(*op_profile.rows(traced)))
      for framework, b in traced.items():
        if b.unmatched_ms > 1:
          print(f'note: {framework}: {b.unmatched_ms:.1f} ms of events named ops not in its compiled step')


if __name__ == '__main__':
  sys.exit(main())
