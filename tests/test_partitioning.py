"""The logical-axis resolver and its errors."""

import pytest
from jax.sharding import PartitionSpec as P

from mintrain.partitioning import (
  AxisRules,
  PartitioningError,
  check_divisible,
  normalize_rules,
  resolve,
  shard_shape,
)

RULES = normalize_rules([
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('embed', None),
    ('mlp', 'model'),
    ('heads', 'model'),
    ('kv', None),
])


def test_first_matching_rule_wins():
  rules = normalize_rules([('mlp', 'model'), ('mlp', 'data')])
  assert resolve(['mlp'], rules) == P('model')


def test_rule_whose_axis_is_taken_falls_back_to_the_next():
  # `batch` takes fsdp, so `embed` cannot: its fallback rule replicates it.
  assert resolve(['batch', 'embed'], RULES) == P(('data', 'fsdp'), None)
  assert resolve(['embed', 'mlp'], RULES) == P('fsdp', 'model')


def test_second_use_of_a_name_falls_back_instead_of_binding_an_axis_twice():
  assert resolve(['embed', 'embed'], RULES) == P('fsdp', None)


def test_tuple_axes_give_a_multi_axis_entry():
  assert resolve(['batch', 'kv'], RULES) == P(('data', 'fsdp'), None)


def test_none_rule_replicates_and_none_axis_is_replicated():
  assert resolve(['kv', None], RULES) == P(None, None)


def test_missing_rule_is_an_error_naming_the_axis_and_the_fix():
  with pytest.raises(PartitioningError, match=r"`vocab` \(dim 1 of `out.w`\).*\('vocab', None\)"):
    resolve(['embed', 'vocab'], RULES, what='out.w')


def test_conflict_without_fallback_is_an_error():
  rules = normalize_rules([('mlp', 'model'), ('heads', 'model')])
  with pytest.raises(PartitioningError, match=r'`heads` \(dim 1 of `w`\).*`model` \(by dim 0\)'):
    resolve(['mlp', 'heads'], rules, what='w')


def test_rule_naming_an_axis_twice_is_rejected():
  with pytest.raises(PartitioningError, match='names a mesh axis twice'):
    normalize_rules([('batch', ('data', 'data'))])


def test_malformed_rule_is_rejected():
  with pytest.raises(PartitioningError, match='expected \\(logical_name, mesh_axes\\)'):
    normalize_rules([('batch',)])


def test_rule_naming_an_unknown_mesh_axis_is_rejected():
  rules = AxisRules(normalize_rules([('batch', 'dp')]))
  with pytest.raises(PartitioningError, match="mesh axis 'dp', which is not in the mesh"):
    rules.check_mesh_axes(('data', 'fsdp', 'model'))


def test_param_rules_apply_to_storage_only():
  rules = AxisRules(normalize_rules([('embed', None), ('mlp', 'model')]),
                    param_rules=normalize_rules([('embed', 'fsdp')]))
  assert rules.param_spec(['embed', 'mlp']) == P('fsdp', 'model')
  assert rules.activation_spec(['embed', 'mlp']) == P(None, 'model')


def test_divisibility_error_names_parameter_dimension_size_axes_and_fix():
  with pytest.raises(PartitioningError) as e:
    check_divisible('blocks.0.mlp.wi', (64, 1002), ('embed', 'mlp'), P(None, 'model'), {'model': 8})
  message = str(e.value)
  for part in ('`mlp`', 'dim 1', '`blocks.0.mlp.wi`', 'size 1002', '`model` of size 8', '1002 % 8 != 0',
               'multiple of 8', 'map `mlp` to None'):
    assert part in message


def test_divisibility_counts_the_product_of_tuple_axes():
  with pytest.raises(PartitioningError, match='12 % 8 != 0'):
    check_divisible('x', (12,), ('batch',), P(('data', 'fsdp')), {'data': 4, 'fsdp': 2})
  check_divisible('x', (16,), ('batch',), P(('data', 'fsdp')), {'data': 4, 'fsdp': 2})


def test_shard_shape_divides_by_each_dimension_s_axes():
  mesh_shape = {'data': 2, 'fsdp': 2, 'model': 4}
  assert shard_shape((16, 64, 8), P(('data', 'fsdp'), 'model'), mesh_shape) == (4, 16, 8)
