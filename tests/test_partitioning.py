"""The logical-axis resolver and its errors."""

import random

import flax.linen as nn
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


def test_rules_are_walked_in_priority_order_across_dimensions_as_in_flax():
  # Left to right, `embed` would take `model` first and `mlp` would have no rule left.
  raw = [('mlp', 'model'), ('embed', 'model'), ('embed', None)]
  assert resolve(['embed', 'mlp'], normalize_rules(raw)) == P(None, 'model')
  assert nn.logical_to_mesh_axes(('embed', 'mlp'), raw) == P(None, 'model')


def test_conflict_names_the_later_dimension_that_took_the_axis_by_priority():
  rules = normalize_rules([('mlp', 'model'), ('heads', 'model')])
  with pytest.raises(PartitioningError, match=r'`heads` \(dim 0 of `w`\).*`model` \(by dim 1\)'):
    resolve(['heads', 'mlp'], rules, what='w')


def test_rule_naming_an_axis_twice_is_rejected():
  with pytest.raises(PartitioningError, match='names a mesh axis twice'):
    normalize_rules([('batch', ('data', 'data'))])


def test_malformed_rule_is_rejected():
  with pytest.raises(PartitioningError, match='expected \\(logical_name, mesh_axes\\)'):
    normalize_rules([('batch',)])


@pytest.mark.parametrize('mesh_axes', [3, {'model': 1}, ('data', 3), ('data', ('fsdp', 'model'))])
def test_mesh_axes_other_than_a_name_a_tuple_of_names_or_none_are_rejected(mesh_axes):
  with pytest.raises(PartitioningError, match=r'Bad partitioning rule .*mesh_axes a mesh axis name'):
    normalize_rules([('batch', mesh_axes)])


def test_list_of_mesh_axes_is_accepted_like_a_tuple_as_flax_does():
  assert normalize_rules([('batch', ['data', 'fsdp'])]) == normalize_rules([('batch', ('data', 'fsdp'))])


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


NAMES = ('batch', 'embed', 'mlp', 'heads', 'kv', 'vocab')
MESH_AXES = ('data', 'fsdp', 'model', 'x')


def _random_mesh_axes(rng: random.Random):
  kind = rng.randrange(6)
  if kind == 0:
    return None
  if kind <= 2:
    return rng.choice(MESH_AXES)
  axes = tuple(rng.sample(MESH_AXES, rng.randint(0 if kind == 3 else 1, 3)))
  return list(axes) if kind == 5 else axes


def _per_dim(spec: P, ndim: int) -> tuple[tuple[str, ...], ...]:
  """Mesh axes per dimension, so `'x'`, `('x',)`, `None` and `()` compare by meaning."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _stricter_than_flax(logical_axes, raw_rules, flax_dims) -> set[tuple[int, str]]:
  """Dimensions Flax replicates silently: no rule names them, or every rule for them was taken."""
  failures = set()
  for dim, name in enumerate(logical_axes):
    own = [_per_dim(P(mesh_axes), 1)[0] for rule_name, mesh_axes in raw_rules if rule_name == name]
    used_elsewhere = {a for d, axes in enumerate(flax_dims) if d != dim for a in axes}
    if name is not None and all(axes and set(axes) & used_elsewhere for axes in own):
      failures.add((dim, name))
  return failures


def test_resolution_matches_flax_logical_to_mesh_axes_except_where_mintrain_is_stricter():
  rng = random.Random(0)
  resolved = errors = 0
  for _ in range(10_000):
    logical_axes = [rng.choice((*NAMES, None)) for _ in range(rng.randint(1, 4))]
    logical_axes = [n if n is None or n not in logical_axes[:i] else None for i, n in enumerate(logical_axes)]
    named = [n for n in logical_axes if n is not None] or list(NAMES)
    raw_rules = [(rng.choice(named if rng.random() < 0.8 else NAMES), _random_mesh_axes(rng))
                 for _ in range(rng.randint(1, 8))]
    flax_dims = _per_dim(nn.logical_to_mesh_axes(logical_axes, raw_rules), len(logical_axes))
    failures = _stricter_than_flax(logical_axes, raw_rules, flax_dims)
    case = f'{logical_axes} under {raw_rules}'
    try:
      spec = resolve(logical_axes, normalize_rules(raw_rules), what='case')
    except PartitioningError as e:
      assert any(f'`{name}` (dim {dim} of `case`)' in str(e) for dim, name in failures), (case, str(e))
      errors += 1
    else:
      assert not failures, case
      assert _per_dim(spec, len(logical_axes)) == flax_dims, case
      resolved += 1
  assert resolved > 5000 and errors > 2000
