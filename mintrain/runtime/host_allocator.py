"""Keep freed host memory in the process, so XLA:CPU does not page-fault its temporaries every step.

XLA:CPU mallocs each step's temporaries from worker threads and frees them at its end; glibc serves such
big blocks with fresh `mmap`s and unmaps them, so every step faults in new pages (BENCHMARKS.md). One arena,
no `mmap` for big blocks and no trimming make it reuse them; the heap then grows by whatever lands in the
holes they leave, so the loop hands free pages back after each save (`release_freed_memory`).

CPU backend only (`keep_freed_memory_if_cpu`), decided before JAX starts from what JAX will read: the
first platform of `jax_platforms` when it is set; else whether no accelerator is installed (no PJRT plugin,
no `libtpu`, no library named by TPU_LIBRARY_PATH or PJRT_NAMES_AND_LIBRARY_PATHS).

Host arrays that become device buffers (a loaded checkpoint's slices) come from `adoptable_empty` (several
at once from `adoptable_arrays`) or, for replicas of one slice, from `copy_on_write_empty`; they are filled
with transposed host arrays by `copy_transposed`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import math
import mmap
import os
import pkgutil
from collections.abc import Sequence

import jax
import numpy as np

# mallopt(3) parameter, the glibc tunable (glibc.malloc.*) that sets the same, and the value.
_SETTINGS = ((-8, 'arena_max', 1),  # M_ARENA_MAX
             (-4, 'mmap_max', 0),  # M_MMAP_MAX
             (-1, 'trim_threshold', -1))  # M_TRIM_THRESHOLD; mallopt's -1 is SIZE_MAX as a size_t.

_applied: bool | None = None
ADOPT_ALIGNMENT = 64  # JAX's CPU backend takes a host array this aligned as a device buffer without a copy.
HUGE_ARRAY_BYTES = 2 << 20  # From this size up, an array gets its own mapping backed by huge pages.
# The tiles `copy_transposed` moves at a time: few source rows, so the cache lines a tile reads (one per
# row) stay in L1 while the destination rows they feed are written.
TILE_ROWS, TILE_COLUMNS = 16, 256


def keep_freed_memory() -> bool:
  """Tunes glibc's malloc as above; True when it took effect (False on other C libraries).

  Call before the JAX backend starts: threads that already have an arena keep it.
  """
  global _applied
  if _applied is None:
    _applied = _mallopt([(param, value) for param, _, value in _SETTINGS])
  return _applied


def glibc_tunables() -> str:
  """`keep_freed_memory`'s setting as GLIBC_TUNABLES, for a process that does not call it (a peer
  framework's in benchmarks/peers.py): glibc reads it when the process starts, before any thread."""
  return ':'.join(f'glibc.malloc.{name}={ctypes.c_size_t(value).value}' for _, name, value in _SETTINGS)


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


def adoptable_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialised array that JAX's CPU backend adopts as a device buffer (no copy). A large one is its
  own anonymous mapping with transparent huge pages asked for: first touching it faults 2 MiB at a time,
  not 4 KiB, and it is unmapped when the last array (or device buffer) using it is freed."""
  size = math.prod(shape) * np.dtype(dtype).itemsize
  if size >= HUGE_ARRAY_BYTES and hasattr(mmap, 'MADV_HUGEPAGE'):
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, np.dtype(dtype)).reshape(shape)
  raw = np.empty(size + ADOPT_ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ADOPT_ALIGNMENT
  return raw[start:start + size].view(dtype).reshape(shape)


def adoptable_arrays(shapes: Sequence[tuple[int, ...]], dtype: np.dtype) -> list[np.ndarray]:
  """Uninitialised arrays of `shapes`, each adoptable, carved from one `adoptable_empty`: slices too small
  for huge pages on their own get them together. The memory is freed with the last of them."""
  itemsize = np.dtype(dtype).itemsize
  sizes = [math.prod(shape) * itemsize for shape in shapes]
  starts = [0]
  for size in sizes:
    starts.append(starts[-1] + -(-size // ADOPT_ALIGNMENT) * ADOPT_ALIGNMENT)
  memory = adoptable_empty((starts[-1],), np.uint8)
  return [memory[start:start + size].view(dtype).reshape(shape)
          for start, size, shape in zip(starts, sizes, shapes)]


def copy_on_write_empty(shape: tuple[int, ...], dtype: np.dtype,
                       count: int) -> tuple[np.ndarray, list[np.ndarray]] | None:
  """(an uninitialised array to fill, `count` adoptable arrays that show what it holds): private mappings of
  one memory file, so replicas share one copy of their pages until each is written, and a donated buffer
  written in place changes only its own replica. None below `HUGE_ARRAY_BYTES` or without `memfd_create`."""
  size = math.prod(shape) * np.dtype(dtype).itemsize
  if size < HUGE_ARRAY_BYTES or not hasattr(os, 'memfd_create'):
    return None
  try:
    fd = os.memfd_create('mintrain-replicas', os.MFD_CLOEXEC)
  except OSError:
    return None
  try:  # Linux maps a private page to the file's until it is written: later fills show through.
    os.ftruncate(fd, size)
    shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    replicas = [mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE) for _ in range(count)]
  finally:
    os.close(fd)  # The mappings keep the file; it is freed with the last of them.
  return (np.frombuffer(shared, np.dtype(dtype)).reshape(shape),
          [np.frombuffer(m, np.dtype(dtype)).reshape(shape) for m in replicas])


def copy_transposed(out_BA: np.ndarray, x_AB: np.ndarray) -> None:
  """`out_BA[...] = x_AB.T` in tiles that stay in the cache: numpy's own copy strides across the whole of
  one of the two arrays."""
  a, b = x_AB.shape
  for i in range(0, a, TILE_ROWS):
    for j in range(0, b, TILE_COLUMNS):
      out_BA[j:j + TILE_COLUMNS, i:i + TILE_ROWS] = x_AB[i:i + TILE_ROWS, j:j + TILE_COLUMNS].T
