"""Mesh construction from the config."""

import jax
import pytest
from jax.sharding import AxisType

from mintrain.mesh import MeshError, describe, make_mesh, mesh_shape


def test_sizes_are_taken_in_data_fsdp_expert_model_order():
  mesh = make_mesh({'data': 2, 'fsdp': 2, 'model': 2})
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'expert': 1, 'model': 2}
  mesh = make_mesh({'data': 1, 'fsdp': 2, 'expert': 2, 'model': 2})
  assert mesh.axis_names == ('data', 'fsdp', 'expert', 'model')
  assert [d.id for d in mesh.devices.flat] == list(range(8))


def test_a_mesh_without_expert_reads_as_before():
  assert describe({'data': 4, 'fsdp': 1, 'expert': 1, 'model': 2}) == 'data=4 x fsdp=1 x model=2'
  assert describe({'data': 2, 'fsdp': 1, 'expert': 4, 'model': 1}) == 'data=2 x fsdp=1 x expert=4 x model=1'


def test_all_axes_are_explicit():
  mesh = make_mesh({'data': 4, 'fsdp': 1, 'model': 2})
  assert mesh.axis_types == (AxisType.Explicit,) * 4


def test_minus_one_takes_the_remaining_devices():
  assert mesh_shape({'data': -1, 'fsdp': 1, 'model': 2}, 8) == (4, 1, 1, 2)
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
