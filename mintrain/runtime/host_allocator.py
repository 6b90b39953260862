"""Keep freed host memory in the process, so XLA:CPU does not page-fault its temporaries every step.

XLA:CPU allocates each execution's temporaries (hundreds of MB per device for a 32k-vocabulary
model) with `malloc` from its worker threads and frees them when the step ends. glibc serves a
big block asked for by a thread outside its main arena with a fresh `mmap`, and gives it back
with `munmap`, so the next step touches new pages: on bench_tiny that was ~515k page faults and
~1.3 s of kernel time in every ~3.4 s step. With one arena, no `mmap` for big blocks and no
trimming, glibc reuses the same pages from step to step.

The cost: freed pages stay in the process, and the heap does not stay at one step's peak. The next
step's temporaries are allocated before the last step's are freed, and whatever is allocated meanwhile
(a save's or an evaluation's buffers, another thread's scratch block) can land in the hole they left;
then no hole fits them, the heap grows by their size and never shrinks (a single-device run grew from
1.38 to 1.59 GB over four saves, ~100 MB at a time). So the training loop hands the free pages back
after each save (`release_freed_memory`); the steps after it fault their temporaries in once.

Measured on the CPU backend only, so `keep_freed_memory_if_cpu` applies it only there: on a GPU or
TPU the big buffers live in device memory. The backend is not known until JAX starts it, so the rule
reads what JAX will read then:
- `jax_platforms` (JAX_PLATFORMS) is set: the first platform listed is the default backend; apply
  when it is `cpu`. (On import, JAX sets `tpu,cpu` on a Cloud TPU VM.)
- it is not set: JAX prefers any accelerator that starts; apply when none is installed: no PJRT
  plugin (a `jax_plugins` namespace module or entry point, as the CUDA and ROCm plugins install), no
  `libtpu`, no library named by TPU_LIBRARY_PATH or PJRT_NAMES_AND_LIBRARY_PATHS. A plugin without
  its hardware (JAX falls back to the CPU) goes without the setting; JAX_PLATFORMS=cpu gets it back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import pkgutil
from collections.abc import Sequence

import jax

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_applied: bool | None = None


def keep_freed_memory() -> bool:
  """Tunes glibc's malloc as above; True when it took effect (False on other C libraries).

  Call before the JAX backend starts: threads that already have an arena keep it.
  """
  global _applied
  if _applied is None:
    _applied = _mallopt([(_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)])
  return _applied


def keep_freed_memory_if_cpu() -> bool:
  """`keep_freed_memory()` when the run will use JAX's CPU backend (see above); True when applied."""
  return cpu_backend_expected(jax.config.jax_platforms, accelerator_backends()) and keep_freed_memory()


def release_freed_memory() -> None:
  """Gives the pages of every free heap block back to the kernel (glibc's `malloc_trim`), where
  `keep_freed_memory` took effect; elsewhere the C library trims as usual. Addresses stay reserved."""
  if _applied:
    ctypes.CDLL(ctypes.util.find_library('c')).malloc_trim(ctypes.c_size_t(0))


def cpu_backend_expected(platforms: str | None, accelerators: Sequence[str]) -> bool:
  """Whether JAX's default backend will be the CPU, given `jax_platforms` and the installed
  accelerator backends (`accelerator_backends()`)."""
  if platforms:
    return platforms.split(',')[0].strip() == 'cpu'
  return not accelerators


def accelerator_backends() -> list[str]:
  """The accelerator backends JAX would try to start, found without starting any: PJRT plugins,
  libtpu, and libraries named in the environment."""
  found = set()
  namespace = importlib.util.find_spec('jax_plugins')
  if namespace is not None and namespace.submodule_search_locations:
    found.update(f'jax_plugins.{m.name}' for m in pkgutil.iter_modules(namespace.submodule_search_locations))
  found.update(e.value for e in importlib.metadata.entry_points(group='jax_plugins'))
  if importlib.util.find_spec('libtpu') is not None:
    found.add('libtpu')
  if os.path.isfile(os.environ.get('TPU_LIBRARY_PATH', '')):
    found.add('TPU_LIBRARY_PATH')
  if os.environ.get('PJRT_NAMES_AND_LIBRARY_PATHS'):
    found.add('PJRT_NAMES_AND_LIBRARY_PATHS')
  return sorted(found)


def _mallopt(settings: list[tuple[int, int]]) -> bool:
  name = ctypes.util.find_library('c')
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):
    return False
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  return all(mallopt(param, value) == 1 for param, value in settings)
