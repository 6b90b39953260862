"""Host memory: from save to save, scripts/train.py in a subprocess, saving and evaluating as it trains,
reports its RSS right after each save, and the RSS must not grow; host arrays that devices adopt."""

import re
import sys

import jax
import numpy as np
import pytest
from helpers import SCRIPT_DEFAULTS, run_script

from mintrain.runtime import host_allocator

# scripts/train.py as a user runs it, plus one line after each save: the process's RSS when it returns.
DRIVER = """
import runpy, sys
from mintrain import actions

def rss_kb():
  with open('/proc/self/status') as f:
    return next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))

save = actions.Save.__call__
def save_and_report(self, info):
  save(self, info)
  print(f'rss after save {info.step}: {rss_kb()} kB', flush=True)

actions.Save.__call__ = save_and_report
sys.argv = ['scripts/train.py', *sys.argv[1:]]
runpy.run_path('scripts/train.py', run_name='__main__')
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/self/status')
def test_rss_after_the_last_save_is_within_5_percent_of_after_the_first(tmp_path):
  # A save and an evaluation every 5 steps, the first before the heap has settled, with XLA's default
  # flags as a user runs (with the tests' single-threaded matmuls the heap settled before the first save):
  # the RSS grew by one step's XLA:CPU temporaries (~100 MB) at a time, at some of the saves.
  result = run_script('-c', DRIVER, '--config', 'mintrain/configs/single.py', '--workdir', str(tmp_path),
                      '--config.train.steps=80', '--config.checkpoint.every_steps=5',
                      '--config.eval.every_steps=5', *SCRIPT_DEFAULTS, '--config.eval.steps=1', timeout=600,
                      env_extra={'XLA_FLAGS': ''})
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  rss = {int(step): int(kb) for step, kb in re.findall(r'rss after save (\d+): (\d+) kB', result.stdout)}
  assert sorted(rss) == list(range(5, 85, 5)), result.stdout[-2000:]
  first, last = rss[5], rss[80]
  series = ', '.join(f'{step}: {kb / 1024:.0f}' for step, kb in rss.items())
  assert abs(last - first) <= 0.05 * first, f'RSS after each save (MB): {series}'


@pytest.mark.parametrize('shape', [(10,), (1024, 1024)])  # Below and above HUGE_ARRAY_BYTES.
def test_adoptable_arrays_become_device_buffers_without_a_copy_and_outlive_their_host_array(shape):
  host = host_allocator.adoptable_empty(shape, np.float32)
  assert host.ctypes.data % host_allocator.ADOPT_ALIGNMENT == 0 and host.flags.writeable
  host[...] = np.arange(host.size, dtype=np.float32).reshape(shape)
  device = jax.device_put(host, jax.devices('cpu')[0])
  assert device.unsafe_buffer_pointer() == host.ctypes.data
  expected = host.copy()
  del host  # The device buffer keeps the memory alive.
  np.testing.assert_array_equal(np.asarray(device), expected)


def test_copy_transposed_equals_numpy_transpose_for_shapes_the_tiles_do_not_divide(monkeypatch):
  monkeypatch.setattr(host_allocator, 'TILE', 4)
  x = np.random.default_rng(0).standard_normal((10, 7)).astype(np.float32)
  out = np.zeros((9, 12), np.float32)
  host_allocator.copy_transposed(out[1:8, 2:12], x)  # Into a strided view, as the loader does.
  expected = np.zeros_like(out)
  expected[1:8, 2:12] = x.T
  np.testing.assert_array_equal(out, expected)
