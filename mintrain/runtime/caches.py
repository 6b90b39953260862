"""What mintrain keeps about a machine between runs: the matmul calibration (`hardware`) and JAX's
persistent compilation cache, so that a re-run or a resume of the same program loads XLA's executables
instead of compiling them again."""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform

import jax


def root() -> pathlib.Path:
  """$MINTRAIN_CACHE_DIR, else ~/.cache/mintrain."""
  return pathlib.Path(os.environ.get('MINTRAIN_CACHE_DIR')
                      or os.path.join(os.path.expanduser('~'), '.cache', 'mintrain'))


def machine(cpuinfo: str | None = None) -> str:
  """What a machine's measurements and compiled code belong to: the processor model and its instruction
  set (a hash of /proc/cpuinfo's flags: virtual machines name different generations alike, and XLA:CPU
  compiles for the host's instructions), the cores this process may use, the JAX version."""
  model, flags = platform.processor() or platform.machine(), ''
  if cpuinfo is None:
    try:
      cpuinfo = pathlib.Path('/proc/cpuinfo').read_text()
    except OSError:
      cpuinfo = ''
  fields = {}
  for line in cpuinfo.splitlines():
    name, _, value = line.partition(':')
    fields.setdefault(name.strip(), value.strip())
  model = fields.get('model name') or model
  features = fields.get('flags') or fields.get('Features')  # x86, Arm.
  if features:
    flags = f' isa {hashlib.sha256(" ".join(sorted(features.split())).encode()).hexdigest()[:8]}'
  return f'{model}{flags} x{len(os.sched_getaffinity(0))} jax {jax.__version__}'


COMPILATION_CACHE_BYTES = 4 << 30  # Past it, JAX deletes the least recently used programs.


def use_compilation_cache(enabled: bool = True) -> str | None:
  """Points JAX's persistent compilation cache at root()/xla/<machine>, at most COMPILATION_CACHE_BYTES,
  unless JAX_COMPILATION_CACHE_DIR (`jax_compilation_cache_dir`) names one; returns the directory in use.
  Per machine, because XLA:CPU's code is for the host's processor and a home directory may be shared by
  several kinds. Call it before anything compiles: JAX settles its cache at the first compile. `enabled`
  is the run's `train.compilation_cache`: False leaves JAX's settings as they are."""
  if enabled and not jax.config.jax_compilation_cache_dir:
    key = hashlib.sha256(machine().encode()).hexdigest()[:16]
    jax.config.update('jax_compilation_cache_dir', str(root() / 'xla' / key))
    if jax.config.jax_compilation_cache_max_size < 0:
      jax.config.update('jax_compilation_cache_max_size', COMPILATION_CACHE_BYTES)
  return jax.config.jax_compilation_cache_dir
