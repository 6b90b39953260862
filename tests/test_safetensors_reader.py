"""mintrain's safetensors reader gives the slices that numpy gives of the tensors `safetensors` wrote."""

import ml_dtypes
import numpy as np
import pytest
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
  with pytest.raises(SafetensorsError, match=r"tensor '\w+' of shape .* does not fit .* \(the file is "
                                             r'damaged or cut short\)'):
    File(tmp_path / 'short.safetensors')
  (tmp_path / 'text.safetensors').write_text('not a checkpoint at all')
  with pytest.raises(SafetensorsError, match='is not a safetensors file'):
    File(tmp_path / 'text.safetensors')
