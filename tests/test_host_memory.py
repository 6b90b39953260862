"""Host memory: from save to save, scripts/train.py in a subprocess, saving and evaluating as it trains,
reports its RSS right after each save, and the RSS must not grow; host arrays that devices adopt."""

import os
import re
import resource
import sys

import jax
import numpy as np
import pytest
from helpers import SCRIPT_DEFAULTS, run_script
from safetensors.numpy import save_file

from mintrain.hf import safetensors as safetensors_reader
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


def test_arrays_carved_from_one_allocation_are_each_adopted_and_keep_their_own_values():
  shapes = [(3, 5), (0, 5), (1000, 300), (7,)]  # Together above HUGE_ARRAY_BYTES.
  hosts = host_allocator.adoptable_arrays(shapes, np.float32)
  assert [h.shape for h in hosts] == shapes
  for i, host in enumerate(hosts):
    host[...] = i
  devices = [jax.device_put(host, device) for host, device in zip(hosts, jax.devices('cpu'))]
  assert [d.unsafe_buffer_pointer() for d in devices if d.size] == [h.ctypes.data for h in hosts if h.size]
  del hosts
  for i, device in enumerate(devices):
    assert device.size == 0 or (np.asarray(device) == i).all()


def test_copy_transposed_equals_numpy_transpose_for_shapes_the_bands_do_not_divide(monkeypatch):
  monkeypatch.setattr(host_allocator, 'TILE_ROWS', 4)
  x = np.random.default_rng(0).standard_normal((10, 7)).astype(np.float32)
  out = np.zeros((9, 12), np.float32)
  host_allocator.copy_transposed(out[1:8, 2:12], x)  # Into a strided view, as the loader does.
  expected = np.zeros_like(out)
  expected[1:8, 2:12] = x.T
  np.testing.assert_array_equal(out, expected)


def memfd_mapped(address: int) -> bool:
  """Whether `address` lies in a mapping of a memory file (memfd) of this process."""
  with open('/proc/self/maps') as f:
    for line in f:
      span, *rest = line.split(maxsplit=5)
      low, high = (int(x, 16) for x in span.split('-'))
      if low <= address < high:
        return len(rest) == 5 and rest[4].startswith('/memfd:')
  return False


@pytest.mark.skipif(not hasattr(os, 'memfd_create'), reason='memory files are Linux-only')
def test_copy_on_write_replicas_are_adopted_show_the_fill_and_a_write_to_one_changes_only_its_own():
  shape = (1024, 1024)  # At HUGE_ARRAY_BYTES.
  fill, replicas = host_allocator.copy_on_write_empty(shape, np.float32, 4)
  fill[...] = np.arange(fill.size, dtype=np.float32).reshape(shape)  # Filled after the replicas are mapped.
  expected = fill.copy()
  devices = [jax.device_put(host, device) for host, device in zip(replicas, jax.devices('cpu'))]
  assert [d.unsafe_buffer_pointer() for d in devices] == [h.ctypes.data for h in replicas]
  assert all(memfd_mapped(h.ctypes.data) for h in replicas)
  replicas[0][:2] = -1.0  # As an in-place write to the first device's buffer: its memory is the replica's.
  assert np.asarray(devices[0])[:2].max() == -1.0
  for device in devices[1:]:
    np.testing.assert_array_equal(np.asarray(device), expected)
  np.testing.assert_array_equal(fill, expected)
  del fill, replicas  # The device buffers keep the memory file.
  np.testing.assert_array_equal(np.asarray(devices[3]), expected)


@pytest.mark.skipif(not hasattr(os, 'memfd_create'), reason='memory files are Linux-only')
def test_rows_read_into_a_replicas_fill_reach_every_replica_without_faulting_its_pages_in(tmp_path):
  tensor = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
  save_file({'w': tensor}, tmp_path / 'w.safetensors')
  descriptors = len(os.listdir('/proc/self/fd'))
  with safetensors_reader.File(tmp_path / 'w.safetensors') as file:
    fill, replicas = host_allocator.copy_on_write_empty((512, 1024), np.float32, 3)  # 2 MiB: 512 pages.
    assert host_allocator.memory_file(fill[1:]) is not None
    assert host_allocator.memory_file(fill[:, 1:]) is None  # Not contiguous: read through the mapping.
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    file.tensors['w'].read_rows(256, fill)
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults < 64  # Through the mapping: 512.
    file.tensors['w'].read_rows(1000, fill[8:32])  # Rows into a part of it.
  expected = tensor[256:768].copy()
  expected[8:32] = tensor[1000:1024]
  for replica in (fill, *replicas):
    np.testing.assert_array_equal(replica, expected)
  del fill, replicas
  assert len(os.listdir('/proc/self/fd')) == descriptors  # The memory file closed with its mappings.


@pytest.mark.skipif(not hasattr(os, 'memfd_create'), reason='memory files are Linux-only')
def test_replicas_hold_no_file_descriptor_once_filled():
  # Every replicated slice of a large model on the CPU has its replicas: a descriptor each would near the
  # usual limit of 1024 (Llama-3.2-1B on 8 data-parallel devices: 113 slices x 8 replicas).
  descriptors = len(os.listdir('/proc/self/fd'))
  kept = []
  for _ in range(3):
    fill, replicas = host_allocator.copy_on_write_empty((512, 1024), np.float32, 4)
    fill[...] = 1.0
    kept.append(replicas)
    del fill
  assert len(os.listdir('/proc/self/fd')) == descriptors
  assert all((replica == 1.0).all() for replicas in kept for replica in replicas)


def test_arrays_under_the_huge_size_get_no_copy_on_write_replicas():
  assert host_allocator.copy_on_write_empty((10,), np.float32, 2) is None
