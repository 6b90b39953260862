"""Keep freed host memory in the process, so XLA:CPU does not page-fault its temporaries every step.

XLA:CPU mallocs each step's temporaries from worker threads and frees them at its end; glibc serves such
big blocks with fresh `mmap`s and unmaps them, so every step faults in new pages (BENCHMARKS.md). One arena,
no `mmap` for big blocks and no trimming make it reuse them; the heap then grows by whatever lands in the
holes they leave, so the loop hands free pages back after each save (`release_freed_memory`).

CPU backend only (`keep_freed_memory_if_cpu`), decided before JAX starts from what JAX will read: the
first platform of `jax_platforms` when it is set; else whether no accelerator is installed (no PJRT plugin,
no `libtpu`, no library named by TPU_LIBRARY_PATH or PJRT_NAMES_AND_LIBRARY_PATHS).

Host arrays that become device buffers (a loaded checkpoint's slices) come from `adoptable_empty` (several
at once from `adoptable_arrays`) or, for replicas of one slice, from `copy_on_write_empty` (whose memory
file a reader may write directly: `memory_file`); they are filled with transposed host arrays by
`copy_transposed`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import importlib.util
import math
import mmap
import os
import pkgutil
import weakref
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
# `copy_transposed` moves this many source rows at a time: they stay in the cache while each destination
# row takes its next TILE_ROWS values, one cache line of float32.
TILE_ROWS = 16
_MEMORY_FILES: dict[int, int] = {}  # id of a `copy_on_write_empty` filling mapping: its memory file.


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
    fill = _map(fd, size, shared=True)
    replicas = [_map(fd, size, shared=False) for _ in range(count)]
  except BaseException:
    os.close(fd)
    raise
  # The descriptor stays open while the filling mapping lives (`memory_file`); the replicas' mappings keep
  # the file after it, and it is freed with the last of them.
  _MEMORY_FILES[id(fill.base)] = fd
  weakref.finalize(fill.base, lambda key: os.close(_MEMORY_FILES.pop(key)), id(fill.base))
  return fill.view(dtype).reshape(shape), [m.view(dtype).reshape(shape) for m in replicas]


def _map(fd: int, size: int, shared: bool) -> np.ndarray:
  """`size` bytes of file `fd` mapped, shared or private (copy-on-write), as a uint8 array that holds no
  descriptor, unmapped when the last array (or device buffer) using it is freed. Python's `mmap` keeps a
  duplicate descriptor per mapping: one per replica of every parameter would exhaust the process's."""
  libc = _mapping_calls()
  flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
  address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
  if address is None or address == ctypes.c_void_p(-1).value:
    error = ctypes.get_errno()
    raise OSError(error, f'mmap of a memory file: {os.strerror(error)}')
  memory = (ctypes.c_char * size).from_address(address)
  weakref.finalize(memory, libc.munmap, address, size)
  return np.frombuffer(memory, np.uint8)


def memory_file(out: np.ndarray) -> tuple[int, int] | None:
  """(descriptor, byte position) of the memory file that `out` (C-contiguous) lies in when it is part of
  a `copy_on_write_empty` array to fill, else None. Writing the file (`os.sendfile`, `os.pwrite`) makes its
  pages in the kernel; writing through the mapping faults them in one 4 KiB page at a time."""
  whole = out
  while isinstance(whole.base, np.ndarray):
    whole = whole.base
  fd = _MEMORY_FILES.get(id(whole.base)) if whole.base is not None else None
  if fd is None or not out.flags.c_contiguous:
    return None
  return fd, out.ctypes.data - whole.ctypes.data


@functools.cache
def _mapping_calls() -> ctypes.CDLL:
  """The C library with `mmap` and `munmap` typed."""
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mmap.restype, libc.munmap.restype = ctypes.c_void_p, ctypes.c_int
  libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                        ctypes.c_long]
  libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
  return libc


def copy_transposed(out_BA: np.ndarray, x_AB: np.ndarray) -> None:
  """`out_BA[...] = x_AB.T` in bands of TILE_ROWS source rows: numpy's own copy strides across the whole of
  one of the two arrays."""
  for i in range(0, x_AB.shape[0], TILE_ROWS):
    out_BA[:, i:i + TILE_ROWS] = x_AB[i:i + TILE_ROWS].T
