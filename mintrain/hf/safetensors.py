"""Safetensors files read as the format specifies (8-byte header length, JSON header, tensors' bytes),
header checked, and slices read in blocks of whole rows with positioned reads: no memory map, whose touched
pages would stay resident, so a reader holds the slice it builds plus one block."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from mintrain.errors import SafetensorsError
from mintrain.runtime import host_allocator

DTYPES = {'F64': '<f8', 'F32': '<f4', 'F16': '<f2', 'BF16': ml_dtypes.bfloat16, 'I64': '<i8', 'I32': '<i4',
          'I16': '<i2', 'I8': 'i1', 'U8': 'u1', 'BOOL': '?'}
BLOCK_BYTES = 4 << 20  # The most a column slice reads at once beyond the slice itself.
MAX_HEADER = 100 << 20  # As safetensors: a larger header is a damaged (or foreign) file.


class Tensor:
  """One tensor of an open `File`: `shape`, `dtype`, and `tensor[slices]` read from the file."""

  def __init__(self, fd: int, offset: int, shape: tuple[int, ...], dtype: np.dtype,
               spare: list[np.ndarray] | None = None):
    self.fd, self.offset, self.shape, self.dtype = fd, offset, shape, dtype
    self.spare = [] if spare is None else spare  # The block buffer a file's tensors pass on, faulted in once.

  def __getitem__(self, index: slice | tuple[slice, ...]) -> np.ndarray:
    """The slice `index` (unit-step slices, one per leading dimension) as a new array."""
    bounds = self._bounds(index if isinstance(index, tuple) else (index,))
    out = np.empty(tuple(b - a for a, b in bounds), self.dtype)
    for offset, rows in self.row_blocks(index):
      out[offset:offset + len(rows)] = rows
    return out

  def read_rows(self, first: int, out: np.ndarray) -> None:
    """Reads whole rows from row `first` on, as many as `out` (C-contiguous) holds, straight into it; into
    a memory file's pages (replicas') by the kernel alone (`host_allocator.memory_file`)."""
    row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
    into = host_allocator.memory_file(out)
    if into is None:
      self._read(out.reshape(-1).view(np.uint8), self.offset + first * row_bytes)
      return
    fd, position = into
    done = 0
    while done < out.nbytes:
      os.lseek(fd, position + done, os.SEEK_SET)
      n = os.sendfile(fd, self.fd, self.offset + first * row_bytes + done, out.nbytes - done)
      if n == 0:
        raise SafetensorsError(f'the file ends {out.nbytes - done} bytes before its tensor data does.')
      done += n

  def row_blocks(self, index: slice | tuple[slice, ...],
             rows_multiple: int = 1) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, rows) covering the slice `index` in order: `rows` are its rows offset, offset+1, ..., a
    multiple of `rows_multiple` of them but the last, read into one buffer (of at most `BLOCK_BYTES`, or
    `rows_multiple` rows) that the next block overwrites, and the next tensor's reads after it."""
    bounds = self._bounds(index if isinstance(index, tuple) else (index,))
    (first, last), inner = bounds[0], bounds[1:]
    row_shape = self.shape[1:]
    row_bytes = math.prod(row_shape) * self.dtype.itemsize
    per_block = max(1, BLOCK_BYTES // (row_bytes * rows_multiple)) * rows_multiple
    size = min(per_block, last - first) * row_bytes
    buffer = self.spare.pop() if self.spare and self.spare[-1].nbytes >= size else np.empty(size, np.uint8)
    inner_slices = (slice(None), *(slice(a, b) for a, b in inner))
    try:
      for start in range(first, last, per_block):
        count = min(per_block, last - start)
        rows = buffer[:count * row_bytes].view(self.dtype).reshape(count, *row_shape)
        self._read(rows.reshape(-1).view(np.uint8), self.offset + start * row_bytes)
        yield start - first, rows[inner_slices]
    finally:
      self.spare[:] = [buffer]

  def _bounds(self, index: tuple[slice, ...]) -> list[tuple[int, int]]:
    unit_steps = all(isinstance(s, slice) and s.step in (None, 1) for s in index)
    if not self.shape or len(index) > len(self.shape) or not unit_steps:
      raise IndexError(f'{index}: a tensor of shape {self.shape} reads unit-step slices, one per dimension.')
    index = index + (slice(None),) * (len(self.shape) - len(index))
    return [s.indices(n)[:2] for s, n in zip(index, self.shape)]

  def _read(self, buffer: np.ndarray, offset: int) -> None:
    view, done = memoryview(buffer), 0
    while done < len(view):
      n = os.preadv(self.fd, [view[done:]], offset + done)
      if n == 0:
        raise SafetensorsError(f'the file ends {len(view) - done} bytes before its tensor data does.')
      done += n


class File:
  """An open safetensors file: `tensors` by name; a context manager that closes it."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    self.fd = os.open(self.path, os.O_RDONLY)
    try:
      self.tensors = self._header()
    except BaseException:
      os.close(self.fd)
      raise

  def _header(self) -> dict[str, Tensor]:
    """The tensors, once the header passes the format's checks (as the `safetensors` library makes them):
    a JSON object of entries whose byte spans, sorted, tile the data area exactly."""
    size = os.fstat(self.fd).st_size
    prefix = os.pread(self.fd, 8, 0)
    length = struct.unpack('<Q', prefix)[0] if len(prefix) == 8 else -1
    if not 0 < length <= min(MAX_HEADER, size - 8):
      raise SafetensorsError(f'{self.path} is not a safetensors file (no valid header length).')
    text = os.pread(self.fd, length, 8)
    try:
      header = json.loads(text.decode('utf-8'), parse_constant=_no_constant)
    except ValueError as e:
      raise SafetensorsError(f'{self.path} is not a safetensors file: its header is not JSON ({e}).'
                             ) from None
    if not isinstance(header, dict):
      raise SafetensorsError(f'{self.path} is not a safetensors file: its header is not a JSON object.')
    metadata = header.pop('__metadata__', {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
      raise SafetensorsError(f'{self.path}: its __metadata__ must map names to strings.')
    entries = sorted(((self._entry(name, info), name) for name, info in header.items()),
                     key=lambda e: e[0][2])
    data, expected = 8 + length, 0
    tensors, spare = {}, []
    for (dtype, shape, (begin, end)), name in entries:
      if begin != expected or end < begin:
        raise SafetensorsError(f'{self.path}: tensor {name!r} spans bytes {begin}..{end} of the data, but '
                               'the spans must follow each other without gaps or overlaps (next free byte: '
                               f'{expected}); the file is damaged.')
      if end - begin != math.prod(shape) * dtype.itemsize:
        raise SafetensorsError(f'{self.path}: tensor {name!r} of shape {shape} ({dtype.name}) does not fit '
                               f'its {end - begin} bytes at {begin}; the file is damaged.')
      tensors[name], expected = Tensor(self.fd, data + begin, shape, dtype, spare), end
    if data + expected != size:
      raise SafetensorsError(f'{self.path}: its tensors cover {expected} bytes of data but the file holds '
                             f'{size - data} (the file is damaged or cut short).')
    return tensors

  def _entry(self, name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of a header entry whose values have the format's types."""
    try:
      dtype, shape, offsets = np.dtype(DTYPES[info['dtype']]), info['shape'], info['data_offsets']
    except (KeyError, TypeError, ValueError):
      raise SafetensorsError(f'{self.path}: tensor {name!r} has an unreadable entry {info!r} (dtypes read: '
                             f'{", ".join(DTYPES)}).') from None
    if not (isinstance(shape, list) and all(_is_size(n) for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(n) for n in offsets)):
      raise SafetensorsError(f'{self.path}: tensor {name!r} needs a shape and two data_offsets of '
                             f'non-negative integers, not {info!r}.')
    return dtype, tuple(shape), tuple(offsets)

  def close(self) -> None:
    os.close(self.fd)

  def __enter__(self) -> File:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def _is_size(n: Any) -> bool:
  return isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2 ** 64


def _no_constant(name: str) -> None:
  raise ValueError(f'{name} is not JSON')
