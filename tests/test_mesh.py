"""Mesh construction from the config."""

import math
import types

import jax
import numpy as np
import pytest
from helpers import load_config
from jax.sharding import AxisType

from mintrain.errors import ConfigError
from mintrain.mesh import (
  AXES,
  MeshError,
  describe,
  describe_levels,
  device_grid,
  make_mesh,
  mesh_shape,
  slice_shape,
)


def test_sizes_are_taken_in_stage_data_fsdp_expert_context_model_order():
  mesh = make_mesh({'data': 1, 'fsdp': 2, 'expert': 2, 'context': 1, 'model': 2})
  assert mesh.axis_names == ('stage', 'data', 'fsdp', 'expert', 'context', 'model')
  assert dict(mesh.shape) == {'stage': 1, 'data': 1, 'fsdp': 2, 'expert': 2, 'context': 1, 'model': 2}
  assert [d.id for d in mesh.devices.flat] == list(range(8))


def test_an_axis_left_out_has_size_one():  # As in the mesh a checkpoint saved before an axis existed.
  mesh = make_mesh({'data': 2, 'fsdp': 2, 'model': 2})
  assert dict(mesh.shape) == {'stage': 1, 'data': 2, 'fsdp': 2, 'expert': 1, 'context': 1, 'model': 2}


def test_a_mesh_without_expert_or_context_reads_as_before():
  assert (describe({'data': 4, 'fsdp': 1, 'expert': 1, 'context': 1, 'model': 2})
          == 'data=4 x fsdp=1 x model=2')
  assert (describe({'data': 2, 'fsdp': 1, 'expert': 4, 'context': 1, 'model': 1})
          == 'data=2 x fsdp=1 x expert=4 x model=1')
  assert (describe({'data': 2, 'fsdp': 1, 'expert': 1, 'context': 2, 'model': 2})
          == 'data=2 x fsdp=1 x context=2 x model=2')


def test_all_axes_are_explicit():
  mesh = make_mesh({'data': 4, 'fsdp': 1, 'model': 2})
  assert mesh.axis_types == (AxisType.Explicit,) * len(AXES)


def test_minus_one_takes_the_remaining_devices():
  assert mesh_shape({'data': -1, 'fsdp': 1, 'model': 2}, 8) == (1, 4, 1, 1, 1, 2)
  assert dict(make_mesh({'data': 1, 'fsdp': -1, 'model': 1}).shape)['fsdp'] == 8


def test_a_subset_of_devices_gives_a_smaller_mesh():
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'model': 1}, jax.devices()[:1])
  assert mesh.size == 1


def test_wrong_product_names_mesh_device_count_and_platform():
  with pytest.raises(MeshError, match=r'data=4, fsdp=1, model=4.*needs 16 devices.*8 cpu devices'):
    make_mesh({'data': 4, 'fsdp': 1, 'model': 4})


def test_minus_one_that_cannot_divide_the_devices_is_an_error():
  with pytest.raises(MeshError, match='8 % 3 != 0'):
    mesh_shape({'data': -1, 'fsdp': 3, 'model': 1}, 8, 'cpu')


def fake_slices(num_slices: int, per_slice: int) -> list:
  """Stand-ins for the devices of a multi-slice TPU job, interleaved across slices as a device list
  may be: what the hybrid mesh reads of a device."""
  return [types.SimpleNamespace(id=i, slice_index=i % num_slices, process_index=i % num_slices,
                                platform='cpu', device_kind='cpu') for i in range(num_slices * per_slice)]


@pytest.mark.parametrize('dcn', [(1, 2, 1, 1, 1, 1), (1, 1, 2, 1, 1, 1), (1, 2, 2, 1, 1, 1),
                                 (2, 1, 1, 1, 1, 1)])
def test_a_multi_slice_grid_keeps_each_slice_whole_and_makes_it_the_outer_factor_of_its_axes(dcn):
  devices = fake_slices(math.prod(dcn), 8)
  shape = tuple(k * n for k, n in zip((1, 2, 2, 1, 1, 2), dcn))  # 1 x 2 x 2 x 1 x 1 x 2 within each slice.
  grid = device_grid(shape, dcn, devices)
  assert grid.shape == shape
  slice_of = np.vectorize(lambda d: d.slice_index)(grid)
  ici = [s // n for s, n in zip(shape, dcn)]
  for index in np.ndindex(*dcn):  # Each block of the grid is one slice: ICI axes inside, DCN ways outside.
    block = slice_of[tuple(slice(i * n, (i + 1) * n) for i, n in zip(index, ici))]
    assert len(np.unique(block)) == 1
  assert len(np.unique(slice_of)) == math.prod(dcn)
  for group in slice_of.reshape(-1, shape[-1]):  # A `model` group never leaves its slice.
    assert len(set(group)) == 1
  assert sorted(d.id for d in grid.flat) == list(range(len(devices)))


def test_a_mesh_that_asks_for_more_slices_than_the_devices_have_names_both_counts():
  with pytest.raises(MeshError, match=r'across 4 slices .*mesh.dcn_data=4.* are in 2 slices'):
    device_grid((1, 4, 1, 1, 1, 2), (1, 4, 1, 1, 1, 1), fake_slices(2, 4))


def test_only_stage_data_and_fsdp_may_span_slices():
  with pytest.raises(MeshError, match='not model'):
    slice_shape((1, 4, 1, 1, 1, 2), {'model': 2})
  with pytest.raises(MeshError, match='not context'):
    slice_shape((1, 4, 1, 1, 2, 1), {'context': 2})
  with pytest.raises(MeshError, match='not expert'):  # Its all-to-alls run in every MoE layer.
    slice_shape((1, 4, 1, 2, 1, 1), {'expert': 2})
  with pytest.raises(MeshError, match=r'mesh.data=6 cannot go 4 ways.*mesh.dcn_data=4'):
    slice_shape((1, 6, 1, 1, 1, 1), {'data': 4})
  assert slice_shape((2, 4, 1, 1, 1, 1), {'stage': 2}) == (2, 1, 1, 1, 1, 1)  # Stages talk least.


def test_a_single_process_run_with_one_slice_is_todays_mesh():
  mesh = make_mesh({'data': 4, 'fsdp': 1, 'model': 2}, slices={'data': 1, 'fsdp': 1})
  assert mesh.devices.tolist() == make_mesh({'data': 4, 'fsdp': 1, 'model': 2}).devices.tolist()
  assert describe_levels(mesh) == ''


def test_dcn_sizes_must_divide_their_axis():
  with pytest.raises(ConfigError, match=r'mesh.dcn_data=3 must divide mesh.data=4'):
    load_config('dp4_tp2', 'mesh.dcn_data=3')
