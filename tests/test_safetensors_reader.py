"""mintrain's safetensors reader gives the slices that numpy gives of the tensors `safetensors` wrote."""

import copy
import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors.numpy import save_file

from mintrain.errors import SafetensorsError
from mintrain.hf import safetensors as safetensors_reader
from mintrain.hf.safetensors import File


@pytest.fixture
def tensors(tmp_path):
  rng = np.random.default_rng(0)
  arrays = {
      'f32': rng.standard_normal((37, 24), dtype=np.float32),
      'bf16': rng.standard_normal((16, 10)).astype(ml_dtypes.bfloat16),
      'f16': rng.standard_normal((5, 6, 7)).astype(np.float16),
      'i64': rng.integers(-1000, 1000, (50,)),
  }
  save_file(arrays, tmp_path / 'x.safetensors', metadata={'format': 'pt'})
  return tmp_path / 'x.safetensors', arrays


def random_slices(rng, shape):
  bounds = [sorted(rng.integers(0, n + 1, 2)) for n in shape]
  return tuple(slice(int(a), int(b) + (a == b and b < n)) for (a, b), n in zip(bounds, shape))


def test_every_slice_equals_numpy_slicing_in_blocks_of_any_size(tensors, monkeypatch):
  path, arrays = tensors
  rng = np.random.default_rng(1)
  for block_bytes in (1, 100, 4 << 20):  # One row per block, a few rows, the whole tensor.
    monkeypatch.setattr(safetensors_reader, 'BLOCK_BYTES', block_bytes)
    with File(path) as file:
      assert {name: t.shape for name, t in file.tensors.items()} == {k: v.shape for k, v in arrays.items()}
      for name, array in arrays.items():
        assert file.tensors[name].dtype == array.dtype
        for _ in range(20):
          index = random_slices(rng, array.shape)
          np.testing.assert_array_equal(file.tensors[name][index], array[index])


def test_blocks_hold_whole_multiples_of_rows_and_cover_the_slice_in_order(tensors, monkeypatch):
  path, arrays = tensors
  monkeypatch.setattr(safetensors_reader, 'BLOCK_BYTES', 5 * 24 * 4)  # Five rows of `f32`.
  with File(path) as file:
    # Each block is overwritten by the next: keep copies.
    tensor = file.tensors['f32']
    index = (slice(2, 37), slice(3, 9))
    blocks = [(offset, rows.copy()) for offset, rows in tensor.row_blocks(index, rows_multiple=4)]
  assert [(offset, len(rows)) for offset, rows in blocks] == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4),
                                                               (20, 4), (24, 4), (28, 4), (32, 3)]
  np.testing.assert_array_equal(np.concatenate([rows for _, rows in blocks]), arrays['f32'][2:37, 3:9])


def test_a_file_cut_short_or_not_safetensors_is_a_one_line_error(tensors, tmp_path):
  path, _ = tensors
  data = path.read_bytes()
  (tmp_path / 'short.safetensors').write_bytes(data[:-10])
  with pytest.raises(SafetensorsError, match=r'cover \d+ bytes of data but the file holds \d+ \(the file is '
                                             r'damaged or cut short\)'):
    File(tmp_path / 'short.safetensors')
  (tmp_path / 'text.safetensors').write_text('not a checkpoint at all')
  with pytest.raises(SafetensorsError, match='is not a safetensors file'):
    File(tmp_path / 'text.safetensors')


def write_raw(path, header, data: bytes, *, raw_header: bytes | None = None) -> None:
  text = raw_header if raw_header is not None else json.dumps(header).encode()
  path.write_bytes(struct.pack('<Q', len(text)) + text + data)


def header_cases():
  """(name, header, data) of well-formed and malformed files: types, signs, overlaps, gaps, lengths."""
  good = {'a': {'dtype': 'F32', 'shape': [2, 3], 'data_offsets': [0, 24]},
          'b': {'dtype': 'I64', 'shape': [2], 'data_offsets': [24, 40]},
          'c': {'dtype': 'BF16', 'shape': [0], 'data_offsets': [40, 40]},
          '__metadata__': {'format': 'pt'}}
  data = bytes(range(40))
  yield 'good', good, data
  rng = np.random.default_rng(0)
  values = [-8, -1, 0, 1, 7, 8, 23, 24, 25, 39, 40, 41, 2 ** 63, 2.0, '8', None, True, [8], {'x': 8}]
  for name in ('a', 'b', 'c'):
    for key, size in (('data_offsets', 2), ('shape', None)):
      for _ in range(25):
        h = copy.deepcopy(good)
        n = size or int(rng.integers(0, 4))
        h[name][key] = [values[int(rng.integers(len(values)))] for _ in range(n)]
        yield f'{name}.{key}={h[name][key]}', h, data
      for v in (None, 8, 'x', [0, 8, 16], [], {'0': 0}):
        h = copy.deepcopy(good)
        h[name][key] = v
        yield f'{name}.{key}={v!r}', h, data
    for dtype in ('F64', 'I8', 'X9', 'f32', 7):  # Some change the size, some are no dtype at all.
      h = copy.deepcopy(good)
      h[name]['dtype'] = dtype
      yield f'{name}.dtype={dtype!r}', h, data
    h = copy.deepcopy(good)
    del h[name]['dtype']
    yield f'{name} without dtype', h, data
  swapped = copy.deepcopy(good)  # Listed out of order but tiling the data: fine.
  swapped['a']['data_offsets'], swapped['b']['data_offsets'] = [16, 40], [0, 16]
  yield 'out of order', swapped, data
  for extra in (b'', b'x', bytes(100)):
    yield f'{len(extra)} extra bytes', good, data + extra
  for cut in (1, 16, 40):
    yield f'cut by {cut}', good, data[:-cut]
  for header in ([], 'text', 3, None, {'__metadata__': {'format': 1}}, {'__metadata__': 'x'}, {}):
    yield f'header={header!r}', header, data if header != {} else b''


@pytest.mark.parametrize('case', list(header_cases()), ids=lambda c: c[0])
def test_a_header_reads_exactly_when_the_safetensors_library_reads_it(case, tmp_path):
  _, header, data = case
  path = tmp_path / 'x.safetensors'
  write_raw(path, header, data)
  try:
    with safetensors.safe_open(path, 'numpy'):
      theirs = 'reads'
  except Exception as e:  # The library's own verdict; which exception it raises is its business.
    theirs = f'refuses ({e})'
  try:
    with File(path) as file:
      names = sorted(file.tensors)
    ours = 'reads'
  except SafetensorsError as e:
    ours = f'refuses ({e})'
  assert ours.split()[0] == theirs.split()[0], (ours, theirs)
  if ours == 'reads':
    assert names == sorted(k for k in header if k != '__metadata__')


@pytest.mark.parametrize('raw', [b'{"a": NaN}', b'\xff\xfe{', b'{"a": {"dtype": "F32"', b'[]'])
def test_a_header_that_is_not_a_json_object_is_one_line(raw, tmp_path):
  write_raw(tmp_path / 'x.safetensors', None, b'', raw_header=raw)
  with pytest.raises(SafetensorsError, match='is not a safetensors file') as e:
    File(tmp_path / 'x.safetensors')
  assert '\n' not in str(e.value)
  with pytest.raises(Exception):  # noqa: B017  The library refuses these too.
    safetensors.safe_open(tmp_path / 'x.safetensors', 'numpy')
