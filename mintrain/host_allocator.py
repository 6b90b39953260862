"""Keep freed host memory in the process, so XLA:CPU does not page-fault its temporaries every step.

XLA:CPU allocates each execution's temporaries (hundreds of MB per device for a 32k-vocabulary
model) with `malloc` from its worker threads and frees them when the step ends. glibc serves a
big block asked for by a thread outside its main arena with a fresh `mmap`, and gives it back
with `munmap`, so the next step touches new pages: on bench_tiny that was ~515k page faults and
~1.3 s of kernel time in every ~3.4 s step. With one arena, no `mmap` for big blocks and no
trimming, glibc reuses the same pages from step to step.

The cost: the process keeps its peak heap until it exits, which a training process does anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util

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


def _mallopt(settings: list[tuple[int, int]]) -> bool:
  name = ctypes.util.find_library('c')
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):
    return False
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  return all(mallopt(param, value) == 1 for param, value in settings)
