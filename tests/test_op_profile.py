"""benchmarks/op_profile.py on programs whose ops are known: the matmul FLOPs read off the compiled HLO,
and the real profiler's events matched to the compiled program's ops."""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from helpers import REPO
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_SPEC = importlib.util.spec_from_file_location('benchmarks_op_profile', REPO / 'benchmarks' / 'op_profile.py')
op_profile = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(op_profile)


def traced(compiled, args, directory: pathlib.Path, steps: int):
  jax.block_until_ready(compiled(*args))  # Outside the trace.
  jax.profiler.start_trace(str(directory))
  for _ in range(steps):
    jax.block_until_ready(compiled(*args))
  jax.profiler.stop_trace()
  return op_profile.breakdown(compiled.as_text(), op_profile.newest_trace(directory), steps=steps)


def test_a_two_layer_gradient_counts_its_six_matmuls_flops_and_all_its_time(tmp_path):
  m, k, n, o = 64, 128, 96, 32
  x, w1, w2 = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate(((m, k), (k, n), (n, o))))
  loss = lambda x, w1, w2: jnp.sum(jnp.square(jnp.tanh(x @ w1) @ w2))  # noqa: E731
  compiled = jax.jit(jax.grad(loss, argnums=(1, 2))).lower(x, w1, w2).compile()
  result = traced(compiled, (x, w1, w2), tmp_path, steps=3)
  # Forward x @ w1 and h @ w2; backward the gradients of w2 and w1, and of h (x needs none).
  expected = 2 * (m * k * n + m * n * o + n * m * o + m * n * o + k * m * n) / 1e9
  np.testing.assert_allclose(result.matmul_gflop, expected, rtol=1e-9)
  assert result.ms(op_profile.MATMUL) > 0 and result.unmatched_ms == 0
  assert sum(result.backward_ms.values()) > 0  # The gradients' ops are told from the forward ones.
  header, table = op_profile.rows({'step': result})
  assert header == ['part', 'step ms', 'step share']
  [total] = [row for row in table if row[0] == 'all ops']
  assert float(total[1]) == round(result.total_ms, 1)


def test_a_sharded_sum_shows_its_all_reduce_and_each_devices_share_of_the_matmul(tmp_path):
  mesh = jax.make_mesh((2,), ('data',), devices=jax.devices()[:2])
  x = jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh, P('data')))
  w = jax.device_put(jnp.ones((128, 256)), NamedSharding(mesh, P()))
  compiled = jax.jit(lambda x, w: jnp.sum(x @ w)).lower(x, w).compile()
  result = traced(compiled, (x, w), tmp_path, steps=2)
  np.testing.assert_allclose(result.matmul_gflop, 2 * 32 * 128 * 256 / 1e9, rtol=1e-9)  # Half the rows each.
  assert result.ms('all-reduce (collective)') > 0
